"""Flash-attention backward (the FlashAttention-2 schedule) as three Triton kernels.

With P = softmax(S), S = scale * Q K^T + mask, and dO the gradient of out = P V:
    dV = P^T dO,  dP = dO V^T,  dS = P * (dP - delta) with delta = rowsum(dO * out),
    dQ = scale * dS K,  dK = scale * dS^T Q.
P is never stored: every kernel recomputes a tile of it from q, k and the forward's log-sum-exp,
P = exp2(S * log2(e) - lse * log2(e)), one exp2 per score and no running max.

1. `_delta_kernel`: delta = rowsum(dO * out) in float32, one value per query row.
2. `_dkdv_kernel`: one program per key block of one (batch, kv head). Its K and V tiles and the dK,
   dV accumulators stay in registers while it streams the query blocks of every query head that
   reads this kv head (grouped-query attention), so dk and dv [B, Hkv, Tk, D] are written once, with
   no atomics. It works on transposed tiles (S^T = K Q^T) so that dV += P^T dO and dK += dS^T Q
   need no transposes of P.
3. `_dq_kernel`: one program per query block of one (batch, head), streaming key blocks: dQ += dS K.

Splitting dK/dV from dQ lets each accumulate in registers without atomics, at the price of computing
S and dP twice. As in the forward, each loop runs over mask-free blocks and masked blocks (causal
diagonal, ragged ends) separately, skips causal blocks that no row sees, and EVEN_* flags drop the
bounds masks when a length is a multiple of its block.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..codegen.jit_keys import settle as settle_cache_keys
from ..codegen.wrapper_runtime import cdiv, next_power_of_2
from .flash_common import (
    LOG2E, add_key_slope, backward_config, check_attention_inputs, check_key_slopes, check_saved, dot_precision,
    head_slope, key_ranges, launcher, load_rows, load_tile, query_ranges, resolve_config, store_rows, store_tile,
    tile_ptrs, visible,
)
from .flash_backward_tma import flash_backward_tma
from .flash_forward_tma import tiles_fit, tma_applies, tma_readable
from .launch_plans import frozen, planned
from .mask_blocks import mask_ranges, range_arguments, visits_unwalked, walked_keys, walked_queries
from .mask_tiles import (
    FILL_MASK, add_mask, causal_keys_end, fold_causal, fold_mode, folded_keys_end, future_queries_end,
    lacks_real_score, mask_arguments, mask_kind,
)

__all__ = ["flash_backward", "backward_config"]


def flash_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, scale: float,
                   causal: bool, mask: Tensor | None = None, config: dict | None = None,
                   key_slopes: Tensor | None = None, zero_empty_rows: bool = False, causal_fold: str | None = None,
                   causal_fill: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of flash_forward's out, given dout (any strides) and the forward's out
    and lse; shapes, dtypes and memory order of q, k, v (`torch.empty_like`: the model's backward
    reshapes them to [B, T, H * D] without a copy). The mask gets no gradient. `config`:
    overrides of `backward_config`'s DKDV_BLOCK_M, DKDV_BLOCK_N, DQ_BLOCK_M, DQ_BLOCK_N, num_warps,
    num_stages and TMA (dK/dV and dQ through TMA descriptors where the inputs allow it,
    flash_backward_tma.py; on by default for 16-bit inputs on sm90+). `key_slopes`: flash_forward's position
    bias (ALiBi), recomputed here. `zero_empty_rows`: the mask came from a fill (`masked_fill(m, -inf)`,
    `where(keep, s, -inf)`), whose eager backward gives every masked score a gradient of 0: a query row
    masked entirely (NaN output, lse -inf) then adds nothing to dq and dk, where an additive -inf mask's
    NaN reaches both (dv is NaN either way, as in eager). `causal_fold`, `causal_fill`: flash_forward's; as
    there, a tile of keys above the diagonal is skipped unless one of its query rows saw no real score
    (read from lse, mask_tiles.lacks_real_score)."""
    fold = fold_mode(causal_fold, mask, causal)
    use_tma, cfg = _backward_plan((dout, q, k, v, out, lse, mask, key_slopes), scale, causal, frozen(config))
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    block_d = next_power_of_2(head_dim)
    lse = lse.contiguous()
    delta = torch.empty_like(lse)
    shared = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, EVEN_D=head_dim == block_d,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    attention = dict(CAUSAL=causal, HAS_MASK=mask_kind(mask, zero_empty_rows), HAS_SLOPES=key_slopes is not None,
                     DOT_PRECISION=dot_precision(q.dtype), FOLD=fold, **shared)
    mask_args = (*mask_arguments(mask, q), q if key_slopes is None else key_slopes)
    whole = causal or fold != 0  # (their own block skipping); else a mask's visible ranges (mask_blocks.py)
    dkdv_ranges = mask_ranges(mask, whole, cfg["DKDV_BLOCK_M"], cfg["DKDV_BLOCK_N"], q, by_keys=True)
    dq_ranges = mask_ranges(mask, whole, cfg["DQ_BLOCK_M"], cfg["DQ_BLOCK_N"], q)

    block_m = cfg["DQ_BLOCK_M"]
    launcher(_delta_kernel, (cdiv(seq_q, block_m), batch * heads), q.device)(
        out, dout, delta, *out.stride(), *dout.stride(), heads, seq_q,
        BLOCK_M=block_m, EVEN_M=seq_q % block_m == 0, **shared)
    if use_tma:
        return flash_backward_tma(dout, q, k, v, lse, delta, scale=scale, causal=causal, cfg=cfg, key_slopes=key_slopes,
                                  mask=mask, zero_empty_rows=zero_empty_rows, fold=fold, causal_fill=causal_fill,
                                  ranges=(dkdv_ranges, dq_ranges))
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))  # each laid out like its input

    block_m, block_n = cfg["DKDV_BLOCK_M"], cfg["DKDV_BLOCK_N"]
    launcher(_dkdv_kernel, (cdiv(seq_k, block_n), batch * kv_heads), q.device)(
        q, k, v, *mask_args, dout, lse, delta, dk, dv, *range_arguments(dkdv_ranges, q),
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dk.stride(), *dv.stride(),
        kv_heads, heads // kv_heads, seq_q, seq_k, scale, scale * LOG2E.value, causal_fill,
        BLOCK_M=block_m, BLOCK_N=block_n, EVEN_M=seq_q % block_m == 0, EVEN_N=seq_k % block_n == 0,
        RANGES=dkdv_ranges is not None, **attention)

    block_m, block_n = cfg["DQ_BLOCK_M"], cfg["DQ_BLOCK_N"]
    launcher(_dq_kernel, (cdiv(seq_q, block_m), batch * heads), q.device)(
        q, k, v, *mask_args, dout, lse, delta, dq, *range_arguments(dq_ranges, q),
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dq.stride(),
        heads, heads // kv_heads, seq_q, seq_k, scale, scale * LOG2E.value, causal_fill,
        BLOCK_M=block_m, BLOCK_N=block_n, EVEN_M=seq_q % block_m == 0, EVEN_N=seq_k % block_n == 0,
        RANGES=dq_ranges is not None, **attention)
    return dq, dk, dv


@planned
def _backward_plan(tensors: tuple, scale: float, causal: bool, config) -> tuple[bool, dict]:
    """(dK/dV and dQ through TMA descriptors?, the resolved config) for these inputs, after checking
    them; kept per layout (launch_plans.py), so callers must not change the config they get."""
    dout, q, k, v, out, lse, mask, key_slopes = tensors
    check_attention_inputs("flash_backward", q, k, v, mask, causal, scale)
    check_key_slopes("flash_backward", q, key_slopes)
    check_saved(dout, out, lse, q)
    defaults = backward_config(q.shape[-1], causal, q.dtype, q.shape[2], k.shape[2], q.device.type)
    cfg = resolve_config(None if config is None else dict(config), defaults, "flash_backward")
    use_tma = (cfg.pop("TMA") and tma_applies(q, k, v) and tma_readable(dout)
               and tiles_fit(q, k, cfg["DKDV_BLOCK_M"], cfg["DKDV_BLOCK_N"])
               and tiles_fit(q, k, cfg["DQ_BLOCK_M"], cfg["DQ_BLOCK_N"]))
    return use_tma, cfg


@triton.jit
def _delta_kernel(Out, DOut, Delta, stride_ob, stride_oh, stride_om, stride_od,
                  stride_dob, stride_doh, stride_dom, stride_dod, num_heads, seq_q,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                  EVEN_M: tl.constexpr, EVEN_D: tl.constexpr):
    """delta = rowsum(dout * out) in float32 for BLOCK_M query rows of one (batch, head)."""
    m0 = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    batch = (bh // num_heads).to(tl.int64)
    head = (bh % num_heads).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    out = load_tile(tile_ptrs(Out + batch * stride_ob + head * stride_oh, m0, rows, stride_om, 0, dims, stride_od),
                    m0 + rows, seq_q, dims, HEAD_DIM, EVEN_M, EVEN_D)
    dout = load_tile(tile_ptrs(DOut + batch * stride_dob + head * stride_doh, m0, rows, stride_dom, 0, dims,
                               stride_dod), m0 + rows, seq_q, dims, HEAD_DIM, EVEN_M, EVEN_D)
    delta = tl.sum(out.to(tl.float32) * dout.to(tl.float32), 1)
    store_rows(Delta + bh.to(tl.int64) * seq_q + m0 + rows, delta, m0 + rows, seq_q, EVEN_M)


@triton.jit
def _dkdv_kernel(
        Q, K, V, Mask, stride_mb, stride_mh, stride_mm, stride_mn, Slopes, DOut, Lse, Delta, DK, DV,
        Ranges, stride_rb, stride_rh, stride_rk, stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_dob, stride_doh, stride_dom, stride_dod,
        stride_dkb, stride_dkh, stride_dkn, stride_dkd,
        stride_dvb, stride_dvh, stride_dvn, stride_dvd,
        num_kv_heads, group_size, seq_q, seq_k, sm_scale, qk_scale, causal_fill,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SLOPES: tl.constexpr, EVEN_M: tl.constexpr,
        EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, FOLD: tl.constexpr,
        RANGES: tl.constexpr):
    """dK and dV for BLOCK_N keys of one (batch, kv head), summed over the query heads of its group. FOLD,
    RANGES: whole query blocks outside [query_lo, query_hi) only where a row saw no real score."""
    n0 = tl.program_id(0) * BLOCK_N
    bkv = tl.program_id(1)
    batch = (bkv // num_kv_heads).to(tl.int64)
    kv_head = (bkv % num_kv_heads).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    causal_shift = seq_k - seq_q

    k = load_tile(tile_ptrs(K + batch * stride_kb + kv_head * stride_kh, n0, cols, stride_kn, 0, dims, stride_kd),
                  n0 + cols, seq_k, dims, HEAD_DIM, EVEN_N, EVEN_D)
    v = load_tile(tile_ptrs(V + batch * stride_vb + kv_head * stride_vh, n0, cols, stride_vn, 0, dims, stride_vd),
                  n0 + cols, seq_k, dims, HEAD_DIM, EVEN_N, EVEN_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    first, mask_free_lo, ragged_lo = query_ranges(n0, seq_q, causal_shift, BLOCK_M, BLOCK_N, CAUSAL)
    if FOLD != 0:  # query blocks before mask_free_lo see only future keys here: visited where a row needs them
        mask_free_lo = future_queries_end(n0, causal_shift, ragged_lo, BLOCK_M)
    for g in range(group_size):
        head = kv_head * group_size + g
        q_head = Q + batch * stride_qb + head * stride_qh
        do_head = DOut + batch * stride_dob + head * stride_doh
        mask_head = Mask + batch * stride_mb + head * stride_mh
        slope = head_slope(Slopes, head, HAS_SLOPES)
        rows_head = (batch * num_kv_heads * group_size + head) * seq_q  # lse and delta are contiguous [B, H, Tq]
        query_lo, whole_lo, whole_hi, query_hi = walked_queries(
            Ranges, batch, head, tl.program_id(0), stride_rb, stride_rh, stride_rk, mask_free_lo, ragged_lo, RANGES)
        if FOLD != 0 or RANGES:  # the query blocks outside [query_lo, query_hi) where a row needs them
            for m0 in tl.range(0, ragged_lo, BLOCK_M, num_stages=1):
                if visits_unwalked(m0, query_lo, query_hi, tl.load(Lse + rows_head + m0 + tl.arange(0, BLOCK_M))):
                    dk, dv = _accumulate_dkdv(
                        dk, dv, k, v, q_head, do_head, mask_head, Lse + rows_head, Delta + rows_head, n0, m0,
                        m0 + BLOCK_M, seq_q, seq_k, causal_shift, qk_scale, slope, causal_fill, stride_qm, stride_qd,
                        stride_dom, stride_dod, stride_mm, stride_mn, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, HAS_MASK,
                        HAS_SLOPES, False, True, EVEN_N, EVEN_D, DOT_PRECISION, FOLD)
        if CAUSAL:
            dk, dv = _accumulate_dkdv(
                dk, dv, k, v, q_head, do_head, mask_head, Lse + rows_head, Delta + rows_head, n0, first, mask_free_lo,
                seq_q, seq_k, causal_shift, qk_scale, slope, causal_fill, stride_qm, stride_qd, stride_dom, stride_dod,
                stride_mm, stride_mn, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, HAS_MASK, HAS_SLOPES,
                True, EVEN_M, EVEN_N, EVEN_D, DOT_PRECISION, FOLD)
        if RANGES:  # the run of query blocks the mask keeps whole, without reading it; then those before it
            dk, dv = _accumulate_dkdv(
                dk, dv, k, v, q_head, do_head, mask_head, Lse + rows_head, Delta + rows_head, n0, whole_lo, whole_hi,
                seq_q, seq_k, causal_shift, qk_scale, slope, causal_fill, stride_qm, stride_qd, stride_dom, stride_dod,
                stride_mm, stride_mn, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, 0, HAS_SLOPES, False, True, EVEN_N, EVEN_D,
                DOT_PRECISION, 0)
            dk, dv = _accumulate_dkdv(
                dk, dv, k, v, q_head, do_head, mask_head, Lse + rows_head, Delta + rows_head, n0, query_lo, whole_lo,
                seq_q, seq_k, causal_shift, qk_scale, slope, causal_fill, stride_qm, stride_qd, stride_dom, stride_dod,
                stride_mm, stride_mn, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, HAS_MASK, HAS_SLOPES, False, True, EVEN_N,
                EVEN_D, DOT_PRECISION, 0)
        dk, dv = _accumulate_dkdv(
            dk, dv, k, v, q_head, do_head, mask_head, Lse + rows_head, Delta + rows_head, n0, whole_hi, query_hi,
            seq_q, seq_k, causal_shift, qk_scale, slope, causal_fill, stride_qm, stride_qd, stride_dom, stride_dod,
            stride_mm, stride_mn, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, HAS_MASK, HAS_SLOPES,
            False, True, EVEN_N, EVEN_D, DOT_PRECISION, FOLD)
        if not EVEN_M:
            dk, dv = _accumulate_dkdv(
                dk, dv, k, v, q_head, do_head, mask_head, Lse + rows_head, Delta + rows_head, n0, ragged_lo, seq_q,
                seq_q, seq_k, causal_shift, qk_scale, slope, causal_fill, stride_qm, stride_qd, stride_dom, stride_dod,
                stride_mm, stride_mn, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, HAS_MASK, HAS_SLOPES,
                False, False, EVEN_N, EVEN_D, DOT_PRECISION, FOLD)

    dk_ptrs = tile_ptrs(DK + batch * stride_dkb + kv_head * stride_dkh, n0, cols, stride_dkn, 0, dims, stride_dkd)
    store_tile(dk_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), n0 + cols, seq_k, dims, HEAD_DIM, EVEN_N, EVEN_D)
    dv_ptrs = tile_ptrs(DV + batch * stride_dvb + kv_head * stride_dvh, n0, cols, stride_dvn, 0, dims, stride_dvd)
    store_tile(dv_ptrs, dv.to(DV.dtype.element_ty), n0 + cols, seq_k, dims, HEAD_DIM, EVEN_N, EVEN_D)


@triton.jit
def _accumulate_dkdv(
        dk, dv, k, v, q_head, do_head, mask_head, lse_head, delta_head, n0, query_lo, query_hi,
        seq_q, seq_k, causal_shift, qk_scale, slope, causal_fill, stride_qm, stride_qd, stride_dom, stride_dod,
        stride_mm, stride_mn, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SLOPES: tl.constexpr,
        MASK_CAUSAL: tl.constexpr, EVEN_QUERIES: tl.constexpr, EVEN_N: tl.constexpr,
        EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, FOLD: tl.constexpr):
    """dK^T-side accumulation over query blocks [query_lo, query_hi) of one query head, in transposed
    tiles [keys, queries]. EVEN_QUERIES: every block lies inside the queries. Rows past the keys
    (a ragged key block) produce garbage that is never stored and never summed into valid rows."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    for m0 in range(query_lo, query_hi, BLOCK_M):
        m0 = tl.multiple_of(m0, BLOCK_M)
        q = load_tile(tile_ptrs(q_head, m0, rows, stride_qm, 0, dims, stride_qd), m0 + rows, seq_q, dims, HEAD_DIM,
                      EVEN_QUERIES, EVEN_D)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale
        if HAS_SLOPES:
            s_t = add_key_slope(s_t, slope, m0 + rows[None, :], n0 + cols[:, None], causal_shift)
        if HAS_MASK:
            bias_t = load_tile(tile_ptrs(mask_head, n0, cols, stride_mn, m0, rows, stride_mm), n0 + cols, seq_k,
                               m0 + rows, seq_q, EVEN_N, EVEN_QUERIES)
            s_t = add_mask(s_t, fold_causal(bias_t, m0 + rows[None, :], n0 + cols[:, None], causal_shift, causal_fill,
                                            FOLD))
        if MASK_CAUSAL or not EVEN_QUERIES:
            s_t = tl.where(visible(m0 + rows[None, :], n0 + cols[:, None], seq_q, seq_k, causal_shift, MASK_CAUSAL),
                           s_t, float("-inf"))
        lse = load_rows(lse_head + m0 + rows, m0 + rows, seq_q, EVEN_QUERIES)
        p_t = tl.exp2(s_t - lse[None, :] * LOG2E)
        do = load_tile(tile_ptrs(do_head, m0, rows, stride_dom, 0, dims, stride_dod), m0 + rows, seq_q, dims,
                       HEAD_DIM, EVEN_QUERIES, EVEN_D)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        delta = load_rows(delta_head + m0 + rows, m0 + rows, seq_q, EVEN_QUERIES)
        ds_t = p_t * (dp_t - delta[None, :])
        if HAS_MASK == FILL_MASK:  # a query row masked entirely (lse -inf): eager's fill backward gives it 0
            ds_t = tl.where(lse[None, :] == float("-inf"), 0.0, ds_t)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _dq_kernel(
        Q, K, V, Mask, stride_mb, stride_mh, stride_mm, stride_mn, Slopes, DOut, Lse, Delta, DQ,
        Ranges, stride_rb, stride_rh, stride_rq, stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_dob, stride_doh, stride_dom, stride_dod,
        stride_dqb, stride_dqh, stride_dqm, stride_dqd,
        num_heads, group_size, seq_q, seq_k, sm_scale, qk_scale, causal_fill,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SLOPES: tl.constexpr, EVEN_M: tl.constexpr,
        EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, FOLD: tl.constexpr,
        RANGES: tl.constexpr):
    """dQ for BLOCK_M query rows of one (batch, head); RANGES as flash_forward's kernel."""
    block_m = tl.program_id(0)
    if CAUSAL or FOLD != 0:  # heaviest query blocks first
        block_m = tl.num_programs(0) - 1 - block_m
    bh = tl.program_id(1)
    batch = (bh // num_heads).to(tl.int64)
    head = bh % num_heads
    kv_head = (head // group_size).to(tl.int64)
    head = head.to(tl.int64)
    m0 = block_m * BLOCK_M
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    causal_shift = seq_k - seq_q

    q = load_tile(tile_ptrs(Q + batch * stride_qb + head * stride_qh, m0, rows, stride_qm, 0, dims, stride_qd),
                  m0 + rows, seq_q, dims, HEAD_DIM, EVEN_M, EVEN_D)
    do = load_tile(tile_ptrs(DOut + batch * stride_dob + head * stride_doh, m0, rows, stride_dom, 0, dims, stride_dod),
                   m0 + rows, seq_q, dims, HEAD_DIM, EVEN_M, EVEN_D)
    lse = load_rows(Lse + bh.to(tl.int64) * seq_q + m0 + rows, m0 + rows, seq_q, EVEN_M) * LOG2E
    delta = load_rows(Delta + bh.to(tl.int64) * seq_q + m0 + rows, m0 + rows, seq_q, EVEN_M)
    k_head = K + batch * stride_kb + kv_head * stride_kh
    v_head = V + batch * stride_vb + kv_head * stride_vh
    mask_head = Mask + batch * stride_mb + head * stride_mh
    slope = head_slope(Slopes, head, HAS_SLOPES)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    mask_free_end, end = key_ranges(m0, seq_k, causal_shift, BLOCK_M, BLOCK_N, CAUSAL)
    if FOLD != 0:  # as the forward: the blocks above the diagonal only if a row saw no real score
        hi, even_end = causal_keys_end(m0, seq_k, causal_shift, BLOCK_M, BLOCK_N)
        end = folded_keys_end(hi, even_end, seq_k, lse)
        mask_free_end = tl.minimum(mask_free_end, end)
    key_lo = 0
    walk_lo = 0
    if RANGES:  # as flash_forward's kernel: the run of blocks kept whole without reading the mask
        key_lo, whole_lo, walk_lo, end, mask_free_end = walked_keys(
            Ranges, batch, head, block_m, stride_rb, stride_rh, stride_rq, mask_free_end)
        dq = _accumulate_dq(
            dq, q, do, lse, delta, k_head, v_head, mask_head, m0, whole_lo, walk_lo, seq_q, seq_k, causal_shift,
            qk_scale, slope, causal_fill, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
            HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, 0, HAS_SLOPES, False, EVEN_M, True, EVEN_D, DOT_PRECISION, 0)
        dq = _accumulate_dq(
            dq, q, do, lse, delta, k_head, v_head, mask_head, m0, key_lo, whole_lo, seq_q, seq_k, causal_shift,
            qk_scale, slope, causal_fill, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
            HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, HAS_MASK, HAS_SLOPES, False, EVEN_M, True, EVEN_D, DOT_PRECISION, 0)
    dq = _accumulate_dq(
        dq, q, do, lse, delta, k_head, v_head, mask_head, m0, walk_lo, mask_free_end, seq_q, seq_k, causal_shift,
        qk_scale, slope, causal_fill, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
        HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, HAS_MASK, HAS_SLOPES, False, EVEN_M, True, EVEN_D, DOT_PRECISION, FOLD)
    if CAUSAL or not EVEN_N:
        dq = _accumulate_dq(
            dq, q, do, lse, delta, k_head, v_head, mask_head, m0, mask_free_end, end, seq_q, seq_k, causal_shift,
            qk_scale, slope, causal_fill, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
            HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, HAS_MASK, HAS_SLOPES, CAUSAL, EVEN_M, EVEN_N, EVEN_D, DOT_PRECISION,
            FOLD)
    if RANGES:  # the keys outside the range, only for a query block with a row that saw no real score
        lacks = lacks_real_score(lse)
        dq = _accumulate_dq(
            dq, q, do, lse, delta, k_head, v_head, mask_head, m0, 0, tl.where(lacks, key_lo, 0), seq_q, seq_k,
            causal_shift, qk_scale, slope, causal_fill, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm,
            stride_mn, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, HAS_MASK, HAS_SLOPES, False, EVEN_M, True, EVEN_D,
            DOT_PRECISION, FOLD)
        dq = _accumulate_dq(
            dq, q, do, lse, delta, k_head, v_head, mask_head, m0, tl.where(lacks, end, seq_k), seq_k, seq_q, seq_k,
            causal_shift, qk_scale, slope, causal_fill, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm,
            stride_mn, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, HAS_MASK, HAS_SLOPES, False, EVEN_M, EVEN_N, EVEN_D,
            DOT_PRECISION, FOLD)

    if HAS_MASK == FILL_MASK:  # (as in _accumulate_dkdv)
        dq = tl.where(lse[:, None] == float("-inf"), 0.0, dq)
    dq_ptrs = tile_ptrs(DQ + batch * stride_dqb + head * stride_dqh, m0, rows, stride_dqm, 0, dims, stride_dqd)
    store_tile(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), m0 + rows, seq_q, dims, HEAD_DIM, EVEN_M, EVEN_D)


@triton.jit
def _accumulate_dq(
        dq, q, do, lse, delta, k_head, v_head, mask_head, m0, key_lo, key_hi, seq_q, seq_k, causal_shift, qk_scale,
        slope, causal_fill, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_MASK: tl.constexpr, HAS_SLOPES: tl.constexpr, MASK_CAUSAL: tl.constexpr, EVEN_M: tl.constexpr,
        EVEN_KEYS: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, FOLD: tl.constexpr):
    """dQ accumulation over key blocks [key_lo, key_hi); lse is in base 2 here."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    for n0 in range(key_lo, key_hi, BLOCK_N):
        n0 = tl.multiple_of(n0, BLOCK_N)
        k = load_tile(tile_ptrs(k_head, n0, cols, stride_kn, 0, dims, stride_kd), n0 + cols, seq_k, dims, HEAD_DIM,
                      EVEN_KEYS, EVEN_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if HAS_SLOPES:
            s = add_key_slope(s, slope, m0 + rows[:, None], n0 + cols[None, :], causal_shift)
        if HAS_MASK:
            bias = load_tile(tile_ptrs(mask_head, m0, rows, stride_mm, n0, cols, stride_mn), m0 + rows, seq_q,
                             n0 + cols, seq_k, EVEN_M, EVEN_KEYS)
            s = add_mask(s, fold_causal(bias, m0 + rows[:, None], n0 + cols[None, :], causal_shift, causal_fill, FOLD))
        if MASK_CAUSAL or not EVEN_KEYS:
            s = tl.where(visible(m0 + rows[:, None], n0 + cols[None, :], seq_q, seq_k, causal_shift, MASK_CAUSAL),
                         s, float("-inf"))
        p = tl.exp2(s - lse[:, None])
        v = load_tile(tile_ptrs(v_head, n0, cols, stride_vn, 0, dims, stride_vd), n0 + cols, seq_k, dims, HEAD_DIM,
                      EVEN_KEYS, EVEN_D)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


settle_cache_keys(globals())  # each kernel's Triton key the same in every process (codegen/jit_keys.py)
