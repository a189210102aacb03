"""Attention in plain torch ops: what the fused op computes, for CPU graphs that run without Triton.

Same contract as the Triton kernels: q [B, H, Tq, D], k and v [B, Hkv, Tk, D] (H a multiple of Hkv),
scores and softmax in float32, causal masks aligned bottom-right (query i sees key j <= i + Tk - Tq),
an optional mask broadcastable to [B, H, Tq, Tk], additive (float) or bool (False masks the score: -inf).
Returns (out in q's dtype, lse float32).
`safe`: a row with no visible key gives 0 and lse +inf (SDPA's softmax), not NaN and -inf.
"""
from __future__ import annotations

import torch


def expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, Hkv, T, D] -> [B, H, T, D]: each kv head serves H // Hkv consecutive query heads."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def causal_keep(seq_q: int, seq_k: int, device) -> torch.Tensor:
    """[Tq, Tk] bool, True where query i may see key j (bottom-right aligned)."""
    return torch.ones(seq_q, seq_k, dtype=torch.bool, device=device).tril(seq_k - seq_q)


def key_slope_bias(key_slopes: torch.Tensor, seq_q: int, seq_k: int) -> torch.Tensor:
    """The linear position bias (ALiBi) the kernels compute from per-head slopes, as a [1, H, Tq, Tk]
    float32 additive mask: slopes[h] * (j - i - (Tk - Tq))."""
    rows = torch.arange(seq_q, device=key_slopes.device)[:, None] + (seq_k - seq_q)
    offsets = (torch.arange(seq_k, device=key_slopes.device)[None, :] - rows).float()
    return (key_slopes.float()[:, None, None] * offsets)[None]


def with_key_slopes(mask, key_slopes, seq_q: int, seq_k: int):
    """`mask` with the slopes' bias added (what the kernels that take no slopes read instead)."""
    if key_slopes is None:
        return mask
    bias = key_slope_bias(key_slopes, seq_q, seq_k)
    return bias if mask is None else bias + additive(mask)


def with_causal_fold(mask, causal_fold, causal_fill: float, seq_q: int, seq_k: int):
    """The mask with a finite causal step folded in as the kernels fold it (mask_tiles.fold_causal), float32
    [..., Tq, Tk]: keys above the diagonal get causal_fill ("replaces") or causal_fill plus the mask
    ("adds"); unchanged for None and "in_mask" (the mask holds the step already)."""
    if causal_fold not in ("replaces", "adds"):
        return mask
    m = mask.float()
    future = m + causal_fill if causal_fold == "adds" else torch.full((), causal_fill, device=m.device)
    return torch.where(causal_keep(seq_q, seq_k, m.device), m, future)


def additive(mask: torch.Tensor) -> torch.Tensor:
    """A mask as float32 added to the scores: a bool mask keeps its True scores (0) and drops the rest (-inf)."""
    if mask.dtype == torch.bool:
        return torch.where(mask, 0.0, float("-inf"))
    return mask.float()


def scores(q, k, *, scale, causal, mask) -> torch.Tensor:
    """scale * q k^T (+ mask), float32, with causal positions at -inf."""
    s = torch.matmul(q.float(), expand_kv(k, q.shape[1]).float().transpose(-2, -1)) * scale
    if mask is not None and mask.dtype == torch.bool:
        s = s.masked_fill(~mask, float("-inf"))  # (as a fill: -inf whatever the score, NaN included)
    elif mask is not None:
        s = s + mask.float()
    if causal:
        s = s.masked_fill(~causal_keep(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    return s


def attention(q, k, v, *, scale: float, causal: bool, mask=None,
              safe: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    s = scores(q, k, scale=scale, causal=causal, mask=mask)
    lse = torch.logsumexp(s, dim=-1)
    if safe:  # exp(s - inf) = 0: the row's output is 0 (the kernels' flash_common.log_sum_exp)
        lse = lse.masked_fill(torch.isneginf(lse), float("inf"))
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.matmul(p.to(v.dtype), expand_kv(v, q.shape[1]))
    return out.to(q.dtype), lse


def _sum_groups(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, T, D] -> [B, Hkv, T, D]: a kv head's gradient is the sum over the query heads it served."""
    b, h, t, d = x.shape
    return x.view(b, kv_heads, h // kv_heads, t, d).sum(2)


def attention_backward(dout, q, k, v, *, scale: float, causal: bool, mask=None, safe: bool = False,
                       zero_empty_rows: bool = False):
    """(dq, dk, dv) from the softmax gradient written out (custom ops run below autograd, so no
    autograd here): P recomputed, dS = P * (dP - rowsum(dO * O)), all in float32."""
    s = scores(q, k, scale=scale, causal=causal, mask=mask)
    p = torch.softmax(s, dim=-1)
    if safe:  # rows with no visible key: P = 0, so their gradients are 0
        p = p.masked_fill(torch.isneginf(s.amax(-1, keepdim=True)), 0.0)
    heads, kv_heads = q.shape[1], k.shape[1]
    do, vf = dout.float(), expand_kv(v, heads).float()
    dp = torch.matmul(do, vf.transpose(-2, -1))
    out = torch.matmul(p, vf)
    ds = p * (dp - (do * out).sum(-1, keepdim=True))
    if zero_empty_rows:  # a -inf fill's backward: masked scores get 0, so rows masked entirely add nothing
        ds = ds.masked_fill(torch.isneginf(s.amax(-1, keepdim=True)), 0.0)
    dq = torch.matmul(ds, expand_kv(k, heads).float()) * scale
    dk = torch.matmul(ds.transpose(-2, -1), q.float()) * scale
    dv = torch.matmul(p.transpose(-2, -1), do)
    return dq.to(q.dtype), _sum_groups(dk, kv_heads).to(k.dtype), _sum_groups(dv, kv_heads).to(v.dtype)
