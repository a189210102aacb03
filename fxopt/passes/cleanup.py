"""Cleanup: remove what does nothing, so fusion sees fewer, larger groups.

    before                                   after
    alias = aten.alias.default(sigmoid)      (uses of alias read sigmoid)
    c = prims.convert_element_type(x, f32)   (x is already f32: uses read x)
    a = aten.mul.Tensor(x, y); b = aten.mul.Tensor(x, y)   ->   b's uses read a
    t = aten.permute.default(w, [1, 0]); u = aten.permute.default(t, [1, 0])   ->   u's uses read w
    c = aten.copy.default(new_empty_strided(...), g)   ->   c = aten.clone.default(g, contiguous)
    c = aten.lift_fresh_copy.default(_tensor_constant0)  (uses read the constant: nothing writes it)

The last is how autograd writes a Linear's weight gradient and input gradient (t(t(w))): every view
the wrapper keeps costs a dispatcher call per training step, and a chain of views that ends where it
started is the tensor it started from.

A functional copy into a tensor of the same shape and dtype is its source's values in the
destination's layout: DDP's python reducer copies each gradient twice that way (into a fresh
`new_empty_strided`, and the all-reduced result back), 100 ATen copies a step of ~60 us of host time
each for four GPT-2 blocks on the H200 host. As a contiguous clone, a pointwise op, the copy fuses
into the kernel beside it; the copy out of an all-reduced gradient, a buffer nothing else holds,
is no copy at all.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ..analysis.aliasing import returned_through_views, storage_root, written_roots
from ..analysis.op_classes import is_collective, is_wait
from ..analysis.symbolic import row_major_strides, sizes, storage_offset, strides
from ..pass_manager import PassContext, PassResult
from .cse import eliminate_common_subexpressions

aten = torch.ops.aten
prims = torch.ops.prims


def _same_meta(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dtype == vb.dtype
            and sizes(va) == sizes(vb) and strides(va) == strides(vb) and va.device == vb.device
            and storage_offset(va) == storage_offset(vb))  # sympy for symbolic sizes: no guards


VIEWS = (aten.alias.default, aten.view.default, aten.expand.default, aten.permute.default, aten.t.default,
         aten.transpose.int, aten._unsafe_view.default, aten.squeeze.dim, aten.squeeze.dims,
         aten.unsqueeze.default, aten.slice.Tensor, aten.reshape.default)


def _is_view(node) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target in VIEWS
            and bool(node.args) and isinstance(node.args[0], fx.Node))


def _view_chain_root(node: fx.Node) -> fx.Node | None:
    """The earliest tensor up `node`'s chain of views that `node` is identical to (same storage
    offset, sizes, strides, dtype), or None: permute(permute(w)) is w."""
    found, cur = None, node
    while _is_view(cur):
        cur = cur.args[0]
        if _same_meta(node, cur):
            found = cur
    return found


def _is_noop(node: fx.Node, written: set[fx.Node]) -> bool:
    """A view or cast whose result has exactly its input's dtype, shape and strides. `written`: the
    storage roots the graph writes in place (aliasing.written_roots)."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    t = node.target
    if t is aten.lift_fresh_copy.default:
        # a `torch.tensor(...)` constant (attention's position-bias slopes): a graph aot_autograd
        # functionalised writes no intermediate, so only a copy returned (or a view of it) must stay a copy
        return node.args[0].op == "get_attr" and not returned_through_views(node)
    if t in VIEWS:
        return _same_meta(node, node.args[0])
    if t in (prims.convert_element_type.default, aten._to_copy.default, aten.clone.default):
        # a copy: only dropped when neither it nor a view of it is returned (an output must not alias an
        # input: `x.clone().t()`) and nothing writes what it copies (`old = x.clone(); x.mul_(2)`, a buffer
        # swap: the epilogue's copy_ into x runs before a reader of `old`), or when what it copies is a
        # collective's result that nothing else reads (a buffer of its own)
        if storage_root(node.args[0]) in written:
            return False
        return ((not returned_through_views(node) or _owned_collective_result(node.args[0]))
                and _same_meta(node, node.args[0]))
    return False


def _owned_collective_result(node: fx.Node) -> bool:
    """The wait on a collective whose result only this one reader sees (DDP's reducer's all-reduced
    gradient, copied out once): the collective made the buffer, nobody else holds it."""
    collective = node.args[0] if is_wait(node) and node.args and isinstance(node.args[0], fx.Node) else None
    return (collective is not None and len(node.users) == 1 and is_collective(collective)
            and not is_wait(collective) and set(collective.users) == {node})


def _copy_as_clone(node: fx.Node) -> bool:
    """`aten.copy.default(dst, src)` -> `aten.clone.default(src, memory_format=contiguous)` where dst
    is contiguous and has src's shape, dtype and device (dst's values are never read: only its layout)."""
    if node.op != "call_function" or node.target is not aten.copy.default or len(node.args) != 2 or node.kwargs:
        return False
    dst, src = node.args
    vd, vs = (a.meta.get("val") if isinstance(a, fx.Node) else None for a in (dst, src))
    if not (isinstance(vd, torch.Tensor) and isinstance(vs, torch.Tensor) and vd.layout == torch.strided
            and vd.dtype == vs.dtype and vd.device == vs.device and sizes(vd) == sizes(vs)
            and strides(vd) == row_major_strides(sizes(vd))):
        return False
    with node.graph.inserting_before(node):
        clone = node.graph.call_function(aten.clone.default, (src,), {"memory_format": torch.contiguous_format})
    clone.meta.update(node.meta)
    node.replace_all_uses_with(clone)
    node.graph.erase_node(node)
    return True


@dataclass(frozen=True)
class Cleanup:
    name: str = "cleanup"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        stats = {"noops_removed": 0, "view_chains_folded": 0,
                 "copies_as_clones": sum(_copy_as_clone(n) for n in list(gm.graph.nodes)),
                 "cse_merged": 0, "dead_removed": 0}
        written = written_roots(gm.graph)
        for node in list(gm.graph.nodes):
            if _is_noop(node, written):
                node.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(node)
                stats["noops_removed"] += 1
        for node in list(gm.graph.nodes):
            root = _view_chain_root(node) if _is_view(node) else None
            if root is not None and not any(u.op == "output" for u in node.users):
                # (outputs keep their own view: aot_autograd recorded how each output aliases others)
                node.replace_all_uses_with(root)
                stats["view_chains_folded"] += 1
        stats["cse_merged"] = eliminate_common_subexpressions(gm.graph)
        before = len(gm.graph.nodes)
        gm.graph.eliminate_dead_code()
        stats["dead_removed"] = before - len(gm.graph.nodes)
        return PassResult(gm, any(stats.values()), stats)
