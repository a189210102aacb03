"""Online softmax for looped reduction kernels: max and sum(exp(x - max)) in one pass over the row.

Two passes would read the row twice before the output pass; keeping, per lane, a running max m and a
running sum s rescaled whenever the max grows (s <- s * exp(m_old - m_new) + exp(x - m_new)) gives
both in one pass, as flash attention does. -inf entries (masks) stay exact: a lane that has seen only
-inf keeps a sum that the final combine multiplies by exp(-inf - max) = 0.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..analysis.reductions import reduction_info
from .dtypes import TL_DTYPE, compute_dtype

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


def online_update(s: fx.Node, m: fx.Node, u_expr: str, exp) -> list[str]:
    """Per-lane update with the block u_expr; `exp(x)` spells the exp the graph's exp node uses.
    A lane that has seen only -inf adds 0 (exp(-inf - -inf) would be NaN and poison the lane for a row with
    finite values elsewhere); a +inf value gives exp(inf - inf) = NaN, the whole row NaN as in eager."""
    v, mn = f"v_{m.name}", f"m_{m.name}"
    return [f'{v} = tl.where(xmask & rmask, tl.broadcast_to({u_expr}, [XBLOCK, RBLOCK]), float("-inf"))',
            f"{mn} = tl.maximum(acc_{m.name}, {v}, propagate_nan=tl.PropagateNan.ALL)",
            f"acc_{s.name} = acc_{s.name} * tl.where(acc_{m.name} == {mn}, 1.0, {exp(f'acc_{m.name} - {mn}')}) + "
            f"tl.where(xmask & rmask, tl.where({mn} == float(\"-inf\"), 0.0, {exp(f'{v} - {mn}')}), 0.0)",
            f"acc_{m.name} = {mn}"]


def online_finish(s: fx.Node, m: fx.Node, exp, mx: str) -> tuple[str, str]:
    """(max expression, sum expression) over the lanes, each [XBLOCK, 1]; `mx` reduces acc_max."""
    total = (f"tl.sum(tl.where(acc_{m.name} == {m.name}, acc_{s.name}, "
             f"acc_{s.name} * {exp(f'acc_{m.name} - {m.name}')}), 1)[:, None]")
    return mx, total
