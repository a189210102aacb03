"""Which key blocks a runtime mask leaves visible: the range each query block's key loop must walk.

A mask tensor read by the kernels (HF Llama's 4-D causal + padding mask built from `attention_mask`,
a sliding window, SDPA's bool attn_mask, right-padded keys) often hides whole tiles: every key above
the diagonal, every padded key. The kernels cannot know that from the graph, so before the forward
launches, `key_block_ranges` reads the mask once (one small Triton kernel, one program per query block
of each (batch, mask head)) and records, per query block, the first and the last key block holding a
key the mask does not drop. The forward's key loop walks only [lo, hi) of them and visits the blocks
outside only for a query block with a row that saw no real score there (mask_tiles.lacks_real_score):
such a row is eager's average over keys at the fill, and needs them all. Blocks between lo and hi are
walked whether or not the mask drops them (a range, not a block list: no branch in the hot loop).

A dropped key: False in a bool mask (-inf), or a value at or below `drop_threshold` (-inf, finfo.min, -1e9;
-65504 for fp16 inputs). Such a key weighs exactly 0 in fp32 beside a real score (>= REAL_SCORE_FROM, base 2)
unless its own scaled score exceeds 1e9 (65000 beside fp16's -65504, where eager's fp16 scores overflow): the
skip changes nothing else. NaN is not dropped.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..codegen.jit_keys import settle as settle_cache_keys
from ..codegen.wrapper_runtime import cdiv
from .flash_common import launcher

__all__ = ["drop_threshold", "key_block_ranges", "mask_ranges", "range_arguments", "visible_key_range",
           "MIN_KEY_BLOCKS"]

# Below this many key blocks a query block has little to skip and the extra launch is not worth it
MIN_KEY_BLOCKS = 4


def mask_ranges(mask: Tensor | None, causal: bool, cfg: dict, q: Tensor) -> tuple | None:
    """key_block_ranges for the forward's blocks, or None where the kernels walk every key: no mask, a causal
    or folded causal site (its own block skipping), or fewer than MIN_KEY_BLOCKS key blocks."""
    if mask is None or causal or cdiv(mask.shape[3], cfg["BLOCK_N"]) < MIN_KEY_BLOCKS:
        return None
    return key_block_ranges(mask, cfg["BLOCK_M"], cfg["BLOCK_N"], q.dtype)


def range_arguments(ranges: tuple | None, placeholder: Tensor) -> tuple:
    """(pointer, 3 strides) for the kernels' Ranges argument; without ranges, an unread placeholder."""
    return (placeholder, 0, 0, 0) if ranges is None else (ranges[0], *ranges[1])


def drop_threshold(dtype: torch.dtype) -> float:
    """Mask values at or below this drop their key (see the module docstring)."""
    return -65504.0 if dtype == torch.float16 else -1e9


def key_block_ranges(mask: Tensor, block_m: int, block_n: int, dtype: torch.dtype) -> tuple[Tensor, tuple]:
    """(ranges, (stride_b, stride_h, stride_q)) for `mask` expanded to [B, H, Tq, Tk]: ranges is int32
    [B, Hm, Qm, 2], (lo, hi) in key blocks of block_n, per query block of block_m, for the mask's own heads
    Hm and query blocks Qm (1 where the mask broadcasts over them: strides 0); (0, 0) for a block whose keys
    are all dropped. `dtype`: the attention inputs' (drop_threshold)."""
    batch, heads, seq_q, seq_k = mask.shape
    mask_heads = 1 if mask.stride(1) == 0 else heads
    query_blocks = 1 if mask.stride(2) == 0 else cdiv(seq_q, block_m)
    ranges = torch.empty(batch, mask_heads, query_blocks, 2, device=mask.device, dtype=torch.int32)
    launcher(_key_range_kernel, (query_blocks, batch * mask_heads), mask.device)(
        mask, *mask.stride(), ranges, mask_heads, seq_q, seq_k, drop_threshold(dtype),
        BLOCK_M=block_m if query_blocks > 1 else 1, BLOCK_N=block_n, IS_BOOL=mask.dtype == torch.bool)
    strides = tuple(0 if size == 1 else stride for size, stride in zip(ranges.shape[:3], ranges.stride()[:3]))
    return ranges, strides


@triton.jit
def _key_range_kernel(Mask, stride_mb, stride_mh, stride_mm, stride_mn, Ranges, mask_heads, seq_q, seq_k, threshold,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_BOOL: tl.constexpr):
    """(lo, hi) of one query block of one (batch, mask head): the key blocks from the first to the last
    holding a key the mask keeps; (0, 0) when it keeps none. Rows and keys past the ends count as dropped."""
    block = tl.program_id(0)
    bh = tl.program_id(1)
    batch = (bh // mask_heads).to(tl.int64)
    head = (bh % mask_heads).to(tl.int64)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    base = Mask + batch * stride_mb + head * stride_mh + rows[:, None].to(tl.int64) * stride_mm
    key_blocks = tl.cdiv(seq_k, BLOCK_N)
    lo = key_blocks
    hi = 0
    for j in range(0, key_blocks):
        keys = j * BLOCK_N + cols
        inside = (rows[:, None] < seq_q) & (keys[None, :] < seq_k)
        if IS_BOOL:
            keep = tl.load(base + keys[None, :] * stride_mn, mask=inside, other=0) != 0
        else:
            values = tl.load(base + keys[None, :] * stride_mn, mask=inside, other=float("-inf")).to(tl.float32)
            keep = ~(values <= threshold) & inside  # (NaN is kept)
        seen = tl.max(keep.to(tl.int32)) > 0
        lo = tl.where(seen, tl.minimum(lo, j), lo)
        hi = tl.where(seen, j + 1, hi)
    lo = tl.where(hi == 0, 0, lo)
    out = Ranges + (bh * tl.num_programs(0) + block).to(tl.int64) * 2
    tl.store(out, lo)
    tl.store(out + 1, hi)


@triton.jit
def visible_key_range(Ranges, batch, head, block, stride_rb, stride_rh, stride_rq, seq_k, BLOCK_N: tl.constexpr):
    """(first key, end key) of the range key_block_ranges recorded for this query block."""
    at = Ranges + batch.to(tl.int64) * stride_rb + head.to(tl.int64) * stride_rh + block.to(tl.int64) * stride_rq
    return tl.load(at) * BLOCK_N, tl.minimum(tl.load(at + 1) * BLOCK_N, seq_k)


settle_cache_keys(globals())  # each kernel's Triton key the same in every process (codegen/jit_keys.py)
