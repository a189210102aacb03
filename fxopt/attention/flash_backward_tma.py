"""Flash-attention backward on Hopper-class GPUs, reading the streamed tiles through TMA descriptors.

The schedule and the mathematics are flash_backward.py's (dK/dV per key block streaming the query
blocks of every query head of its group; dQ per query block streaming key blocks; P recomputed from
the saved log-sum-exp); only the tile copies change, as in flash_forward_tma.py: q, k, v, dO and the
dq, dk, dv stores go through 4-D tensor descriptors (zero fill past the ends, stores past the ends
dropped), so no registers hold pointer tiles. Per-row values (lse, delta) stay pointer loads.

Rows and columns a descriptor zero-fills contribute nothing: a zero dO row gives dP = 0 and, with
delta = 0 there, dS = 0; a zero q row gives dK += dS^T 0. The causal diagonal and ragged ends are
still masked to -inf exactly as in the pointer kernels, so P is 0 wherever eager's softmax is.
An additive mask is read through pointers as in the TMA forward (mask_tiles.py: one row per key block
for a key padding mask), with the pointer kernels' fill-mask rule for rows masked entirely.

On by default for 16-bit inputs with head dims up to 128 on sm90+ (flash_common.backward_config): on
an H200 it runs causal hd128 B8 H16 T2048 in 0.958 ms against 1.237 ms through pointers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..codegen.jit_keys import settle as settle_cache_keys
from ..codegen.wrapper_runtime import cdiv
from .flash_common import LOG2E, add_key_slope, head_slope, key_ranges, launcher, load_rows, query_ranges, visible
from .flash_forward_tma import descriptor, query_block_program
from .mask_blocks import range_arguments, visits_unwalked, walked_keys, walked_queries
from .mask_tiles import (
    FILL_MASK, add_mask, causal_keys_end, fold_causal, folded_keys_end, future_queries_end, lacks_real_score,
    load_mask_block, mask_arguments, mask_kind, reads_mask_row,
)

__all__ = ["flash_backward_tma"]


def flash_backward_tma(dout, q, k, v, lse, delta, *, scale: float, causal: bool, cfg: dict,
                       key_slopes: Tensor | None = None, mask: Tensor | None = None,
                       zero_empty_rows: bool = False, fold: int = 0, causal_fill: float = 0.0,
                       ranges: tuple = (None, None)) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) for inputs the TMA path accepts (the caller checked tma_applies and dout); `delta`
    already computed; cfg resolved (DKDV_/DQ_ blocks, num_warps, num_stages); key_slopes, mask (expanded to
    [B, H, Tq, Tk]), zero_empty_rows and causal_fill as flash_backward's; fold: the kernels' FOLD; ranges: the
    mask's visible ranges (mask_blocks.mask_ranges) for the dK/dV and the dQ kernel, or None."""
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    shared = dict(HEAD_DIM=head_dim, CAUSAL=causal, HAS_SLOPES=key_slopes is not None,
                  HAS_MASK=mask_kind(mask, zero_empty_rows), MASK_ROW=reads_mask_row(mask), FOLD=fold,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    slopes = lse if key_slopes is None else key_slopes  # (unread without slopes)
    mask_args = mask_arguments(mask, q)

    block_m, block_n = cfg["DKDV_BLOCK_M"], cfg["DKDV_BLOCK_N"]
    launcher(_dkdv_tma_kernel, (cdiv(seq_k, block_n), batch * kv_heads), q.device)(
        descriptor(q, block_m), descriptor(k, block_n), descriptor(v, block_n), descriptor(dout, block_m),
        descriptor(dk, block_n), descriptor(dv, block_n), lse, delta, slopes, *mask_args,
        *range_arguments(ranges[0], q), kv_heads, heads // kv_heads, seq_q, seq_k, scale, scale * LOG2E.value,
        causal_fill, BLOCK_M=block_m, BLOCK_N=block_n, EVEN_M=seq_q % block_m == 0, EVEN_N=seq_k % block_n == 0,
        RANGES=ranges[0] is not None, **shared)

    block_m, block_n = cfg["DQ_BLOCK_M"], cfg["DQ_BLOCK_N"]
    launcher(_dq_tma_kernel, (cdiv(seq_q, block_m), batch * heads), q.device)(
        descriptor(q, block_m), descriptor(k, block_n), descriptor(v, block_n), descriptor(dout, block_m),
        descriptor(dq, block_m), lse, delta, slopes, *mask_args, *range_arguments(ranges[1], q),
        heads, heads // kv_heads, seq_q, seq_k, scale, scale * LOG2E.value, causal_fill,
        BLOCK_M=block_m, BLOCK_N=block_n, EVEN_M=seq_q % block_m == 0, EVEN_N=seq_k % block_n == 0,
        RANGES=ranges[1] is not None, **shared)
    return dq, dk, dv


@triton.jit
def _dkdv_tma_kernel(
        q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, Slopes, Mask, stride_mb, stride_mh,
        stride_mm, stride_mn, Ranges, stride_rb, stride_rh, stride_rk, num_kv_heads, group_size, seq_q, seq_k,
        sm_scale, qk_scale, causal_fill,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
        HAS_SLOPES: tl.constexpr, HAS_MASK: tl.constexpr, MASK_ROW: tl.constexpr, EVEN_M: tl.constexpr,
        EVEN_N: tl.constexpr, FOLD: tl.constexpr, RANGES: tl.constexpr):
    """dK and dV for BLOCK_N keys of one (batch, kv head), summed over the query heads of its group; FOLD,
    RANGES as flash_backward's kernel."""
    n0 = tl.program_id(0) * BLOCK_N
    bkv = tl.program_id(1)
    batch = bkv // num_kv_heads
    kv_head = bkv % num_kv_heads
    causal_shift = seq_k - seq_q
    k = k_desc.load([batch, kv_head, n0, 0]).reshape(BLOCK_N, HEAD_DIM)
    v = v_desc.load([batch, kv_head, n0, 0]).reshape(BLOCK_N, HEAD_DIM)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    first, mask_free_lo, ragged_lo = query_ranges(n0, seq_q, causal_shift, BLOCK_M, BLOCK_N, CAUSAL)
    if FOLD != 0:  # as flash_backward's kernel
        mask_free_lo = future_queries_end(n0, causal_shift, ragged_lo, BLOCK_M)
    for g in range(group_size):
        head = kv_head * group_size + g
        rows_head = (batch * num_kv_heads * group_size + head).to(tl.int64) * seq_q  # lse, delta: [B, H, Tq]
        slope = head_slope(Slopes, head, HAS_SLOPES)
        mask_head = Mask + batch.to(tl.int64) * stride_mb + head.to(tl.int64) * stride_mh
        query_lo, whole_lo, whole_hi, query_hi = walked_queries(
            Ranges, batch, head, tl.program_id(0), stride_rb, stride_rh, stride_rk, mask_free_lo, ragged_lo, RANGES)
        if FOLD != 0 or RANGES:  # the query blocks outside [query_lo, query_hi) where a row needs them
            for m0 in tl.range(0, ragged_lo, BLOCK_M, num_stages=1):
                if visits_unwalked(m0, query_lo, query_hi, tl.load(Lse + rows_head + m0 + tl.arange(0, BLOCK_M))):
                    dk, dv = _accumulate_dkdv_tma(
                        dk, dv, k, v, q_desc, do_desc, Lse + rows_head, Delta + rows_head, mask_head, stride_mm,
                        stride_mn, batch, head, n0, m0, m0 + BLOCK_M, seq_q, seq_k, causal_shift, qk_scale, slope,
                        causal_fill, HEAD_DIM, BLOCK_M, BLOCK_N, False, False, HAS_SLOPES, HAS_MASK, MASK_ROW, EVEN_N,
                        FOLD)
        if CAUSAL:
            dk, dv = _accumulate_dkdv_tma(dk, dv, k, v, q_desc, do_desc, Lse + rows_head, Delta + rows_head,
                                          mask_head, stride_mm, stride_mn, batch, head, n0, first, mask_free_lo, seq_q,
                                          seq_k, causal_shift, qk_scale, slope, causal_fill, HEAD_DIM, BLOCK_M, BLOCK_N,
                                          True, True, HAS_SLOPES, HAS_MASK, MASK_ROW, EVEN_N, FOLD)
        if RANGES:  # as flash_backward's kernel
            dk, dv = _accumulate_dkdv_tma(dk, dv, k, v, q_desc, do_desc, Lse + rows_head, Delta + rows_head,
                                          mask_head, stride_mm, stride_mn, batch, head, n0, whole_lo, whole_hi, seq_q,
                                          seq_k, causal_shift, qk_scale, slope, causal_fill, HEAD_DIM, BLOCK_M, BLOCK_N,
                                          False, False, HAS_SLOPES, 0, MASK_ROW, EVEN_N, 0)
            dk, dv = _accumulate_dkdv_tma(dk, dv, k, v, q_desc, do_desc, Lse + rows_head, Delta + rows_head,
                                          mask_head, stride_mm, stride_mn, batch, head, n0, query_lo, whole_lo, seq_q,
                                          seq_k, causal_shift, qk_scale, slope, causal_fill, HEAD_DIM, BLOCK_M, BLOCK_N,
                                          False, False, HAS_SLOPES, HAS_MASK, MASK_ROW, EVEN_N, 0)
        dk, dv = _accumulate_dkdv_tma(dk, dv, k, v, q_desc, do_desc, Lse + rows_head, Delta + rows_head, mask_head,
                                      stride_mm, stride_mn, batch, head, n0, whole_hi, query_hi, seq_q, seq_k,
                                      causal_shift, qk_scale, slope, causal_fill, HEAD_DIM, BLOCK_M, BLOCK_N, False,
                                      False, HAS_SLOPES, HAS_MASK, MASK_ROW, EVEN_N, FOLD)
        if not EVEN_M:
            dk, dv = _accumulate_dkdv_tma(dk, dv, k, v, q_desc, do_desc, Lse + rows_head, Delta + rows_head,
                                          mask_head, stride_mm, stride_mn, batch, head, n0, ragged_lo, seq_q, seq_q,
                                          seq_k, causal_shift, qk_scale, slope, causal_fill, HEAD_DIM, BLOCK_M, BLOCK_N,
                                          True, False, HAS_SLOPES, HAS_MASK, MASK_ROW, EVEN_N, FOLD)
    dk_desc.store([batch, kv_head, n0, 0], (dk * sm_scale).to(dk_desc.dtype).reshape(1, 1, BLOCK_N, HEAD_DIM))
    dv_desc.store([batch, kv_head, n0, 0], dv.to(dv_desc.dtype).reshape(1, 1, BLOCK_N, HEAD_DIM))


@triton.jit
def _accumulate_dkdv_tma(dk, dv, k, v, q_desc, do_desc, lse_head, delta_head, mask_head, stride_mm, stride_mn, batch,
                         head, n0, query_lo, query_hi, seq_q, seq_k, causal_shift, qk_scale, slope, causal_fill,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                         MASK_CAUSAL: tl.constexpr, HAS_SLOPES: tl.constexpr, HAS_MASK: tl.constexpr,
                         MASK_ROW: tl.constexpr, EVEN_N: tl.constexpr, FOLD: tl.constexpr):
    """Over query blocks [query_lo, query_hi) of one query head, in transposed tiles [keys, queries];
    blocks that are not MASKED lie inside the queries."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    for m0 in range(query_lo, query_hi, BLOCK_M):
        m0 = tl.multiple_of(m0, BLOCK_M)
        q = q_desc.load([batch, head, m0, 0]).reshape(BLOCK_M, HEAD_DIM)
        s_t = tl.dot(k, tl.trans(q)) * qk_scale
        if HAS_SLOPES:
            s_t = add_key_slope(s_t, slope, m0 + rows[None, :], n0 + cols[:, None], causal_shift)
        if HAS_MASK:
            bias_t = load_mask_block(mask_head, stride_mm, stride_mn, m0, rows[None, :], n0, cols[:, None], seq_q,
                                     seq_k, not MASKED, EVEN_N, MASK_ROW)
            s_t = add_mask(s_t, fold_causal(bias_t, m0 + rows[None, :], n0 + cols[:, None], causal_shift, causal_fill,
                                            FOLD))
        if MASKED:
            s_t = tl.where(visible(m0 + rows[None, :], n0 + cols[:, None], seq_q, seq_k, causal_shift, MASK_CAUSAL),
                           s_t, float("-inf"))
        lse = load_rows(lse_head + m0 + rows, m0 + rows, seq_q, not MASKED)
        p_t = tl.exp2(s_t - lse[None, :] * LOG2E)
        do = do_desc.load([batch, head, m0, 0]).reshape(BLOCK_M, HEAD_DIM)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        dp_t = tl.dot(v, tl.trans(do))
        delta = load_rows(delta_head + m0 + rows, m0 + rows, seq_q, not MASKED)
        ds_t = p_t * (dp_t - delta[None, :])
        if HAS_MASK == FILL_MASK:  # a query row masked entirely (lse -inf): eager's fill backward gives it 0
            ds_t = tl.where(lse[None, :] == float("-inf"), 0.0, ds_t)
        dk = tl.dot(ds_t.to(q.dtype), q, dk)
    return dk, dv


@triton.jit
def _dq_tma_kernel(
        q_desc, k_desc, v_desc, do_desc, dq_desc, Lse, Delta, Slopes, Mask, stride_mb, stride_mh, stride_mm,
        stride_mn, Ranges, stride_rb, stride_rh, stride_rq, num_heads, group_size, seq_q, seq_k, sm_scale, qk_scale,
        causal_fill,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
        HAS_SLOPES: tl.constexpr, HAS_MASK: tl.constexpr, MASK_ROW: tl.constexpr, EVEN_M: tl.constexpr,
        EVEN_N: tl.constexpr, FOLD: tl.constexpr, RANGES: tl.constexpr):
    """dQ for BLOCK_M query rows of one (batch, head); RANGES as flash_forward's kernel."""
    bh, batch, head, kv_head, m0 = query_block_program(num_heads, group_size, BLOCK_M, CAUSAL or FOLD != 0)
    rows = tl.arange(0, BLOCK_M)
    causal_shift = seq_k - seq_q
    q = q_desc.load([batch, head, m0, 0]).reshape(BLOCK_M, HEAD_DIM)
    do = do_desc.load([batch, head, m0, 0]).reshape(BLOCK_M, HEAD_DIM)
    row_ptrs = bh.to(tl.int64) * seq_q + m0 + rows
    lse = load_rows(Lse + row_ptrs, m0 + rows, seq_q, False) * LOG2E
    delta = load_rows(Delta + row_ptrs, m0 + rows, seq_q, False)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    slope = head_slope(Slopes, head, HAS_SLOPES)
    mask_head = Mask + batch.to(tl.int64) * stride_mb + head.to(tl.int64) * stride_mh
    mask_free_end, end = key_ranges(m0, seq_k, causal_shift, BLOCK_M, BLOCK_N, CAUSAL)
    if FOLD != 0:  # as flash_backward's kernel
        hi, even_end = causal_keys_end(m0, seq_k, causal_shift, BLOCK_M, BLOCK_N)
        end = folded_keys_end(hi, even_end, seq_k, lse)
        mask_free_end = tl.minimum(mask_free_end, end)
    key_lo = 0
    walk_lo = 0
    if RANGES:  # as flash_backward's kernel
        key_lo, whole_lo, walk_lo, end, mask_free_end = walked_keys(
            Ranges, batch, head, m0 // BLOCK_M, stride_rb, stride_rh, stride_rq, mask_free_end)
        dq = _accumulate_dq_tma(dq, q, do, lse, delta, k_desc, v_desc, mask_head, stride_mm, stride_mn, batch,
                                kv_head, m0, whole_lo, walk_lo, seq_q, seq_k, causal_shift, qk_scale, slope,
                                causal_fill, HEAD_DIM, BLOCK_M, BLOCK_N, False, False, HAS_SLOPES, 0, MASK_ROW,
                                EVEN_M, 0)
        dq = _accumulate_dq_tma(dq, q, do, lse, delta, k_desc, v_desc, mask_head, stride_mm, stride_mn, batch,
                                kv_head, m0, key_lo, whole_lo, seq_q, seq_k, causal_shift, qk_scale, slope,
                                causal_fill, HEAD_DIM, BLOCK_M, BLOCK_N, False, False, HAS_SLOPES, HAS_MASK, MASK_ROW,
                                EVEN_M, 0)
    dq = _accumulate_dq_tma(dq, q, do, lse, delta, k_desc, v_desc, mask_head, stride_mm, stride_mn, batch, kv_head, m0,
                            walk_lo, mask_free_end, seq_q, seq_k, causal_shift, qk_scale, slope, causal_fill, HEAD_DIM,
                            BLOCK_M, BLOCK_N, False, False, HAS_SLOPES, HAS_MASK, MASK_ROW, EVEN_M, FOLD)
    if CAUSAL or not EVEN_N:
        dq = _accumulate_dq_tma(dq, q, do, lse, delta, k_desc, v_desc, mask_head, stride_mm, stride_mn, batch,
                                kv_head, m0, mask_free_end, end, seq_q, seq_k, causal_shift, qk_scale, slope,
                                causal_fill, HEAD_DIM, BLOCK_M, BLOCK_N, True, CAUSAL, HAS_SLOPES, HAS_MASK, MASK_ROW,
                                EVEN_M, FOLD)
    if RANGES:  # as flash_backward's kernel
        lacks = lacks_real_score(lse)
        dq = _accumulate_dq_tma(dq, q, do, lse, delta, k_desc, v_desc, mask_head, stride_mm, stride_mn, batch,
                                kv_head, m0, 0, tl.where(lacks, key_lo, 0), seq_q, seq_k, causal_shift, qk_scale,
                                slope, causal_fill, HEAD_DIM, BLOCK_M, BLOCK_N, True, False, HAS_SLOPES, HAS_MASK,
                                MASK_ROW, EVEN_M, FOLD)
        dq = _accumulate_dq_tma(dq, q, do, lse, delta, k_desc, v_desc, mask_head, stride_mm, stride_mn, batch,
                                kv_head, m0, tl.where(lacks, end, seq_k), seq_k, seq_q, seq_k, causal_shift, qk_scale,
                                slope, causal_fill, HEAD_DIM, BLOCK_M, BLOCK_N, True, False, HAS_SLOPES, HAS_MASK,
                                MASK_ROW, EVEN_M, FOLD)
    if HAS_MASK == FILL_MASK:  # (as in _accumulate_dkdv_tma)
        dq = tl.where(lse[:, None] == float("-inf"), 0.0, dq)
    dq_desc.store([batch, head, m0, 0], (dq * sm_scale).to(dq_desc.dtype).reshape(1, 1, BLOCK_M, HEAD_DIM))


@triton.jit
def _accumulate_dq_tma(dq, q, do, lse, delta, k_desc, v_desc, mask_head, stride_mm, stride_mn, batch, kv_head, m0,
                       key_lo, key_hi, seq_q, seq_k, causal_shift, qk_scale, slope, causal_fill, HEAD_DIM: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, MASK_CAUSAL: tl.constexpr,
                       HAS_SLOPES: tl.constexpr, HAS_MASK: tl.constexpr, MASK_ROW: tl.constexpr,
                       EVEN_M: tl.constexpr, FOLD: tl.constexpr):
    """dQ over key blocks [key_lo, key_hi) (inside the keys unless MASKED); lse is in base 2 here."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    for n0 in range(key_lo, key_hi, BLOCK_N):
        n0 = tl.multiple_of(n0, BLOCK_N)
        k = k_desc.load([batch, kv_head, n0, 0]).reshape(BLOCK_N, HEAD_DIM)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if HAS_SLOPES:
            s = add_key_slope(s, slope, m0 + rows[:, None], n0 + cols[None, :], causal_shift)
        if HAS_MASK:
            bias = load_mask_block(mask_head, stride_mm, stride_mn, m0, rows[:, None], n0, cols[None, :], seq_q, seq_k,
                                   EVEN_M, not MASKED, MASK_ROW)
            s = add_mask(s, fold_causal(bias, m0 + rows[:, None], n0 + cols[None, :], causal_shift, causal_fill, FOLD))
        if MASKED:
            s = tl.where(visible(m0 + rows[:, None], n0 + cols[None, :], seq_q, seq_k, causal_shift, MASK_CAUSAL),
                         s, float("-inf"))
        p = tl.exp2(s - lse[:, None])
        v = v_desc.load([batch, kv_head, n0, 0]).reshape(BLOCK_N, HEAD_DIM)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


settle_cache_keys(globals())  # each kernel's Triton key the same in every process (codegen/jit_keys.py)
