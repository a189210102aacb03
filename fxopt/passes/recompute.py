"""Recompute cheap row values for reductions over other dims, instead of storing and reloading them.

A LayerNorm backward computes x_hat = (x - mean) * rstd and dy * w for its row sums (over the hidden
dim) and again for its column sums (dw, db: over the tokens). The two kinds of reduction cannot share
a kernel, so without this pass the row kernel writes those values out in fp32 and the column kernel
reads them back. This pass gives the column reduction its own copy of the pointwise chain, computed
from the chain's inputs, when that reads fewer bytes than the write-and-reload it replaces.

Column sums that passes/fuse_reductions.py can put into the row group itself (analysis/reductions.
is_column_sum_of: rows that fit in registers) count as the row group's: their chains need no copy.

Cost rule: copy the chain (at most MAX_CHAIN ops) feeding reduction r when the full-size inputs the copy
reads are fewer bytes than twice (one write, one read) the full-size values r's group would otherwise
load from other groups.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..analysis.op_classes import pointwise_unsupported_reason
from ..analysis.symbolic import hint, same, sizes
from ..analysis.reductions import is_column_sum_of, reduction_info, reduction_unsupported_reason
from ..pass_manager import PassContext, PassResult

MAX_CHAIN = 32
# reductions whose result is one of their input's elements, which a backward finds again by equality
# (amax's gradient goes where input == amax): their input is never recomputed when another kernel also
# makes it, since two kernels may round it differently (softmax as exp * (1/sum) in the row kernel and
# exp / sum in a copy did, before codegen/division.py; exact and approximate math still may) and no
# element would then equal the result (gradients 0/0 = NaN)
SELECTIONS = frozenset({torch.ops.aten.amax.default, torch.ops.aten.amin.default, torch.ops.aten.max.dim,
                        torch.ops.aten.min.dim, torch.ops.aten.max.default, torch.ops.aten.min.default,
                        torch.ops.aten.argmax.default, torch.ops.aten.argmin.default})
RESERVED_FOR = "fxopt_reduction_key"  # node.meta key: the reduction group a copied op belongs to


def _nbytes(node: fx.Node) -> int:
    v = node.meta.get("val")
    return hint(v.numel()) * v.element_size() if isinstance(v, torch.Tensor) else 0  # a cost: example sizes


def _chain(r: fx.Node, shape, target: str) -> list[fx.Node]:
    """The pointwise ops of the reduction's input shape that feed r, in graph order."""
    seen, stack = set(), [r.args[0]]
    while stack:
        n = stack.pop()
        if n in seen or not isinstance(n, fx.Node):
            continue
        v = n.meta.get("val")
        if not (isinstance(v, torch.Tensor) and sizes(v) == shape
                and pointwise_unsupported_reason(n, target) is None):
            continue
        seen.add(n)
        stack += n.all_input_nodes
    order = {n: i for i, n in enumerate(r.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


@dataclass(frozen=True)
class RecomputeForReductions:
    name: str = "recompute_for_reductions"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        stats = {"chains_copied": 0, "ops_copied": 0}
        if not ctx.options.fuse:
            return PassResult(gm, False, stats)
        reductions = [n for n in gm.graph.nodes if reduction_info(n) is not None]
        own_keys = {reduction_info(n).key for n in reductions}
        group_key = {r: next((k for k in own_keys if is_column_sum_of(r, k)), reduction_info(r).key)
                     for r in reductions}
        if len(set(group_key.values())) < 2:  # one kind of reduction: every chain can live in one group
            return PassResult(gm, False, stats)
        for r in reductions:
            if reduction_unsupported_reason(r, ctx.target) is not None or group_key[r] != reduction_info(r).key:
                continue  # (a column sum the row group will take computes its chain there)
            info = reduction_info(r)
            chain = _chain(r, info.in_shape, ctx.target)
            inside = set(chain)
            shared = [n for n in chain if any(u not in inside and u is not r for u in n.users)]
            if not shared or len(chain) > MAX_CHAIN or (r.target in SELECTIONS and r.args[0] in shared):
                continue
            numel = 1
            for s in info.in_shape:
                numel *= s
            leaves = {a for n in chain for a in n.all_input_nodes if a not in inside}
            reads = sum(_nbytes(a) for a in leaves if isinstance(a.meta.get("val"), torch.Tensor)
                        and same(math.prod(sizes(a.meta["val"])), numel))
            if reads >= 2 * sum(_nbytes(n) for n in shared):
                continue
            copies: dict[fx.Node, fx.Node] = {}
            with gm.graph.inserting_before(r):
                for n in chain:
                    c = gm.graph.node_copy(n, lambda a: copies.get(a, a))
                    c.meta[RESERVED_FOR] = info.key  # only r's reduction group may take the copy
                    copies[n] = c
            r.replace_input_with(r.args[0], copies[r.args[0]])
            stats["chains_copied"] += 1
            stats["ops_copied"] += len(chain)
        if stats["chains_copied"]:
            gm.graph.eliminate_dead_code()
            gm.recompile()
        return PassResult(gm, stats["chains_copied"] > 0, stats)
