"""Online softmax for looped reduction kernels: max and sum(exp(x - max)) in one pass over the row.

Two passes would read the row twice before the output pass; keeping, per lane, a running max m and a
running sum s rescaled whenever the max grows (s <- s * exp(m_old - m_new) + exp(x - m_new)) gives
both in one pass, as flash attention does; of the two exps one is exp(0), so each element costs one.
-inf entries (masks) stay exact: a lane that has seen only -inf keeps a sum that the final combine
multiplies by exp(-inf - max) = 0.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..analysis.reductions import reduction_info
from .dtypes import TL_DTYPE, compute_dtype
from .pointwise_ops import ptx_unary

aten = torch.ops.aten


def find_online_pairs(reductions: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """{sum node: amax node} for every sum(exp(u - amax(u))) over the same u and dims."""
    pairs = {}
    for r in reductions:
        info = reduction_info(r)
        if info.kind != "sum":
            continue
        e = r.args[0]
        if not (isinstance(e, fx.Node) and e.target is aten.exp.default and len(e.users) >= 1):
            continue
        s = e.args[0]
        if not (isinstance(s, fx.Node) and s.target is aten.sub.Tensor and len(s.args) == 2):
            continue
        u, m = s.args
        if isinstance(m, fx.Node) and m in reductions and reduction_info(m).kind == "amax" and m.args[0] is u \
                and reduction_info(m).dims == info.dims:
            pairs[r] = m
    return pairs


def online_init(s: fx.Node, m: fx.Node) -> list[str]:
    """The running max and sum, in the max's compute dtype: float64 rows keep float64 accumulators (the
    loop's updates are float64, and the GPU compiler refuses a loop variable that changes type)."""
    acc = TL_DTYPE[compute_dtype(m.meta["val"].dtype)]
    return [f'acc_{m.name} = tl.full([XBLOCK, RBLOCK], float("-inf"), {acc})',
            f"acc_{s.name} = tl.zeros([XBLOCK, RBLOCK], {acc})"]


def online_update(s: fx.Node, m: fx.Node, u_expr: str, exp, target: str) -> list[str]:
    """Per-lane update with the block u_expr; `exp(x)` spells the exp the graph's exp node uses. One exp per
    element, not two: of exp(m_old - m_new) and exp(v - m_new) one is exp(0) = 1, the other exp(-|m_old - v|)
    (a long row's online pass is bound partly by the SM's instruction issue, not only by memory). A lane that has
    seen only -inf adds 0: -inf - -inf is NaN, which fmax drops (a NaN in the max itself is carried by
    acc_max); a row whose max is infinite gets eager's NaN sum from online_finish (eager_sum)."""
    v, d, e = f"v_{m.name}", f"d_{m.name}", f"e_{m.name}"
    acc_m, acc_s = f"acc_{m.name}", f"acc_{s.name}"
    factor = rescale_exp(exp, target, compute_dtype(m.meta["val"].dtype))
    return [f'{v} = tl.where(xmask & rmask, tl.broadcast_to({u_expr}, [XBLOCK, RBLOCK]), float("-inf"))',
            f"{d} = {acc_m} - {v}",
            f"{e} = {factor(f'-tl.abs({d})')}",
            f"{acc_s} = tl.where({v} > {acc_m}, tl.fma({acc_s}, {e}, 1.0), tl.maximum({acc_s} + {e}, {acc_s}))",
            f"{acc_m} = tl.maximum({acc_m}, {v}, propagate_nan=tl.PropagateNan.ALL)"]


def rescale_exp(exp, target: str, dtype: torch.dtype):
    """The exp of the online update's factors exp(-|d|) <= 1: where the graph's exp is Triton's approximate
    tl.exp on the GPU (ex2.approx of x * log2 e), the same instruction without its handling of results below
    2^-126 (three SASS instructions per element), which a lane sum of at least 1 cannot hold anyway."""
    if target != "cuda" or dtype != torch.float32 or not exp("x").startswith("tl.exp("):
        return exp
    return lambda x: ptx_unary("ex2.approx.ftz.f32", f"({x}) * 1.4426950408889634")


def online_finish(s: fx.Node, m: fx.Node, exp, mx: str, final: bool = True) -> tuple[str, str]:
    """(max expression, sum expression) over the lanes, each [XBLOCK, 1]; `mx` reduces acc_max. `final`:
    the row's sum (not a split row's chunk partial), as eager_sum says."""
    total = (f"tl.sum(tl.where(acc_{m.name} == {m.name}, acc_{s.name}, "
             f"acc_{s.name} * {exp(f'acc_{m.name} - {m.name}')}), 1)[:, None]")
    return mx, eager_sum(total, m.name) if final else total


def eager_sum(total: str, m: str) -> str:
    """A row's sum(exp(x - max)) as eager has it where the max is infinite: exp(inf - inf) or exp(-inf - -inf)
    is NaN at the max's entries, so the sum is NaN (m - m: 0 for a finite max). Only for a whole row: a
    split row's chunk of -inf keeps its partial 0, which the combine scales by exp(-inf - max) = 0."""
    return f"({total} + ({m} - {m}))"
