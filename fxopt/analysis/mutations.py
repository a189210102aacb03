"""Which values of a torch-level (dynamo) graph are written in place.

A pass that moves or shares reads of a value must not move one across a write: the precision pass
shares one cast of a value among its consumers (placed before the first), cancels a round trip through
a model's `.float()`, and in inference hoists a parameter's cast before the graph runs. A value written
in place (`u.add_(10)`, `x[:, :3] = ...`, `emb.weight` renormalised by `F.embedding(max_norm=...)`), or
any view of its storage, is read where the model reads it instead.
"""
from __future__ import annotations

import functools
import inspect
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from .aliasing import storage_key, written_arguments

# torch-level ops whose result shares args[0]'s storage (a write through one is a write to the other)
_VIEWS = frozenset({
    "view", "view_as", "reshape", "transpose", "t", "permute", "unsqueeze", "squeeze", "expand", "expand_as",
    "narrow", "select", "__getitem__", "getitem", "flatten", "unflatten", "split", "chunk", "unbind", "diagonal",
    "as_strided", "detach", "movedim", "swapaxes", "swapdims", "unfold", "contiguous", "view_as_real",
    "view_as_complex", "_get_data_attr", "ravel", "split_with_sizes", "tensor_split", "hsplit", "vsplit", "dsplit",
    "alias", "moveaxis", "broadcast_to", "unsafe_split", "unsafe_chunk", "real", "imag", "adjoint",
})
# tensor attributes that are views: `b.T.mul_(0.5)` reaches the graph as getattr(b, "T")
_VIEW_ATTRIBUTES = frozenset({"T", "mT", "H", "mH", "data", "real", "imag"})
_IN_PLACE_OPERATORS = frozenset({
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
    operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
    operator.imatmul, operator.setitem,
})


# functions that renormalise their weight argument in place when given max_norm: (weight, max_norm) positions
_RENORMALISING = {F.embedding: (1, 3), F.embedding_bag: (1, 3)}


def _renormalised(node: fx.Node):
    """The weight F.embedding(..., max_norm=...) writes (dynamo keeps the call whole), else None."""
    spec = _RENORMALISING.get(node.target) if node.op == "call_function" else None
    if spec is None:
        return None
    weight_at, norm_at = spec
    max_norm = node.args[norm_at] if len(node.args) > norm_at else node.kwargs.get("max_norm")
    weight = node.args[weight_at] if len(node.args) > weight_at else node.kwargs.get("weight")
    return weight if max_norm is not None else None


def op_name(node: fx.Node) -> str:
    """A call's name without namespace or overload: `masked_fill_` for x.masked_fill_(...) and for
    torch.ops.aten.masked_fill_.Scalar(x, ...) alike."""
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        return getattr(node.target, "__name__", "").split(".")[0]
    return ""


# casts that return their input itself when nothing changes (`s.float()` of an fp32 `s`): a write through
# one writes the input, in eager; the precision pass must see it before it makes the cast a copy
_CASTS = frozenset({"float", "double", "half", "bfloat16", "to", "type", "type_as"})


def returns_its_input(node: fx.Node) -> bool:
    """A cast that returns its input itself (`.float()` of an fp32 tensor on its own device)."""
    return op_name(node) in _CASTS and isinstance(node.args[0], fx.Node) and _same_dtype_cast(node)


def _same_dtype_cast(node: fx.Node) -> bool:
    source, out = (getattr(a, "meta", {}).get("example_value") for a in (node.args[0], node))
    return (isinstance(source, torch.Tensor) and isinstance(out, torch.Tensor) and source.dtype == out.dtype
            and source.device == out.device and not node.kwargs.get("copy", False))


def writes_in_place(node: fx.Node) -> bool:
    """`x.add_(...)`, `torch.embedding_renorm_(w, ...)`, `x += y`, `x[i] = y`, `F.relu(x, inplace=True)`
    or `F.relu(x, True)`: the node writes its first argument."""
    if node.op == "call_function" and node.target in _IN_PLACE_OPERATORS:
        return True
    name = op_name(node)
    return (name.endswith("_") and not name.endswith("__")) or _inplace_flag(node) is True


def _inplace_flag(node: fx.Node):
    """The `inplace` argument of a call (F.relu, F.dropout, F.hardtanh, ...), by keyword or position."""
    if "inplace" in node.kwargs:
        return node.kwargs["inplace"]
    at = _inplace_position(node.target) if node.op == "call_function" else None
    return node.args[at] if at is not None and at < len(node.args) else None


@functools.lru_cache(maxsize=None)
def _inplace_position(fn) -> int | None:
    """Where a Python function takes `inplace` positionally (F.relu: 1, F.dropout: 3), else None."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature
        return None
    for i, p in enumerate(params):
        if p.name == "inplace" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return i
    return None


def _is_view(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target is getattr:
        return len(node.args) == 2 and node.args[1] in _VIEW_ATTRIBUTES
    name = op_name(node)
    return name in _VIEWS or returns_its_input(node)


def storage_root(value) -> fx.Node | None:
    """The node whose storage `value` views (itself when it is not a view)."""
    while isinstance(value, fx.Node) and value.args and _is_view(value):
        value = value.args[0]
    return value if isinstance(value, fx.Node) else None


def written_by(node: fx.Node) -> list[fx.Node]:
    """The values `node` writes in place: an in-place op's first argument (each tensor of a foreach op's
    list; `inplace=True` functions), `out=` tensors, what an operator's schema marks written, the running
    statistics F.batch_norm updates in training, the weight F.embedding(max_norm=...) renormalises."""
    written = [node.args[0]] if writes_in_place(node) and node.args else []
    written.append(node.kwargs.get("out"))  # torch.add(a, b, out=c); torch.sort(x, out=(values, indices))
    written += written_arguments(node) + [_renormalised(node)]
    if node.op == "call_function" and node.target is F.batch_norm:
        training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training", False)
        written += list(node.args[1:3]) if training else []
    flat = []
    for w in written:
        flat += [v for v in w if isinstance(v, fx.Node)] if isinstance(w, (tuple, list)) else [w]
    return [w for w in flat if isinstance(w, fx.Node)]


def written_between(first: fx.Node, last: fx.Node, values) -> fx.Node | None:
    """The first node after `first` and before `last` (graph order) that writes the storage of any of
    `values` in place, else None: a rewrite that moves reads of `values` from `first` to `last` must
    not cross it."""
    roots = {storage_root(v) for v in values} - {None}
    storages = {_storage(v) for v in values} - {None}
    from_outside = any(r.op in _OUTSIDE for r in roots)
    node = first.next
    while node is not last and node.op != "output":
        for written in written_by(node):
            root = storage_root(written)
            # an alias by an op this module does not list as a view (x.reshape_as(y), x.cpu()) shares the
            # example value's storage; two inputs (or an input and a module's tensor) may share memory
            # the graph cannot see
            if root in roots or _storage(written) in storages or (
                    from_outside and root is not None and root.op in _OUTSIDE):
                return node
        node = node.next
    return None


def _storage(value):
    """The storage key of a node's example value (dynamo's fake tensors share storage as the real ones)."""
    return storage_key(value.meta.get("example_value")) if isinstance(value, fx.Node) else None


_OUTSIDE = ("placeholder", "get_attr")  # values the graph is handed: may alias one another


class Mutations:
    """The storages a graph writes in place, by their root values."""

    def __init__(self, graph: fx.Graph):
        self.roots: set[fx.Node] = set()
        for n in graph.nodes:
            self.roots.update(r for r in map(storage_root, written_by(n)) if r is not None)

    def written(self, value) -> bool:
        """Whether `value`, or any value sharing its storage, is written in place somewhere in the graph."""
        return storage_root(value) in self.roots
