"""Which nodes of an ATen graph share storage, and which storages the graph writes.

Aot_autograd's functional graphs still alias: views (`t`, `slice`, `split` and its getitems, ...) share
their input's storage, outputs may be views, and a graph input the program mutates is written back by an
`aten.copy_` at the end (the input-mutation epilogue). A pass that removes a copy (cleanup's no-op
clones) must keep it where the copy's reader would otherwise see a storage that something writes, or
where a returned value would alias what the copy protected.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from .op_classes import is_view


def view_source(node: fx.Node) -> fx.Node | None:
    """The node whose storage `node` shares: a view op's input, or the list a getitem takes from a view
    op (split, unbind); None for anything else."""
    if is_view(node) and node.args and isinstance(node.args[0], fx.Node):
        return node.args[0]
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
            and is_view(node.args[0]) and isinstance(node.args[0].args[0], fx.Node):
        return node.args[0].args[0]
    return None


def storage_root(node: fx.Node) -> fx.Node:
    """The node at the top of `node`'s chain of views: the one whose storage it is."""
    while (source := view_source(node)) is not None:
        node = source
    return node


def views_of(node: fx.Node) -> list[fx.Node]:
    """`node` and every view of it (a view of a view, a split's pieces, ...): what shares its storage."""
    found, stack = [], [node]
    while stack:  # (views form a tree: no cycles)
        v = stack.pop()
        found.append(v)
        stack += [u for u in v.users if view_source(u) is v
                  or (u.op == "call_function" and u.target is operator.getitem and is_view(v))]
    return found


def returned_through_views(node: fx.Node) -> bool:
    """`node`, or any view of it, is an output of the graph."""
    return any(u.op == "output" for v in views_of(node) for u in v.users)


def written_arguments(node: fx.Node) -> list:
    """The arguments a call's operator schema marks written (`Tensor(a!)`): `aten.copy_(input, new)` of the
    input-mutation epilogue, `index_put_`, explicit overloads in torch-level graphs, custom ops declared
    with mutates_args (a packet through its default overload)."""
    target = node.target
    schema = getattr(target, "_schema", None) or getattr(getattr(target, "default", None), "_schema", None)
    if node.op != "call_function" or not isinstance(schema, torch._C.FunctionSchema):
        return []
    return [node.args[i] if i < len(node.args) else node.kwargs.get(spec.name)
            for i, spec in enumerate(schema.arguments) if spec.alias_info is not None and spec.alias_info.is_write]


def written_roots(graph: fx.Graph) -> set[fx.Node]:
    """The storage roots of every argument some node writes in place (written_arguments)."""
    return {storage_root(v) for n in graph.nodes for v in written_arguments(n) if isinstance(v, fx.Node)}


def storage_key(value):
    """A key equal for tensors that share storage (fake tensors share it as the real ones would), else
    None: not a tensor, or one without a plain storage (sparse, nested)."""
    if not isinstance(value, torch.Tensor) or value.is_sparse:
        return None
    try:
        return StorageWeakRef(value.untyped_storage())
    except (NotImplementedError, RuntimeError):
        return None
