"""Flash-attention forward on Hopper-class GPUs, reading q, k and v through TMA tensor descriptors.

The same schedule as flash_forward.py (online softmax in base 2, causal blocks above the diagonal
skipped, a mask-free loop then the diagonal and ragged-end blocks, heaviest query blocks first), with
the tiles moved by the GPU's tensor memory accelerator instead of per-thread pointer loads:
- a tile's copy is one instruction for the whole block, so no registers hold [BLOCK_N, D] pointer
  tensors or bounds masks, and the pipeliner overlaps the copies of the next key blocks with the
  current block's matrix products;
- rows past the end of a sequence come back as zeros and stores past it are dropped by the copy
  engine itself, so ragged lengths need no load or store masks (scores of the zero keys are still
  masked to -inf, as in the pointer kernel);
- the score scale is folded into the exponent's fused multiply-add (exp2(s * c - max)) in the
  mask-free loop instead of scaling the whole tile first (not with a position bias: `key_slopes`,
  flash_common.add_key_slope, adds to the scaled scores);
- an additive mask (a padding mask, SDPA's attn_mask) is not a TMA operand: its tile is read through
  pointers, and a mask broadcast over the queries (stride 0: a key padding mask [B, 1, 1, Tk]) is read as
  one [BLOCK_N] row per key block instead of a [BLOCK_M, BLOCK_N] tile of repeated addresses
  (mask_tiles.py; the TMA backward reads masks the same way).

Descriptors are 4-D ([B, H, T, D] with the tensor's own strides), so the transposed views model code
makes (`x.view(B, T, H, D).transpose(1, 2)`) are read in place. What TMA needs, `tma_applies` checks:
a CUDA device of compute capability 9.0 or newer, 16-bit inputs, a power-of-two head dim, unit stride
on the head dim and 16-byte aligned base pointers and strides; the callers add `tiles_fit` (no tile
longer than its sequence). Everything else takes the pointer kernel, which serves every case.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..codegen.jit_keys import settle as settle_cache_keys
from ..codegen.wrapper_runtime import cdiv
from .flash_common import (
    add_key_slope, head_slope, key_ranges, launcher, log_sum_exp, running_max, softmax_denominator, store_rows,
    visible,
)
from .mask_blocks import range_arguments, walked_keys
from .mask_tiles import (
    add_mask, causal_keys_end, fold_causal, folded_keys_end, lacks_real_score, load_mask_block, mask_arguments,
    reads_mask_row,
)

try:  # triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton
    TensorDescriptor = None

# Stages of the loops that read [BLOCK_M, BLOCK_N] mask tiles. The hd128 config (64 x 64 tiles, 3 stages)
# takes 115,712 bytes of shared memory, two programs per SM; pipelining the mask tiles beside three stages of
# K and V took 131,128 (compiled for sm_90), one program per SM, and HF Llama's masked forward ran 1.6x
# slower than causal for it (benchmarks/results/2026-12-08-h100.md). Two stages fit two programs again.
MASK_TILE_STAGES = tl.constexpr(2)

__all__ = ["tma_applies", "tma_readable", "tiles_fit", "descriptor", "flash_forward_tma", "query_block_program"]


def tma_applies(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the TMA kernels can read these inputs (see the module docstring); False means the
    pointer kernel runs, never an error. (A mask is read through pointers: it needs nothing here.)"""
    if TensorDescriptor is None or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if q.device.type == "cuda" and torch.cuda.get_device_capability(q.device)[0] < 9:
        return False  # (on the CPU the Triton interpreter emulates the descriptors: tests use it)
    head_dim = q.shape[-1]
    if head_dim & (head_dim - 1) or head_dim > 256:
        return False
    return all(tma_readable(t) for t in (q, k, v))


def tiles_fit(q: Tensor, k: Tensor, block_q: int, block_k: int) -> bool:
    """No descriptor tile longer than its sequence: a copy box past the whole tensor is left to the
    pointer kernels (short sequences, where the copy engine buys nothing)."""
    return block_q <= q.shape[2] and block_k <= k.shape[2]


def tma_readable(t: Tensor) -> bool:
    elem = t.element_size()
    return (t.numel() > 0 and t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all((s * elem) % 16 == 0 for s in t.stride()[:-1]))


def descriptor(t: Tensor, rows: int) -> "TensorDescriptor":
    """A 4-D descriptor of `t` with [1, 1, rows, D] tiles. Built without TensorDescriptor's own checks
    (a dozen asserts and a block-shape validation: ~10 us per descriptor, five per attention call on
    the training path): tma_readable and tiles_fit already checked what they check (16-byte aligned
    base and strides, unit last stride, non-empty), and rows and D are powers of two <= 256."""
    d = object.__new__(TensorDescriptor)
    d.__dict__.update(_DESCRIPTOR_DEFAULTS)  # padding="zero", and whatever defaults this triton adds
    d.base, d.shape, d.strides, d.block_shape = t, list(t.shape), list(t.stride()), [1, 1, rows, t.shape[-1]]
    return d


_DESCRIPTOR_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TensorDescriptor)
                        if f.default is not dataclasses.MISSING} if TensorDescriptor is not None else {}


def flash_forward_tma(q: Tensor, k: Tensor, v: Tensor, *, scale: float, causal: bool, cfg: dict,
                      store_lse: bool = True, key_slopes: Tensor | None = None, mask: Tensor | None = None,
                      safe_softmax: bool = False, fold: int = 0, causal_fill: float = 0.0,
                      ranges: tuple | None = None) -> tuple[Tensor, Tensor | None]:
    """flash_forward's (out, lse) for inputs `tma_applies` accepted; cfg: BLOCK_M, BLOCK_N, num_warps,
    num_stages (already resolved); without store_lse, (out, None); key_slopes, mask (expanded to
    [B, H, Tq, Tk]), safe_softmax and causal_fill as flash_forward's; fold: the kernels' FOLD for its causal_fold;
    ranges: mask_blocks.mask_ranges's, or None."""
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    out = torch.empty_like(q)  # q's memory order, as flash_forward promises
    lse = torch.empty(batch, heads, seq_q, device=q.device, dtype=torch.float32) if store_lse else None
    grid = (cdiv(seq_q, block_m), batch * heads)
    launcher(_flash_forward_tma_kernel, grid, q.device)(
        descriptor(q, block_m), descriptor(k, block_n), descriptor(v, block_n), descriptor(out, block_m),
        out if lse is None else lse, out if key_slopes is None else key_slopes, *mask_arguments(mask, q),
        *range_arguments(ranges, q),
        heads, heads // kv_heads, seq_q, seq_k, scale * 1.4426950408889634, causal_fill,
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, HAS_SLOPES=key_slopes is not None,
        HAS_MASK=mask is not None, MASK_ROW=reads_mask_row(mask),
        SAFE=safe_softmax, EVEN_M=seq_q % block_m == 0, EVEN_N=seq_k % block_n == 0,
        STORE_LSE=store_lse, FOLD=fold, RANGES=ranges is not None, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    return out, lse


@triton.jit
def _flash_forward_tma_kernel(
        q_desc, k_desc, v_desc, o_desc, Lse, Slopes, Mask, stride_mb, stride_mh, stride_mm, stride_mn,
        Ranges, stride_rb, stride_rh, stride_rq, num_heads, group_size, seq_q, seq_k, qk_scale, causal_fill,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
        HAS_SLOPES: tl.constexpr, HAS_MASK: tl.constexpr, MASK_ROW: tl.constexpr, SAFE: tl.constexpr,
        EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, STORE_LSE: tl.constexpr, FOLD: tl.constexpr,
        RANGES: tl.constexpr):
    """BLOCK_M query rows of one (batch, head) against every key they may see: out rows and lse; RANGES as
    flash_forward's kernel."""
    bh, batch, head, kv_head, m0 = query_block_program(num_heads, group_size, BLOCK_M, CAUSAL or FOLD != 0)
    causal_shift = seq_k - seq_q
    slope = head_slope(Slopes, head, HAS_SLOPES)
    mask_head = Mask + batch.to(tl.int64) * stride_mb + head.to(tl.int64) * stride_mh

    q = q_desc.load([batch, head, m0, 0]).reshape(BLOCK_M, HEAD_DIM)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    mask_free_end, end = key_ranges(m0, seq_k, causal_shift, BLOCK_M, BLOCK_N, CAUSAL or FOLD != 0)
    key_lo = 0
    walk_lo = 0
    if RANGES:  # as flash_forward's kernel
        key_lo, whole_lo, walk_lo, end, mask_free_end = walked_keys(
            Ranges, batch, head, m0 // BLOCK_M, stride_rb, stride_rh, stride_rq, mask_free_end)
        acc, row_sum, row_max = _tma_key_blocks(
            acc, row_sum, row_max, q, k_desc, v_desc, mask_head, stride_mm, stride_mn, batch, kv_head, m0, whole_lo,
            walk_lo, seq_q, seq_k, causal_shift, qk_scale, slope, causal_fill, HEAD_DIM, BLOCK_M, BLOCK_N, False,
            False, HAS_SLOPES, False, MASK_ROW, EVEN_M, True, 0)
        acc, row_sum, row_max = _tma_key_blocks(
            acc, row_sum, row_max, q, k_desc, v_desc, mask_head, stride_mm, stride_mn, batch, kv_head, m0, key_lo,
            whole_lo, seq_q, seq_k, causal_shift, qk_scale, slope, causal_fill, HEAD_DIM, BLOCK_M, BLOCK_N, False,
            False, HAS_SLOPES, HAS_MASK, MASK_ROW, EVEN_M, True, 0)
    acc, row_sum, row_max = _tma_key_blocks(
        acc, row_sum, row_max, q, k_desc, v_desc, mask_head, stride_mm, stride_mn, batch, kv_head, m0, walk_lo,
        mask_free_end, seq_q, seq_k, causal_shift, qk_scale, slope, causal_fill, HEAD_DIM, BLOCK_M, BLOCK_N, False,
        False, HAS_SLOPES, HAS_MASK, MASK_ROW, EVEN_M, True, 0)
    if FOLD != 0:  # as flash_forward's kernel
        hi, even_end = causal_keys_end(m0, seq_k, causal_shift, BLOCK_M, BLOCK_N)
        acc, row_sum, row_max = _tma_key_blocks(
            acc, row_sum, row_max, q, k_desc, v_desc, mask_head, stride_mm, stride_mn, batch, kv_head, m0,
            mask_free_end, hi, seq_q, seq_k, causal_shift, qk_scale, slope, causal_fill, HEAD_DIM, BLOCK_M, BLOCK_N,
            False, False, HAS_SLOPES, HAS_MASK, MASK_ROW, EVEN_M, True, FOLD)
        end = folded_keys_end(hi, even_end, seq_k, row_max)
        mask_free_end = hi
    if CAUSAL or FOLD != 0 or not EVEN_N:
        acc, row_sum, row_max = _tma_key_blocks(
            acc, row_sum, row_max, q, k_desc, v_desc, mask_head, stride_mm, stride_mn, batch, kv_head, m0,
            mask_free_end, end, seq_q, seq_k, causal_shift, qk_scale, slope, causal_fill, HEAD_DIM, BLOCK_M, BLOCK_N,
            True, CAUSAL, HAS_SLOPES, HAS_MASK, MASK_ROW, EVEN_M, EVEN_N, FOLD)
    if RANGES:  # as flash_forward's kernel
        lacks = lacks_real_score(row_max)
        acc, row_sum, row_max = _tma_key_blocks(
            acc, row_sum, row_max, q, k_desc, v_desc, mask_head, stride_mm, stride_mn, batch, kv_head, m0, 0,
            tl.where(lacks, key_lo, 0), seq_q, seq_k, causal_shift, qk_scale, slope, causal_fill, HEAD_DIM, BLOCK_M,
            BLOCK_N, True, False, HAS_SLOPES, HAS_MASK, MASK_ROW, EVEN_M, True, FOLD)
        acc, row_sum, row_max = _tma_key_blocks(
            acc, row_sum, row_max, q, k_desc, v_desc, mask_head, stride_mm, stride_mn, batch, kv_head, m0,
            tl.where(lacks, end, seq_k), seq_k, seq_q, seq_k, causal_shift, qk_scale, slope, causal_fill, HEAD_DIM,
            BLOCK_M, BLOCK_N, True, False, HAS_SLOPES, HAS_MASK, MASK_ROW, EVEN_M, EVEN_N, FOLD)

    out = (acc / softmax_denominator(row_sum, SAFE)[:, None]).to(o_desc.dtype)
    o_desc.store([batch, head, m0, 0], out.reshape(1, 1, BLOCK_M, HEAD_DIM))
    if STORE_LSE:
        rows = tl.arange(0, BLOCK_M)
        store_rows(Lse + bh.to(tl.int64) * seq_q + m0 + rows, log_sum_exp(row_max, row_sum, SAFE), m0 + rows, seq_q,
                   EVEN_M)


@triton.jit
def query_block_program(num_heads, group_size, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """(bh, batch, head, kv_head, m0) of a program over grid (query blocks, batch * heads); causal
    launches take the heaviest query blocks (the last ones, which see the most keys) first."""
    block_m = tl.program_id(0)
    if CAUSAL:
        block_m = tl.num_programs(0) - 1 - block_m
    bh = tl.program_id(1)
    head = bh % num_heads
    return bh, bh // num_heads, head, head // group_size, block_m * BLOCK_M


@triton.jit
def _tma_key_blocks(
        acc, row_sum, row_max, q, k_desc, v_desc, mask_head, stride_mm, stride_mn, batch, kv_head, m0, key_lo,
        key_hi, seq_q, seq_k, causal_shift, qk_scale, slope, causal_fill, HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, MASK_CAUSAL: tl.constexpr,
        HAS_SLOPES: tl.constexpr, HAS_MASK: tl.constexpr, MASK_ROW: tl.constexpr, EVEN_M: tl.constexpr,
        EVEN_KEYS: tl.constexpr, FOLD: tl.constexpr):
    """The online-softmax update over key blocks [key_lo, key_hi); MASKED blocks get the elementwise
    causal / ragged-end mask, the others none. HAS_MASK: the additive mask is added to the scaled scores
    (MASK_ROW: one row of it serves every query), with the finite causal fill folded in (FOLD). A loop that
    reads mask tiles pipelines MASK_TILE_STAGES of them, K and V too, whatever the kernel's num_stages."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    for n0 in tl.range(key_lo, key_hi, BLOCK_N, num_stages=MASK_TILE_STAGES if HAS_MASK and not MASK_ROW else None):
        n0 = tl.multiple_of(n0, BLOCK_N)
        k = k_desc.load([batch, kv_head, n0, 0]).reshape(BLOCK_N, HEAD_DIM)
        s = tl.dot(q, tl.trans(k))
        if HAS_SLOPES or HAS_MASK or MASKED:
            s = s * qk_scale
            if HAS_SLOPES:
                s = add_key_slope(s, slope, m0 + rows[:, None], n0 + cols[None, :], causal_shift)
            if HAS_MASK:
                bias = load_mask_block(mask_head, stride_mm, stride_mn, m0, rows[:, None], n0, cols[None, :], seq_q,
                                       seq_k, EVEN_M, EVEN_KEYS, MASK_ROW)
                s = add_mask(s, fold_causal(bias, m0 + rows[:, None], n0 + cols[None, :], causal_shift, causal_fill,
                                            FOLD))
            if MASKED:
                s = tl.where(visible(m0 + rows[:, None], n0 + cols[None, :], seq_q, seq_k, causal_shift,
                                     MASK_CAUSAL), s, float("-inf"))
            new_max, shift = running_max(row_max, tl.max(s, 1), HAS_MASK)
            p = tl.exp2(s - shift[:, None])
        else:  # the scale folded into exp2's multiply-add
            new_max, shift = running_max(row_max, tl.max(s, 1) * qk_scale, False)
            p = tl.exp2(s * qk_scale - shift[:, None])
        rescale = tl.exp2(row_max - shift)
        row_sum = row_sum * rescale + tl.sum(p, 1)
        v = v_desc.load([batch, kv_head, n0, 0]).reshape(BLOCK_N, HEAD_DIM)
        acc = tl.dot(p.to(v.dtype), v, acc * rescale[:, None])
        row_max = new_max
    return acc, row_sum, row_max


settle_cache_keys(globals())  # each kernel's Triton key the same in every process (codegen/jit_keys.py)
