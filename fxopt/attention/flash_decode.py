"""Split-KV ("flash-decoding") attention forward for short queries over long key sequences.

With a handful of query rows, one program per (batch, head) leaves most of the GPU idle while it walks
thousands of keys. Decode splits the key sequence instead:

  stage 1 (`_split_partials_kernel`, grid (splits, B * Hkv, row blocks)): each program reads one
    contiguous chunk of K and V once and serves every query row of its KV group: the H // Hkv query
    heads sharing the kv head times the Tq queries are packed into the M dimension of one tile, so
    grouped-query attention reads K/V from memory once per group, not once per query head. It keeps
    an online softmax in float32 and writes its unnormalised partial output, running max and running
    sum to float32 workspaces.
  stage 2 (`_combine_splits_kernel`, one program per (batch, head, query)): merges the splits by
    log-sum-exp rescaling, out = sum_s 2^(m_s - m) acc_s / sum_s 2^(m_s - m) l_s, and writes out and lse.

Scores live in the log2 domain (scale * log2(e) folded into one multiplier, exp2 in the loop); lse
is converted back to natural log at the end. A split whose keys are all masked for a row (empty
splits, causal) keeps max = -inf; every exp2 subtracts a max that is replaced by 0 when it is -inf,
so such splits weigh 0 instead of producing NaN. A row masked everywhere gives NaN output and
lse = -inf, as softmax in eager PyTorch does.

Scores use tl.dot with M padded to 16 rather than a broadcast multiply + sum: decode moves
2 * Tk * D elements of K/V for about 4 * rows * Tk * D flops, far below what the tensor cores do even
with 16x padding, so the dot costs nothing next to the loads, while the broadcast product would run
on the CUDA cores and grow with every packed GQA row. Bandwidth then hinges on the loads, vectorised
along D (Triton specialises a unit stride), a block of BLOCK_N keys per iteration, pipelined
num_stages deep.

CUDA tensors run compiled kernels, CPU tensors the same kernels in the Triton interpreter. Which of
the two a process can run is fixed when triton is imported (TRITON_INTERPRET=1: the interpreter).
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..codegen.jit_keys import settle as settle_cache_keys
from ..codegen.wrapper_runtime import cdiv, next_power_of_2
from .flash_common import (
    check_attention_inputs, dot_precision, is_power_of_two, launcher, log_sum_exp, running_max,
    softmax_denominator,
)
from .mask_tiles import add_mask, mask_arguments

MAX_QUERY_ROWS = 16  # decode packs queries into a tile's rows; longer queries go to the main forward kernel
MIN_DECODE_KEYS = 256  # below this one program per head has little to walk: splitting buys nothing
MIN_KEYS_PER_SPLIT = 256  # a split must stream enough keys to amortise its partials and the combine
PROGRAMS_PER_SM = 1.5  # measured best on an H200 (see default_num_splits)
DEFAULT_SM_COUNT = 132  # H200, for the interpreter (CPU tensors have no SM count)
CONFIG_KEYS = ("BLOCK_N", "BLOCK_M", "num_warps", "num_stages")


def decode_applies(seq_q: int, seq_k: int) -> bool:
    """True when split-KV decode is the better kernel: few query rows over many keys."""
    return seq_q <= MAX_QUERY_ROWS and seq_k >= MIN_DECODE_KEYS


def flash_decode(q: Tensor, k: Tensor, v: Tensor, *, scale: float, causal: bool, mask: Tensor | None = None,
                 num_splits: int | None = None, config: dict | None = None,
                 lse: bool = True, safe_softmax: bool = False) -> tuple[Tensor, Tensor | None]:
    """Attention forward for q [B, H, Tq<=16, D] over k, v [B, Hkv, Tk, D]; returns (out, lse), or
    (out, None) with lse=False.

    out [B, H, Tq, D] contiguous in q's dtype; lse [B, H, Tq] float32, the natural-log log-sum-exp of
    the scaled, masked scores. `mask`: None, an additive float or a bool (True keeps) [B, H, Tq, Tk] (any strides).
    `num_splits`: how many chunks the keys are cut into (default: `default_num_splits`).
    `config`: overrides of BLOCK_N, BLOCK_M (most packed rows per tile), num_warps, num_stages.
    `safe_softmax`: a row that sees no key gives 0 and lse +inf (SDPA's softmax), not NaN and -inf.
    """
    check_attention_inputs("flash_decode", q, k, v, mask, causal, scale)
    if q.shape[2] > MAX_QUERY_ROWS:
        raise ValueError(f"flash_decode: needs Tq <= {MAX_QUERY_ROWS} (decode packs queries into a tile's rows), "
                         f"got Tq={q.shape[2]}")
    cfg = _launch_config(q, config)
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    group = heads // kv_heads
    block_m = _block_rows(group * seq_q, cfg["BLOCK_M"])
    row_blocks = cdiv(group * seq_q, block_m)
    splits = _resolve_splits(num_splits, batch * kv_heads * row_blocks, seq_k, cfg["BLOCK_N"], q.device)
    keys_per_split = _keys_per_split(seq_k, splits, cfg["BLOCK_N"])

    out = torch.empty(batch, heads, seq_q, head_dim, device=q.device, dtype=q.dtype)
    stats = torch.empty(batch, heads, seq_q, device=q.device, dtype=torch.float32) if lse else None
    direct = splits == 1  # one chunk: its state is final, stored as out and lse (no workspace, no combine)
    if direct:
        part_acc = part_max = part_sum = out  # unread placeholders
    else:
        part_acc = torch.empty(batch, heads, seq_q, splits, head_dim, device=q.device, dtype=torch.float32)
        part_max = torch.empty(batch, heads, seq_q, splits, device=q.device, dtype=torch.float32)
        part_sum = torch.empty_like(part_max)

    block_d = next_power_of_2(head_dim)
    mask_arg, *mask_strides = mask_arguments(mask, q)
    launcher(_split_partials_kernel, (splits, batch * kv_heads, row_blocks), q.device)(
        q, k, v, mask_arg, part_acc, part_max, part_sum, out, out if stats is None else stats,
        *q.stride(), *k.stride(), *v.stride(), *mask_strides,
        heads, kv_heads, seq_q, seq_k, keys_per_split, splits, scale * math.log2(math.e),
        HAS_MASK=mask is not None, CAUSAL=causal, DOT_PRECISION=dot_precision(q.dtype),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], DIRECT=direct,
        STORE_LSE=lse, SAFE=safe_softmax, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if direct:
        return out, stats
    launcher(_combine_splits_kernel, (batch * heads * seq_q,), q.device)(
        part_acc, part_max, part_sum, out, out if stats is None else stats, splits,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=min(next_power_of_2(splits), 16), STORE_LSE=lse,
        SAFE=safe_softmax, num_warps=4)
    return out, stats


def default_num_splits(programs_per_split: int, seq_k: int, sm_count: int = DEFAULT_SM_COUNT) -> int:
    """Fewest splits that give at least PROGRAMS_PER_SM programs per SM, while every split keeps at least
    MIN_KEYS_PER_SPLIT keys.

    Two programs of the default tile fit on an SM (shared memory), and 1.5 per SM already saturate HBM:
    on an H200 (bf16, D 128) this rule picked the fastest or within 3% of the fastest split count in
    every case tried (B8 H32 MHA over 8192 keys: 1 split, 4.37 TB/s of K/V read; GQA and batch-1
    shapes: 2 to 32 splits). Aiming at 2 to 4 per SM was up to 40% slower: more partials to write and
    combine, and a half-empty last wave (B8 H32 MHA with 2 splits: 11% slower than with 1)."""
    wanted = math.ceil(PROGRAMS_PER_SM * sm_count / programs_per_split)
    return max(1, min(wanted, seq_k // MIN_KEYS_PER_SPLIT))


def _resolve_splits(num_splits: int | None, programs_per_split: int, seq_k: int, block_n: int, device) -> int:
    """The caller's split count as given (empty splits included); else the default, with splits
    that would start past the last key dropped."""
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
            raise ValueError(f"flash_decode: num_splits must be a positive int, got {num_splits!r}")
        return num_splits
    splits = default_num_splits(programs_per_split, seq_k, _sm_count(device))
    return cdiv(seq_k, _keys_per_split(seq_k, splits, block_n))


def _keys_per_split(seq_k: int, splits: int, block_n: int) -> int:
    """Whole key blocks per split, so a split's blocks never straddle two splits."""
    return cdiv(cdiv(seq_k, splits), block_n) * block_n


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SM_COUNT


def _block_rows(rows: int, most: int) -> int:
    """Tile rows for the packed (query head, query) rows: a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, min(next_power_of_2(rows), most))


def _launch_config(q: Tensor, config: dict | None) -> dict:
    """Defaults by device, then the caller's overrides, checked. The interpreter prefers small tiles."""
    if q.is_cuda:
        wide = q.shape[-1] > 128  # bigger K/V tiles: fewer stages and rows keep shared memory and registers in bounds
        cfg = {"BLOCK_N": 64, "BLOCK_M": 32 if wide else 64, "num_warps": 4, "num_stages": 2 if wide else 3}
    else:
        cfg = {"BLOCK_N": 32, "BLOCK_M": 32, "num_warps": 4, "num_stages": 1}
    unknown = set(config or {}) - set(CONFIG_KEYS)
    if unknown:
        raise ValueError(f"flash_decode: unknown config keys {sorted(unknown)}; expected some of {list(CONFIG_KEYS)}")
    cfg.update(config or {})
    for key in ("BLOCK_N", "BLOCK_M"):
        if not is_power_of_two(cfg[key]) or not 16 <= cfg[key] <= 256:
            raise ValueError(f"flash_decode: config {key} must be a power of two in [16, 256], got {cfg[key]!r}")
    if not is_power_of_two(cfg["num_warps"]) or cfg["num_warps"] > 16:
        raise ValueError(f"flash_decode: config num_warps must be a power of two <= 16, got {cfg['num_warps']!r}")
    if isinstance(cfg["num_stages"], bool) or not isinstance(cfg["num_stages"], int) or cfg["num_stages"] < 1:
        raise ValueError(f"flash_decode: config num_stages must be a positive int, got {cfg['num_stages']!r}")
    return cfg


@triton.jit
def _split_partials_kernel(
        q, k, v, mask, part_acc, part_max, part_sum, out, lse,
        stride_qb, stride_qh, stride_qt, stride_qd,
        stride_kb, stride_kh, stride_kt, stride_kd,
        stride_vb, stride_vh, stride_vt, stride_vd,
        stride_mb, stride_mh, stride_mq, stride_mk,
        heads, kv_heads, seq_q, seq_k, keys_per_split, splits, qk_scale,
        HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        DIRECT: tl.constexpr, STORE_LSE: tl.constexpr, SAFE: tl.constexpr):
    """One chunk of keys against every packed (query head, query) row of one kv head: partial
    softmax state (unnormalised acc, max, sum; log2 domain) into the workspaces; DIRECT (the only
    chunk) normalised into out and lse as the combine kernel would."""
    split = tl.program_id(0)
    batch = tl.program_id(1) // kv_heads
    kv_head = tl.program_id(1) % kv_heads
    group = heads // kv_heads

    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < group * seq_q
    head = kv_head * group + rows // seq_q
    query = rows % seq_q
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_rows = q + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh + query.to(tl.int64) * stride_qt
    q_tile = tl.load(q_rows[:, None] + dims[None, :] * stride_qd, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, seq_k)
    keys = tl.arange(0, BLOCK_N)
    k_ptrs = (k + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh + start.to(tl.int64) * stride_kt
              + dims[:, None] * stride_kd + keys[None, :] * stride_kt)  # [BLOCK_D, BLOCK_N]: K transposed
    v_ptrs = (v + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh + start.to(tl.int64) * stride_vt
              + keys[:, None] * stride_vt + dims[None, :] * stride_vd)  # [BLOCK_N, BLOCK_D]
    m_ptrs = (mask + batch.to(tl.int64) * stride_mb + head.to(tl.int64) * stride_mh + query.to(tl.int64) * stride_mq
              + start.to(tl.int64) * stride_mk)[:, None] + keys[None, :] * stride_mk
    last_key = query + (seq_k - seq_q)  # causal, bottom-right aligned: row sees keys <= this

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for block_start in range(start, end, BLOCK_N):
        key = block_start + keys
        key_ok = key < end
        k_tile = tl.load(k_ptrs, mask=dim_ok[:, None] & key_ok[None, :], other=0.0)
        s = tl.dot(q_tile, k_tile, input_precision=DOT_PRECISION) * qk_scale
        if HAS_MASK:
            bias = tl.load(m_ptrs, mask=row_ok[:, None] & key_ok[None, :], other=0.0)
            s = add_mask(s, bias)
        visible = key_ok[None, :]
        if CAUSAL:
            visible = visible & (key[None, :] <= last_key[:, None])
        s = tl.where(visible, s, float("-inf"))

        new_max, shift = running_max(row_max, tl.max(s, 1), True)  # (masked or past the keys: rows may be empty)
        p = tl.exp2(s - shift[:, None])
        rescale = tl.exp2(row_max - shift)
        row_sum = row_sum * rescale + tl.sum(p, 1)
        v_tile = tl.load(v_ptrs, mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        acc = acc * rescale[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=DOT_PRECISION)
        row_max = new_max

        k_ptrs += BLOCK_N * stride_kt
        v_ptrs += BLOCK_N * stride_vt
        m_ptrs += BLOCK_N * stride_mk

    if DIRECT:  # out and lse rows: (batch * heads + head) * seq_q + query, as in the combine kernel
        row = ((batch * heads + head) * seq_q + query).to(tl.int64)
        normalised = acc / softmax_denominator(row_sum, SAFE)[:, None]
        tl.store(out + row[:, None] * HEAD_DIM + dims[None, :], normalised.to(out.dtype.element_ty),
                 mask=row_ok[:, None] & dim_ok[None, :])
        if STORE_LSE:
            tl.store(lse + row, log_sum_exp(row_max, row_sum, SAFE), mask=row_ok)
    else:
        part = (((batch * heads + head) * seq_q + query) * splits + split).to(tl.int64)
        tl.store(part_max + part, row_max, mask=row_ok)
        tl.store(part_sum + part, row_sum, mask=row_ok)
        tl.store(part_acc + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _combine_splits_kernel(part_acc, part_max, part_sum, out, lse, splits,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                           STORE_LSE: tl.constexpr, SAFE: tl.constexpr):
    """One output row from its splits' partial states: rescale each to a common max, sum, normalise."""
    row = tl.program_id(0).to(tl.int64)  # (batch * heads + head) * seq_q + query: out's and lse's row
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    lanes = tl.arange(0, BLOCK_S)

    run_max = tl.full([], float("-inf"), tl.float32)
    run_sum = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for first in range(0, splits, BLOCK_S):
        split = first + lanes
        split_ok = split < splits
        part = row * splits + split
        m = tl.load(part_max + part, mask=split_ok, other=float("-inf"))
        l = tl.load(part_sum + part, mask=split_ok, other=0.0)
        a = tl.load(part_acc + part[:, None] * HEAD_DIM + dims[None, :], mask=split_ok[:, None] & dim_ok[None, :],
                    other=0.0)
        new_max, shift = running_max(run_max, tl.max(m, 0), True)  # empty or fully masked splits weigh 0
        weight = tl.exp2(m - shift)
        rescale = tl.exp2(run_max - shift)
        run_sum = run_sum * rescale + tl.sum(weight * l, 0)
        acc = acc * rescale + tl.sum(weight[:, None] * a, 0)
        run_max = new_max

    tl.store(out + row * HEAD_DIM + dims, (acc / softmax_denominator(run_sum, SAFE)).to(out.dtype.element_ty),
             mask=dim_ok)
    if STORE_LSE:
        tl.store(lse + row, log_sum_exp(run_max, run_sum, SAFE))


settle_cache_keys(globals())  # each kernel's Triton key the same in every process (codegen/jit_keys.py)
