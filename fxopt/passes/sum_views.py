"""A sum over dim 0 of a view that flattens leading dims becomes a sum over those dims of the original.

A Linear's backward sums its output gradient over the tokens for the bias gradient, after autograd
flattened it: `sum(view(dy, [B*T, C]), [0])`. Summing `dy` [B, T, C] over dims (0, 1) is the same
number, and in that form the sum has the shape of the row kernel that computed `dy` (a norm's
backward), so the fuser can produce it as that kernel's column sums instead of reading `dy` back in a
kernel of its own (fuse_reductions.py). Only for a `dy` that is such a row kernel's value (`row_value`). Only static sizes and views whose leading dims are exactly the
flattened ones; a `keepdim=True` sum only where every use views its [1, C] down to [C] (autograd's
bias gradient: `sum(dy2d, [0], True).view(C)`), which then reads the new sum directly. The values are
the same tensors (shape, dtype), so nothing downstream changes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..analysis.op_classes import classify, is_view
from ..analysis.reductions import reduces_trailing_dims, reduction_info
from ..analysis.symbolic import is_symbolic
from ..pass_manager import PassContext, PassResult

aten = torch.ops.aten
_FLATTENING_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def flattened_lead(view: fx.Node) -> int | None:
    """k when `view` reshapes x [d0, ..., d(k-1), *rest] to [d0 * ... * d(k-1), *rest] with k >= 2."""
    if view.op != "call_function" or view.target not in _FLATTENING_VIEWS:
        return None
    x, out = view.args[0].meta.get("val"), view.meta.get("val")
    if not (isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor)) or out.dim() < 1:
        return None
    xs, os_ = tuple(x.shape), tuple(out.shape)
    if any(is_symbolic(s) for s in xs + os_):
        return None
    k = x.dim() - (out.dim() - 1)
    if k < 2 or xs[k:] != os_[1:] or math.prod(xs[:k]) != os_[0]:
        return None
    return k


def row_value(x: fx.Node, limit: int = 64) -> bool:
    """Whether `x` is computed, through pointwise ops, from a reduction over its own trailing dims (a
    norm backward's dx is, through its row sums): then a sum of x over its leading dims is a column sum
    the row kernel produces from registers (fuse_reductions.py). A sum of any other tensor stays a sum
    of the 2-D view: fused with pointwise producers instead, it would move their work into the
    column-sum schedule (few programs, strided columns), which measured slower on the H200 (GPT-2
    block backward 2.09 -> 2.51 ms, benchmarks/results/2026-12-01-h200-c.md)."""
    shape = tuple(x.meta["val"].shape)
    seen, stack = set(), [x]
    while stack and len(seen) < limit:
        n = stack.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        info = reduction_info(n)
        if info is not None:
            if info.in_shape == shape and reduces_trailing_dims(shape, info.dims):
                return True
            continue
        if is_view(n) or classify(n) != "pointwise":
            continue
        stack += n.all_input_nodes
    return False


def sum_over_dim0(node: fx.Node) -> bool | None:
    """For aten.sum.dim_IntList(v, [0]) (or [-n]): its keepdim; None for anything else."""
    if node.op != "call_function" or node.target is not aten.sum.dim_IntList:
        return None
    v = node.args[0]
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    val = v.meta.get("val") if isinstance(v, fx.Node) else None
    if isinstance(val, torch.Tensor) and val.dim() >= 1 and dims is not None and len(dims) == 1 \
            and dims[0] % val.dim() == 0:
        return bool(keepdim)
    return None


def _drops_leading_one(view: fx.Node, rest: tuple) -> bool:
    """A view of a keepdim sum [1, *rest] down to [*rest] (how autograd shapes a bias gradient)."""
    val = view.meta.get("val")
    return (view.op == "call_function" and view.target in _FLATTENING_VIEWS and isinstance(val, torch.Tensor)
            and tuple(val.shape) == rest)


@dataclass(frozen=True)
class SumsThroughViews:
    name: str = "sums_through_views"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        rewritten = 0
        for node in list(gm.graph.nodes):
            keepdim = sum_over_dim0(node)
            k = flattened_lead(node.args[0]) if keepdim is not None else None
            if k is None:
                continue
            x = node.args[0].args[0]
            if not row_value(x):
                continue
            rest = tuple(x.meta["val"].shape[k:])
            # keepdim: [1, *rest] only where every use views it down to [*rest]
            replaced = list(node.users) if keepdim else [node]
            if keepdim and not all(_drops_leading_one(u, rest) for u in replaced):
                continue
            dtype = node.kwargs.get("dtype")
            with gm.graph.inserting_before(node):
                total = gm.graph.call_function(aten.sum.dim_IntList, (x, list(range(k))),
                                               {"dtype": dtype} if dtype is not None else {})
            total.meta.update(replaced[0].meta)  # the same values: [*rest] in the sum's dtype
            for old in replaced:
                old.replace_all_uses_with(total)
            rewritten += 1
        if rewritten:
            gm.graph.eliminate_dead_code()
            gm.recompile()
        return PassResult(gm, bool(rewritten), {"rewritten": rewritten})
