"""Flash-attention forward (the FlashAttention-2 schedule) as a Triton kernel.

One program owns BLOCK_M query rows of one (batch, head) and streams the keys and values of that
head's kv head past them, BLOCK_N keys at a time, never writing the [Tq, Tk] scores to memory. Per
row it keeps the running max m of the scores, the running sum l of exp(score - m) and the
unnormalised output acc, all in float32; when a key block raises the max, l and acc are rescaled by
exp(m_old - m_new) (the online softmax). At the end out = acc / l, and lse = m + log(l) is stored so
that the backward can recompute the probabilities instead of saving them.

Why it is shaped this way:
- Scores are kept in base 2: scale * log2(e) is one multiplier, so every probability is one exp2;
  lse is converted back to a natural log when stored.
- The q tile is loaded once and stays in registers for the whole key loop.
- The key loop runs in two parts (`key_ranges`): blocks every row sees whole, with no elementwise
  mask (the hot loop), then the blocks on the causal diagonal or at the ragged end of the keys.
  Causal programs never visit blocks above the diagonal.
- Causal programs take the query blocks in reverse: the last blocks see the most keys, and starting
  them first leaves short programs for the end of the launch.
- EVEN_M / EVEN_N / EVEN_D say at compile time that a length is a multiple of its block, so loads
  and stores there need no bounds masks. Head dims that are not powers of two are padded to one
  (BLOCK_D) with masked loads.
- An additive mask is loaded per tile through its strides (0 where it broadcasts). A row whose keys
  so far are all -inf is shifted by 0 instead of its max, so exp2 gives 0 rather than NaN; a row
  masked everywhere with -inf ends with NaN output and lse = -inf, as softmax does in eager PyTorch,
  and one masked everywhere with a finite fill (HF's finfo.min) is the uniform average (add_mask).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..codegen.jit_keys import settle as settle_cache_keys
from ..codegen.wrapper_runtime import cdiv, next_power_of_2
from .flash_common import (
    LOG2E, add_key_slope, check_attention_inputs, check_key_slopes, dot_precision, forward_config, head_slope,
    key_ranges, launcher, load_tile, log_sum_exp, resolve_config, running_max, softmax_denominator, store_rows,
    store_tile, tile_ptrs, visible,
)
from .mask_blocks import mask_ranges, range_arguments, walked_keys
from .mask_tiles import (
    add_mask, causal_keys_end, fold_causal, fold_mode, folded_keys_end, lacks_real_score, mask_arguments,
)
from .flash_forward_tma import flash_forward_tma, tiles_fit, tma_applies
from .launch_plans import frozen, planned

__all__ = ["flash_forward", "forward_config"]


def flash_forward(q: Tensor, k: Tensor, v: Tensor, *, scale: float, causal: bool, mask: Tensor | None = None,
                  config: dict | None = None, lse: bool = True,
                  key_slopes: Tensor | None = None, safe_softmax: bool = False,
                  causal_fold: str | None = None, causal_fill: float = 0.0) -> tuple[Tensor, Tensor | None]:
    """Attention forward; returns (out, lse), or (out, None) with lse=False (inference: nothing reads
    the statistics, so they are neither allocated nor stored).

    q [B, H, Tq, D]; k, v [B, Hkv, Tk, D] with H a multiple of Hkv (query head h reads kv head
    h // (H // Hkv)); any strides; float16, bfloat16 or float32. `mask`: None, an additive float tensor or
    a bool one (True keeps the score; mask_tiles.add_mask) expanded to [B, H, Tq, Tk] (any strides, 0 where
    it broadcasts). `causal`: query i sees key j iff j <= i + Tk - Tq. `config`: overrides of
    `forward_config`'s BLOCK_M, BLOCK_N, num_warps, num_stages and TMA (read q, k, v through TMA descriptors
    where flash_forward_tma.tma_applies; the default on CUDA devices for 16-bit inputs; a mask is read through
    pointers there).

    out: [B, H, Tq, D] in q's dtype, laid out like q (`torch.empty_like(q)`: for
    q = x.view(B, T, H, D).transpose(1, 2) its memory is [B, T, H, D], so the model's
    `out.transpose(1, 2).reshape(B, T, H * D)` needs no copy); lse: float32 [B, H, Tq], contiguous, the
    natural-log log-sum-exp of each row's scaled, masked scores. `key_slopes`: None or float32 [H], a
    linear position bias (ALiBi) computed in the kernel: head h's scores get
    key_slopes[h] * (j - i - (Tk - Tq)) added before the mask (flash_common.add_key_slope).
    `safe_softmax`: a row that sees no key (masked everywhere with -inf) gives 0 and lse +inf, as SDPA's
    softmax does, instead of NaN and -inf.
    `causal_fold` (with causal=False and a mask): a causal step with a finite fill (attention_masks.
    fold_finite_causal): keys above the diagonal (bottom-right) get `causal_fill` instead of the mask
    ("replaces"), or causal_fill plus the mask ("adds"), or what the mask holds ("in_mask": the fill is
    in it already); a query block visits the key blocks above its diagonal only when one of its rows saw
    no real score below it (mask_tiles.folded_keys_end): everywhere else they weigh exactly 0.
    """
    fold = fold_mode(causal_fold, mask, causal)
    use_tma, cfg = _forward_plan((q, k, v, mask, key_slopes), scale, causal, frozen(config))
    safe = safe_softmax and mask is not None  # without a mask every row sees a key (causal needs Tq <= Tk)
    ranges = mask_ranges(mask, causal or fold != 0, cfg["BLOCK_M"], cfg["BLOCK_N"], q)
    if use_tma:
        return flash_forward_tma(q, k, v, scale=scale, causal=causal, cfg=cfg, store_lse=lse, key_slopes=key_slopes,
                                 mask=mask, safe_softmax=safe, fold=fold, causal_fill=causal_fill, ranges=ranges)
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    block_d = next_power_of_2(head_dim)

    out = torch.empty_like(q)  # q's memory order: [B, T, H, D] for model code's transposed views
    stats = torch.empty(batch, heads, seq_q, device=q.device, dtype=torch.float32) if lse else None
    grid = (cdiv(seq_q, block_m), batch * heads)
    launcher(_flash_forward_kernel, grid, q.device)(
        q, k, v, *mask_arguments(mask, q), q if key_slopes is None else key_slopes, out,
        out if stats is None else stats, *range_arguments(ranges, q),
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        heads, heads // kv_heads, seq_q, seq_k, scale * LOG2E.value, causal_fill,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=causal, HAS_MASK=mask is not None, HAS_SLOPES=key_slopes is not None, EVEN_M=seq_q % block_m == 0,
        EVEN_N=seq_k % block_n == 0, EVEN_D=head_dim == block_d, DOT_PRECISION=dot_precision(q.dtype), STORE_LSE=lse,
        SAFE=safe, FOLD=fold, RANGES=ranges is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out, stats


@planned
def _forward_plan(tensors: tuple, scale: float, causal: bool, config) -> tuple[bool, dict]:
    """(through TMA descriptors?, the resolved config) for these inputs, after checking them; kept per
    layout (launch_plans.py), so callers must not change the config they get."""
    q, k, v, mask, key_slopes = tensors
    check_attention_inputs("flash_forward", q, k, v, mask, causal, scale)
    check_key_slopes("flash_forward", q, key_slopes)
    defaults = forward_config(q.shape[-1], causal, q.dtype, q.shape[2], k.shape[2], q.device.type,
                              has_mask=mask is not None)
    cfg = resolve_config(None if config is None else dict(config), defaults, "flash_forward")
    use_tma = (cfg.pop("TMA") and scale > 0 and tma_applies(q, k, v)
               and tiles_fit(q, k, cfg["BLOCK_M"], cfg["BLOCK_N"]))
    return use_tma, cfg


@triton.jit
def _flash_forward_kernel(
        Q, K, V, Mask, stride_mb, stride_mh, stride_mm, stride_mn, Slopes, Out, Lse,
        Ranges, stride_rb, stride_rh, stride_rq,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_ob, stride_oh, stride_om, stride_od,
        num_heads, group_size, seq_q, seq_k, qk_scale, causal_fill,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SLOPES: tl.constexpr, EVEN_M: tl.constexpr,
        EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, STORE_LSE: tl.constexpr,
        SAFE: tl.constexpr, FOLD: tl.constexpr, RANGES: tl.constexpr):
    """BLOCK_M query rows of one (batch, head) against every key they may see: out rows and lse.
    RANGES: a mask's visible key range per query block (mask_blocks.py; never with CAUSAL or FOLD)."""
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
    k_head = K + batch * stride_kb + kv_head * stride_kh
    v_head = V + batch * stride_vb + kv_head * stride_vh
    mask_head = Mask + batch * stride_mb + head * stride_mh
    slope = head_slope(Slopes, head, HAS_SLOPES)

    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    mask_free_end, end = key_ranges(m0, seq_k, causal_shift, BLOCK_M, BLOCK_N, CAUSAL or FOLD != 0)
    key_lo = 0
    walk_lo = 0
    if RANGES:  # the mask's visible range only: its run of blocks kept whole without reading the mask, the
        # blocks before that run, then [walk_lo, mask_free_end) and a ragged end
        key_lo, whole_lo, walk_lo, end, mask_free_end = walked_keys(
            Ranges, batch, head, block_m, stride_rb, stride_rh, stride_rq, mask_free_end)
        acc, row_sum, row_max = _attend_key_blocks(
            acc, row_sum, row_max, q, k_head, v_head, mask_head, m0, whole_lo, walk_lo, seq_q, seq_k, causal_shift,
            qk_scale, slope, causal_fill, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
            HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, False, HAS_SLOPES, False, EVEN_M, True, EVEN_D, DOT_PRECISION, 0)
        acc, row_sum, row_max = _attend_key_blocks(
            acc, row_sum, row_max, q, k_head, v_head, mask_head, m0, key_lo, whole_lo, seq_q, seq_k, causal_shift,
            qk_scale, slope, causal_fill, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
            HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, HAS_MASK, HAS_SLOPES, False, EVEN_M, True, EVEN_D, DOT_PRECISION, 0)
    acc, row_sum, row_max = _attend_key_blocks(
        acc, row_sum, row_max, q, k_head, v_head, mask_head, m0, walk_lo, mask_free_end, seq_q, seq_k, causal_shift,
        qk_scale, slope, causal_fill, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
        HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, HAS_MASK, HAS_SLOPES, False, EVEN_M, True, EVEN_D, DOT_PRECISION, 0)
    if FOLD != 0:  # a finite causal fill: the diagonal's blocks, then those above it only if a row needs them
        hi, even_end = causal_keys_end(m0, seq_k, causal_shift, BLOCK_M, BLOCK_N)
        acc, row_sum, row_max = _attend_key_blocks(
            acc, row_sum, row_max, q, k_head, v_head, mask_head, m0, mask_free_end, hi, seq_q, seq_k, causal_shift,
            qk_scale, slope, causal_fill, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
            HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, HAS_MASK, HAS_SLOPES, False, EVEN_M, True, EVEN_D, DOT_PRECISION,
            FOLD)
        end = folded_keys_end(hi, even_end, seq_k, row_max)
        mask_free_end = hi
    if CAUSAL or FOLD != 0 or not EVEN_N:
        acc, row_sum, row_max = _attend_key_blocks(
            acc, row_sum, row_max, q, k_head, v_head, mask_head, m0, mask_free_end, end, seq_q, seq_k, causal_shift,
            qk_scale, slope, causal_fill, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
            HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, HAS_MASK, HAS_SLOPES, CAUSAL, EVEN_M, EVEN_N, EVEN_D, DOT_PRECISION,
            FOLD)
    if RANGES:  # the blocks outside the range, only for a query block with a row that saw no real score
        lacks = lacks_real_score(row_max)
        acc, row_sum, row_max = _attend_key_blocks(
            acc, row_sum, row_max, q, k_head, v_head, mask_head, m0, 0, tl.where(lacks, key_lo, 0), seq_q, seq_k,
            causal_shift, qk_scale, slope, causal_fill, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm,
            stride_mn, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, HAS_MASK, HAS_SLOPES, False, EVEN_M, True, EVEN_D,
            DOT_PRECISION, FOLD)
        acc, row_sum, row_max = _attend_key_blocks(
            acc, row_sum, row_max, q, k_head, v_head, mask_head, m0, tl.where(lacks, end, seq_k), seq_k, seq_q, seq_k,
            causal_shift, qk_scale, slope, causal_fill, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm,
            stride_mn, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, HAS_MASK, HAS_SLOPES, False, EVEN_M, EVEN_N, EVEN_D,
            DOT_PRECISION, FOLD)

    out = acc / softmax_denominator(row_sum, SAFE)[:, None]
    out_ptrs = tile_ptrs(Out + batch * stride_ob + head * stride_oh, m0, rows, stride_om, 0, dims, stride_od)
    store_tile(out_ptrs, out.to(Out.dtype.element_ty), m0 + rows, seq_q, dims, HEAD_DIM, EVEN_M, EVEN_D)
    if STORE_LSE:
        lse_ptrs = Lse + bh.to(tl.int64) * seq_q + m0 + rows
        store_rows(lse_ptrs, log_sum_exp(row_max, row_sum, SAFE), m0 + rows, seq_q, EVEN_M)


@triton.jit
def _attend_key_blocks(
        acc, row_sum, row_max, q, k_head, v_head, mask_head, m0, key_lo, key_hi, seq_q, seq_k, causal_shift,
        qk_scale, slope, causal_fill, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_MASK: tl.constexpr, HAS_SLOPES: tl.constexpr, MASK_CAUSAL: tl.constexpr, EVEN_M: tl.constexpr,
        EVEN_KEYS: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, FOLD: tl.constexpr):
    """The online-softmax update over key blocks [key_lo, key_hi). EVEN_KEYS: every block lies
    inside the keys; with it and MASK_CAUSAL off the scores get no elementwise mask at all. FOLD: the
    mask tiles get the finite causal fill (mask_tiles.fold_causal)."""
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
        new_max, shift = running_max(row_max, tl.max(s, 1), HAS_MASK)
        p = tl.exp2(s - shift[:, None])
        rescale = tl.exp2(row_max - shift)
        row_sum = row_sum * rescale + tl.sum(p, 1)
        v = load_tile(tile_ptrs(v_head, n0, cols, stride_vn, 0, dims, stride_vd), n0 + cols, seq_k, dims, HEAD_DIM,
                      EVEN_KEYS, EVEN_D)
        acc = tl.dot(p.to(v.dtype), v, acc * rescale[:, None], input_precision=DOT_PRECISION)
        row_max = new_max
    return acc, row_sum, row_max


settle_cache_keys(globals())  # each kernel's Triton key the same in every process (codegen/jit_keys.py)
