"""Which key blocks a runtime mask leaves visible: the range each query block's key loop must walk.

A mask tensor read by the kernels (HF Llama's 4-D causal + padding mask built from `attention_mask`,
a sliding window, SDPA's bool attn_mask, right-padded keys) often hides whole tiles: every key above
the diagonal, every padded key. The kernels cannot know that from the graph, so before the forward
launches, `key_block_ranges` reads the mask once (one small Triton kernel, one program per query block
of each (batch, mask head)) and records, per query block, the keys from the first to the last key block
holding a key the mask does not drop. The forward's key loop walks only that range and visits the blocks
outside only for a query block with a row that saw no real score there (mask_tiles.lacks_real_score):
such a row is eager's average over keys at the fill, and needs them all. Blocks inside the range are
walked whether or not the mask drops them (a range, not a block list: no branch in the hot loop).
Most of a causal + padding mask's range is tiles it keeps whole (every value 0, or True): the longest
run of them is recorded too and walked as an unmasked kernel would, without loading the mask (a tile's
load and add is most of a masked loop's extra cost), the rest of the range with it.
The backward does the same: its dQ kernel walks the key range of its query blocks, its dK/dV kernel the
query range of its key blocks (`by_keys`), visiting a query block outside it only if one of its rows
has no real score (its log-sum-exp, which is at least its max, below REAL_SCORE_FROM).

A dropped key: False in a bool mask (-inf), or a value at or below `drop_threshold` (-inf, finfo.min, -1e9;
-65504 for fp16 inputs). Such a key weighs exactly 0 in fp32 beside a real score (>= REAL_SCORE_FROM, base 2)
unless its own scaled score exceeds 1e9 (65000 beside fp16's -65504, where eager's fp16 scores overflow): the
skip changes nothing else. NaN is not dropped.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..codegen.jit_keys import settle as settle_cache_keys
from ..codegen.wrapper_runtime import cdiv
from .flash_common import LOG2E, launcher
from .mask_tiles import MASK_DROPS_AT, lacks_real_score

__all__ = ["drop_threshold", "visible_ranges", "mask_ranges", "range_arguments", "load_ranges", "walked_keys",
           "walked_queries", "visits_unwalked", "MIN_KEY_BLOCKS"]

# Below this many key blocks a query block has little to skip and the extra launch is not worth it
MIN_KEY_BLOCKS = 4


def mask_ranges(mask: Tensor | None, causal: bool, block_m: int, block_n: int, q: Tensor,
                by_keys: bool = False) -> tuple | None:
    """visible_ranges for a kernel's blocks, or None where the kernels walk every key: no mask, a causal
    or folded causal site (its own block skipping), fewer than MIN_KEY_BLOCKS key blocks, or the
    environment's FXOPT_MASK_RANGES=0 (an escape hatch while the ranges are new). FXOPT_MASK_RANGES=all
    takes them at any length (how the fuzzer's short sequences reach them)."""
    setting = os.environ.get("FXOPT_MASK_RANGES", "1")
    if mask is None or causal or setting == "0":
        return None
    if setting != "all" and cdiv(mask.shape[3], block_n) < MIN_KEY_BLOCKS:
        return None
    return visible_ranges(mask, block_m, block_n, q.dtype, by_keys)


def range_arguments(ranges: tuple | None, placeholder: Tensor) -> tuple:
    """(pointer, 3 strides) for the kernels' Ranges argument; without ranges, an unread placeholder."""
    return (placeholder, 0, 0, 0) if ranges is None else (ranges[0], *ranges[1])


def drop_threshold(dtype: torch.dtype) -> float:
    """Mask values at or below this drop their key (see the module docstring)."""
    return -65504.0 if dtype == torch.float16 else MASK_DROPS_AT.value


def visible_ranges(mask: Tensor, block_m: int, block_n: int, dtype: torch.dtype,
                   by_keys: bool = False) -> tuple[Tensor, tuple]:
    """(ranges, (stride_b, stride_h, stride_block)) for `mask` expanded to [B, H, Tq, Tk]. Without by_keys:
    int32 [B, Hm, Qm, 4], per query block of block_m the keys [lo, hi) from the first to the last key block
    of block_n holding a key the mask keeps, for the mask's own heads Hm and query blocks Qm (1 where it
    broadcasts over them: strides 0), as (lo, whole_lo, whole_hi, hi): [whole_lo, whole_hi) the longest
    run of key blocks (the first, among equals) whose tiles the mask keeps whole, every value 0 (True),
    inside the keys ((lo, lo) where none is). by_keys: [B, Hm, Kb, 4], the same per key block over rows
    in query blocks. (0, 0, 0, 0) where nothing is kept. `dtype`: the attention inputs' (drop_threshold)."""
    batch, heads, seq_q, seq_k = mask.shape
    mask_heads = 1 if mask.stride(1) == 0 else heads
    query_rows = 1 if mask.stride(2) == 0 else seq_q  # (one row serves every query)
    row_block = block_m if query_rows > 1 else 1
    blocks = cdiv(seq_k, block_n) if by_keys else cdiv(query_rows, row_block)
    ranges = torch.empty(batch, mask_heads, blocks, 4, device=mask.device, dtype=torch.int32)
    launcher(_visible_range_kernel, (blocks, batch * mask_heads), mask.device)(
        mask, *mask.stride(), ranges, mask_heads, query_rows, seq_k, seq_q if by_keys else seq_k,
        drop_threshold(dtype), BLOCK_M=row_block, BLOCK_N=block_n, IS_BOOL=mask.dtype == torch.bool, BY_KEYS=by_keys)
    strides = tuple(0 if size == 1 else stride for size, stride in zip(ranges.shape[:3], ranges.stride()[:3]))
    return ranges, strides


@triton.jit
def _visible_range_kernel(Mask, stride_mb, stride_mh, stride_mm, stride_mn, Ranges, mask_heads, seq_q, seq_k, span,
                          threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_BOOL: tl.constexpr,
                          BY_KEYS: tl.constexpr):
    """One query block's key range (one key block's query range, BY_KEYS) of one (batch, mask head): from the
    first to the last block across holding a key the mask keeps, in elements, the last one ending at `span`
    (the length across), and the longest run of blocks kept whole inside it; (0, 0, 0, 0) when it keeps none.
    Rows and keys past the ends count as dropped, and a block holding them is never whole."""
    block = tl.program_id(0)
    bh = tl.program_id(1)
    base = Mask + (bh // mask_heads).to(tl.int64) * stride_mb + (bh % mask_heads).to(tl.int64) * stride_mh
    across = tl.cdiv(seq_q, BLOCK_M) if BY_KEYS else tl.cdiv(seq_k, BLOCK_N)
    lo = across
    hi = 0
    run_lo = 0  # where the current run of whole blocks began
    whole_lo = 0
    whole_hi = 0
    for j in range(0, across):
        if BY_KEYS:
            rows = j * BLOCK_M + tl.arange(0, BLOCK_M)
            keys = block * BLOCK_N + tl.arange(0, BLOCK_N)
        else:
            rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
            keys = j * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = (rows[:, None] < seq_q) & (keys[None, :] < seq_k)
        ptrs = base + rows[:, None].to(tl.int64) * stride_mm + keys[None, :] * stride_mn
        if IS_BOOL:
            keep = tl.load(ptrs, mask=inside, other=0) != 0
            whole = keep
        else:
            value = tl.load(ptrs, mask=inside, other=float("-inf")).to(tl.float32)
            keep = ~(value <= threshold)  # NaN kept
            whole = value == 0.0
        seen = tl.max(keep.to(tl.int32)) > 0
        lo = tl.where(seen, tl.minimum(lo, j), lo)
        hi = tl.where(seen, j + 1, hi)
        full = tl.min(whole.to(tl.int32)) > 0
        run_lo = tl.where(full, run_lo, j + 1)
        longer = full & (j + 1 - run_lo > whole_hi - whole_lo)
        whole_lo = tl.where(longer, run_lo, whole_lo)
        whole_hi = tl.where(longer, j + 1, whole_hi)
    unit = BLOCK_M if BY_KEYS else BLOCK_N
    out = Ranges + (bh * tl.num_programs(0) + block).to(tl.int64) * 4
    lo = tl.where(hi == 0, 0, lo * unit)
    tl.store(out, lo)
    tl.store(out + 1, tl.where(whole_hi == 0, lo, whole_lo * unit))
    tl.store(out + 2, tl.where(whole_hi == 0, lo, tl.where(whole_hi == across, span, whole_hi * unit)))
    tl.store(out + 3, tl.where(hi == across, span, hi * unit))


@triton.jit
def load_ranges(Ranges, batch, head, block, stride_rb, stride_rh, stride_rblock):
    """(lo, whole_lo, whole_hi, hi) visible_ranges recorded for this block of this (batch, head): [lo, hi) its
    range, [whole_lo, whole_hi) the longest run of blocks in it whose tiles the mask keeps whole (every value 0,
    or True), walked without reading the mask; (lo, lo) where there is none."""
    at = Ranges + batch.to(tl.int64) * stride_rb + head.to(tl.int64) * stride_rh + block.to(tl.int64) * stride_rblock
    return tl.load(at), tl.load(at + 1), tl.load(at + 2), tl.load(at + 3)


@triton.jit
def walked_keys(Ranges, batch, head, block, stride_rb, stride_rh, stride_rq, mask_free_end):
    """The key blocks (lo, whole_lo, whole_hi, end, mask_free_end) the forward and dQ kernels walk for one
    query block: [lo, end) its visible range, [whole_lo, whole_hi) the run of it the mask keeps whole
    (walked without reading the mask), mask_free_end theirs capped at end."""
    lo, whole_lo, whole_hi, end = load_ranges(Ranges, batch, head, block, stride_rb, stride_rh, stride_rq)
    return lo, whole_lo, whole_hi, end, tl.minimum(mask_free_end, end)


@triton.jit
def walked_queries(Ranges, batch, head, key_block, stride_rb, stride_rh, stride_rk, lo, ragged_lo,
                   RANGES: tl.constexpr):
    """The query blocks (lo, whole_lo, whole_hi, hi) the dK/dV kernels walk for one key block: [lo, hi) the
    mask's visible range (RANGES), else [lo, ragged_lo); [whole_lo, whole_hi) the run of it the mask keeps
    whole (walked without reading the mask; (lo, lo) without RANGES); capped at the ragged last query
    block, which they visit in a loop of its own."""
    hi = ragged_lo
    whole_lo = lo
    whole_hi = lo
    if RANGES:
        lo, whole_lo, whole_hi, hi = load_ranges(Ranges, batch, head, key_block, stride_rb, stride_rh, stride_rk)
        lo, hi = tl.minimum(lo, ragged_lo), tl.minimum(hi, ragged_lo)
        whole_lo, whole_hi = tl.minimum(whole_lo, ragged_lo), tl.minimum(whole_hi, ragged_lo)
    return lo, whole_lo, whole_hi, hi


@triton.jit
def visits_unwalked(m0, query_lo, query_hi, lse_rows):
    """Whether the dK/dV kernels visit the query block at m0 outside their walked range: only where one of
    its rows saw no real score (lse_rows: the rows' natural-log log-sum-exp)."""
    return ((m0 < query_lo) | (m0 >= query_hi)) & lacks_real_score(lse_rows * LOG2E)


settle_cache_keys(globals())  # each kernel's Triton key the same in every process (codegen/jit_keys.py)
