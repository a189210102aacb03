"""Cleanup: remove what does nothing, so fusion sees fewer, larger groups.

    before                                   after
    alias = aten.alias.default(sigmoid)      (uses of alias read sigmoid)
    c = prims.convert_element_type(x, f32)   (x is already f32: uses read x)
    a = aten.mul.Tensor(x, y); b = aten.mul.Tensor(x, y)   ->   b's uses read a
    t = aten.permute.default(w, [1, 0]); u = aten.permute.default(t, [1, 0])   ->   u's uses read w

The last is how autograd writes a Linear's weight gradient and input gradient (t(t(w))): every view
the wrapper keeps costs a dispatcher call per training step, and a chain of views that ends where it
started is the tensor it started from.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ..analysis.symbolic import sizes, storage_offset, strides
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


def _is_noop(node: fx.Node) -> bool:
    """A view or cast whose result has exactly its input's dtype, shape and strides."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    t = node.target
    if t in VIEWS:
        return _same_meta(node, node.args[0])
    if t is prims.convert_element_type.default or t is aten._to_copy.default:
        # a copy: only dropped when its result is not returned (an output must not alias an input)
        returned = any(u.op == "output" for u in node.users)
        return not returned and _same_meta(node, node.args[0])
    return False


@dataclass(frozen=True)
class Cleanup:
    name: str = "cleanup"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        stats = {"noops_removed": 0, "view_chains_folded": 0, "cse_merged": 0, "dead_removed": 0}
        for node in list(gm.graph.nodes):
            if _is_noop(node):
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
