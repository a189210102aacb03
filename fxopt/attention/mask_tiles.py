"""How the attention kernels take a mask: its arguments, its addition to the scores as eager adds it
(`add_mask`), and how the TMA kernels read it (through pointers: a mask is not a TMA operand).

A mask is additive (float: added to the scaled scores) or a bool "keep" mask (False sets the score to
-inf: what a -inf fill, `masked_fill(~keep, -inf)` or SDPA's bool attn_mask, computes). The bool form
costs one select per score where an additive mask costs the rounding-faithful sum of `add_mask` (a
padded SDPA forward, B8 H16 T2048 hd128 bf16 on an H100: 0.79 ms with the fill read as an additive
float mask, 0.60 ms as a bool one, SDPA 0.68), and its tiles are a quarter of an fp32 mask's bytes.

A mask arrives expanded to [B, H, Tq, Tk], usually with stride 0 somewhere: a key padding mask
[B, 1, 1, Tk] broadcasts over heads and queries. Where it broadcasts over the queries (MASK_ROW), one
[BLOCK_N] row per key block is loaded and broadcast in registers instead of a [BLOCK_M, BLOCK_N] tile of
repeated addresses. The same helper serves the forward's score tiles [queries, keys] and the backward's
transposed ones [keys, queries]: the caller passes the query and key indices already shaped for its tile.
"""
from __future__ import annotations

import triton
import triton.language as tl
import torch
from torch import Tensor

from ..codegen.jit_keys import settle as settle_cache_keys
from .flash_common import LN2, LOG2E

__all__ = ["FILL_MASK", "mask_arguments", "mask_kind", "reads_mask_row", "add_mask", "load_mask_block",
           "causal_keys_end", "folded_keys_end", "future_queries_end", "lacks_real_score", "fold_causal", "fold_mode",
           "CAUSAL_FOLDS"]

# A finite mask value at or below this whose sum with the score rounds to the mask value itself (eager's
# fp32 `s + finfo.min` is finfo.min) masks its key: the score becomes MASKED_SCORE (see add_mask). Far below
# fp16's finfo.min: at -65504 a score under 0.004 was lost while its row's other scores were kept, so in a
# row masked everywhere it outweighed them all (found by benchmarks/attention_fuzz.py); at -1e9 only scores
# above 32 survive the fp32 sum
MASK_DROPS_AT: tl.constexpr = tl.constexpr(-1e9)
MASKED_SCORE: tl.constexpr = tl.constexpr(-1024.0)

# A row whose largest score (base 2) is at least this has a real one: the future keys of a mask that holds a
# causal step (values <= -65504, MASKED_SCORE or -inf once added) weigh exp2(<= -1024 - (-512)) = 0 in fp32
REAL_SCORE_FROM: tl.constexpr = tl.constexpr(-512.0)

# The kernels' FOLD: how a finite causal fill beside the mask applies (attention_masks.fold_finite_causal).
# FOLD_REPLACES: a key above the diagonal gets `causal_fill` instead of the mask; FOLD_ADDS: causal_fill plus
# the mask; FOLD_IN_MASK: the mask already holds the causal step (built in the graph)
FOLD_REPLACES: tl.constexpr = tl.constexpr(1)
FOLD_ADDS: tl.constexpr = tl.constexpr(2)
FOLD_IN_MASK: tl.constexpr = tl.constexpr(3)
CAUSAL_FOLDS = {"replaces": FOLD_REPLACES.value, "adds": FOLD_ADDS.value, "in_mask": FOLD_IN_MASK.value}


def fold_mode(causal_fold: str | None, mask: Tensor | None, causal: bool) -> int:
    """The kernels' FOLD for the attention functions' `causal_fold` (None, or a CAUSAL_FOLDS key)."""
    if causal_fold is None:
        return 0
    if causal_fold not in CAUSAL_FOLDS or mask is None or mask.dtype == torch.bool or causal:
        raise ValueError(f"causal_fold={causal_fold!r} needs one of {sorted(CAUSAL_FOLDS)}, an additive float mask "
                         "and causal=False")
    return CAUSAL_FOLDS[causal_fold]

# The kernels' HAS_MASK: 0 no mask, 1 an additive mask, FILL_MASK a mask made from a -inf fill, whose
# backward gives a query row masked entirely 0 in dq and dk (flash_backward's zero_empty_rows)
FILL_MASK: tl.constexpr = tl.constexpr(2)


def mask_arguments(mask: Tensor | None, placeholder: Tensor) -> tuple:
    """(pointer, 4 strides) for the kernels' Mask argument; without a mask, an unread placeholder."""
    return (mask, *mask.stride()) if mask is not None else (placeholder, 0, 0, 0, 0)


def mask_kind(mask: Tensor | None, zero_empty_rows: bool) -> int:
    """The kernels' HAS_MASK for this mask."""
    return 0 if mask is None else FILL_MASK.value if zero_empty_rows else 1


def reads_mask_row(mask: Tensor | None) -> bool:
    """The kernels' MASK_ROW: the mask broadcasts over the queries (stride 0 on Tq)."""
    return mask is not None and mask.stride(2) == 0


@triton.jit
def add_mask(s, bias):
    """A bool `bias` keeps the scores where True (-inf elsewhere). A float one: base-2 scores `s` plus an
    additive mask tile, added as eager adds them: in fp32 and natural-log units (t = s ln 2 + b), then
    back to base 2. Where that sum rounds to the mask value itself, a finite value at or below MASK_DROPS_AT
    (eager's `s + finfo.min` is finfo.min), the score was lost and the key becomes MASKED_SCORE: a row masked
    everywhere that way is the uniform average of its keys, as in eager.
    MASKED_SCORE is near enough to 0 for such a row's stored log-sum-exp to keep log2(keys) (with scores
    near -1e30 it was lost to rounding and the backward's exp2(s - lse) gave 1 instead of 1/keys), and far
    enough below real scores that those keys weigh nothing in any row with a real score above -1000
    (base-2 units). A large mask value that keeps the score (fp16's finfo.min, -65504, in an fp32 sum)
    stays a real score, so a row masked everywhere with it is softmax(s), as in eager (until 2026-12-05
    every value at or below -65504 was dropped: the uniform average; until 2026-12-07 scores under 0.004
    were). -inf stays -inf."""
    if bias.dtype == tl.int1:
        out = tl.where(bias, s, float("-inf"))
    else:
        b = bias.to(tl.float32)
        t = s * LN2 + b
        lost = (t == b) & (b <= MASK_DROPS_AT) & (b != float("-inf"))
        out = tl.where(lost, MASKED_SCORE, t * LOG2E)
    return out


@triton.jit
def load_mask_block(mask_head, stride_mm, stride_mn, m0, q_offs, n0, k_offs, seq_q, seq_k, EVEN_Q: tl.constexpr,
                    EVEN_K: tl.constexpr, MASK_ROW: tl.constexpr):
    """The mask of one (batch, head) at queries m0 + q_offs and keys n0 + k_offs (offsets broadcastable to
    the tile: [M, 1] and [1, N], or [1, M] and [N, 1] for a transposed tile), 0 past either end; EVEN_*
    axes are known to be in bounds. The block's start is taken in 64 bits (big masks), the offsets in 32.
    MASK_ROW: the keys' row only, broadcast by the caller's arithmetic."""
    q_idx = m0 + q_offs
    k_idx = n0 + k_offs
    if MASK_ROW:
        ptrs = mask_head + tl.cast(n0, tl.int64) * stride_mn + k_offs * stride_mn
        if EVEN_K:
            bias = tl.load(ptrs)
        else:
            bias = tl.load(ptrs, mask=k_idx < seq_k, other=0.0)
    else:
        start = mask_head + tl.cast(m0, tl.int64) * stride_mm + tl.cast(n0, tl.int64) * stride_mn
        ptrs = start + q_offs * stride_mm + k_offs * stride_mn
        if EVEN_Q:
            if EVEN_K:
                bias = tl.load(ptrs)
            else:
                bias = tl.load(ptrs, mask=k_idx < seq_k, other=0.0)
        else:
            if EVEN_K:
                bias = tl.load(ptrs, mask=q_idx < seq_q, other=0.0)
            else:
                bias = tl.load(ptrs, mask=(q_idx < seq_q) & (k_idx < seq_k), other=0.0)
    return bias


@triton.jit
def fold_causal(bias, q_idx, k_idx, causal_shift, causal_fill, FOLD: tl.constexpr):
    """The mask tile with the causal step folded in (FOLD_REPLACES, FOLD_ADDS), in fp32 as the graph's
    materialized mask would hold it; q_idx and k_idx broadcast to the score tile."""
    if FOLD == FOLD_ADDS:
        b = bias.to(tl.float32)
        bias = tl.where(k_idx <= q_idx + causal_shift, b, b + causal_fill)
    elif FOLD == FOLD_REPLACES:
        bias = tl.where(k_idx <= q_idx + causal_shift, bias.to(tl.float32), causal_fill)
    return bias


@triton.jit
def causal_keys_end(m0, seq_k, causal_shift, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(hi, even_end) for a finite causal fill beside the mask (FOLD): blocks [0, hi) hold every key a
    row of the query block at m0 sees causally, up to even_end, the end of the whole key blocks (the
    ragged last block, if any, is the caller's); both multiples of BLOCK_N."""
    even_end = seq_k // BLOCK_N * BLOCK_N
    hi = tl.cdiv(tl.maximum(m0 + BLOCK_M + causal_shift, 0), BLOCK_N) * BLOCK_N
    return tl.minimum(hi, even_end), even_end


@triton.jit
def folded_keys_end(hi, even_end, seq_k, row_level):
    """Where a query block's key loop ends after the blocks [0, hi) of causal_keys_end: at hi, unless a row
    of the block saw no real score there (lacks_real_score: such a row averages the keys at the fill, future
    ones included, as eager's softmax does) or the ragged last block may hold visible keys (hi is even_end);
    then at seq_k. Every block past hi that is skipped weighs exactly 0. row_level: the forward's running
    maxima, or the backward's log-sum-exps (base 2), which are at least the maxima."""
    end = seq_k
    if (hi < even_end) & ~lacks_real_score(row_level):
        end = hi
    return end


@triton.jit
def lacks_real_score(row_level):
    """Whether a row of the block has no score at or above REAL_SCORE_FROM (row_level: its running max, or
    its log-sum-exp, base 2). The backward skips a tile of future keys only where every row has one: those
    keys score <= MASKED_SCORE, so exp2(s - lse) <= exp2(-512) is exactly 0 in fp32, as in the forward."""
    return tl.min(row_level, 0) < REAL_SCORE_FROM


@triton.jit
def future_queries_end(n0, causal_shift, ragged_lo, BLOCK_M: tl.constexpr):
    """The backward's dK/dV side of the fold: query blocks [0, this) hold only rows for which every key of the
    block at n0 lies above the diagonal (row n0 - causal_shift is the first to see key n0); capped at the
    ragged last query block, which the kernels visit in its own loop."""
    return tl.minimum(tl.maximum(n0 - causal_shift, 0) // BLOCK_M * BLOCK_M, ragged_lo)


settle_cache_keys(globals())  # each kernel's Triton key the same in every process (codegen/jit_keys.py)
