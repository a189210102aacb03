"""What fxopt's flash-attention forward and backward share: launch configs, input checks, Triton helpers.

Both passes walk a grid of [query block x key block] score tiles. Most tiles need no elementwise
masks: only the tiles on the causal diagonal and at the ragged ends of the sequences do, so each
kernel splits its loop into a mask-free part and a masked part; the helpers here compute those
ranges, load tiles with bounds masks only on the axes that can run past the tensor, and build the
score-tile mask.

CPU tensors run in the Triton interpreter, CUDA tensors through the compiler. Which of the two a
process can use is fixed when triton is imported (TRITON_INTERPRET=1 turns triton.language's own
@jit functions into interpreted ones, which the compiler cannot inline), so every launch checks that
its tensors' device matches.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..codegen.interpreter_guard import launcher as launch_guarded
from ..codegen.jit_keys import settle as settle_cache_keys
from ..codegen.wrapper_runtime import next_power_of_2

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # scores are kept in base 2: exp(x) = exp2(x * LOG2E)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (16, 256)
MAX_GRID_AXIS_1 = 65535  # CUDA's limit on the grid's y axis, which carries batch * heads

# The TMA kernels are the default only where both sequences have at least this many rows: below it a
# call is launch-bound, and the TMA path costs more host time (tensor descriptors encoded by Triton's
# Python launcher on every launch; torch's C launcher takes no descriptors) for no GPU time to save.
TMA_MIN_SEQ = 128

# 16-bit inputs on an H100/H200-class GPU, by the largest head dim served; causal and non-causal
# share a row (the same tiles won both when measured on an H200, bf16, B8 H16 T2048).
# Forward: bigger head dims hold a wider q tile and accumulator in registers.
_FORWARD_GPU = {
    64: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    128: dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
    256: dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
}
# The same through TMA descriptors (flash_forward_tma.py), which hold no pointer tiles in registers:
# one warpgroup on 64 x 64 tiles won every hd64/hd128 case of the 2026-12-01 sweep (causal hd128
# B8 H16 T2048: 0.319 ms against 0.367 for 128 x 128 with 8 warps and 0.394 for the best pointer config).
_FORWARD_GPU_TMA = {
    64: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    128: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    256: dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
}
# Backward: the dK/dV kernel keeps a key block (K, V, dK, dV) in registers and streams query blocks;
# the dQ kernel keeps a query block (Q, dO, dQ) and streams key blocks.
_BACKWARD_GPU = {
    64: dict(DKDV_BLOCK_M=32, DKDV_BLOCK_N=64, DQ_BLOCK_M=64, DQ_BLOCK_N=32, num_warps=4, num_stages=3),
    128: dict(DKDV_BLOCK_M=64, DKDV_BLOCK_N=64, DQ_BLOCK_M=64, DQ_BLOCK_N=64, num_warps=4, num_stages=2),
    256: dict(DKDV_BLOCK_M=32, DKDV_BLOCK_N=32, DQ_BLOCK_M=32, DQ_BLOCK_N=32, num_warps=4, num_stages=2),
}
# The same through TMA descriptors (flash_backward_tma.py): on the 2026-12-01 sweep (causal hd128 B8 H16
# T2048, bf16) 64 x 64 tiles, 4 warps, 2 stages took 0.958 ms against 1.237 ms for the best pointer
# config (SDPA 0.829); causal hd64: 0.574 ms with 3 stages (0.95x SDPA). hd256 stays on the pointer
# kernels: its tiles have not been measured through TMA.
_BACKWARD_GPU_TMA = {
    64: dict(DKDV_BLOCK_M=64, DKDV_BLOCK_N=64, DQ_BLOCK_M=64, DQ_BLOCK_N=64, num_warps=4, num_stages=3),
    128: dict(DKDV_BLOCK_M=64, DKDV_BLOCK_N=64, DQ_BLOCK_M=64, DQ_BLOCK_N=64, num_warps=4, num_stages=2),
}
# float32 products run on the CUDA cores (input_precision "ieee") and float32 tiles take twice the
# registers: small tiles keep them from spilling.
_FORWARD_GPU_FP32 = {
    64: dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
    128: dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2),
    256: dict(BLOCK_M=32, BLOCK_N=16, num_warps=8, num_stages=1),
}
_BACKWARD_GPU_FP32 = {
    64: dict(DKDV_BLOCK_M=32, DKDV_BLOCK_N=32, DQ_BLOCK_M=32, DQ_BLOCK_N=32, num_warps=4, num_stages=1),
    128: dict(DKDV_BLOCK_M=16, DKDV_BLOCK_N=32, DQ_BLOCK_M=32, DQ_BLOCK_N=16, num_warps=8, num_stages=1),
    256: dict(DKDV_BLOCK_M=16, DKDV_BLOCK_N=16, DQ_BLOCK_M=16, DQ_BLOCK_N=16, num_warps=8, num_stages=1),
}
# The interpreter runs one program at a time in numpy: small tiles keep tests fast and still cross
# block boundaries at tiny sequence lengths.
_FORWARD_CPU = dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
_BACKWARD_CPU = dict(DKDV_BLOCK_M=16, DKDV_BLOCK_N=32, DQ_BLOCK_M=32, DQ_BLOCK_N=16, num_warps=4, num_stages=1)


def forward_config(head_dim: int, causal: bool, dtype, seq_q: int, seq_k: int, device_type: str,
                   has_mask: bool = False) -> dict:
    """Default launch parameters for flash_forward (a fresh dict). With a mask, its [BLOCK_M, BLOCK_N]
    tile is pipelined through shared memory next to K and V: BLOCK_N at most 64 keeps all three in
    an H200's 227 KB (128 x 128 tiles, 3 stages, need 352 KB)."""
    tma = device_type == "cuda" and dtype != torch.float32 and min(seq_q, seq_k) >= TMA_MIN_SEQ
    if device_type == "cpu":
        cfg = dict(_FORWARD_CPU)
    else:
        table = _FORWARD_GPU_FP32 if dtype == torch.float32 else _FORWARD_GPU_TMA if tma else _FORWARD_GPU
        cfg = dict(_by_head_dim(table, head_dim))
        if has_mask:
            cfg["BLOCK_N"] = min(cfg["BLOCK_N"], 64)
    cfg["TMA"] = tma
    return _fit_blocks(cfg, {"BLOCK_M": seq_q, "BLOCK_N": seq_k})


def backward_config(head_dim: int, causal: bool, dtype, seq_q: int, seq_k: int, device_type: str) -> dict:
    """Default launch parameters for flash_backward (a fresh dict)."""
    tma = (device_type == "cuda" and dtype != torch.float32 and head_dim <= max(_BACKWARD_GPU_TMA)
           and min(seq_q, seq_k) >= TMA_MIN_SEQ)
    if device_type == "cpu":
        cfg = dict(_BACKWARD_CPU)
    else:
        table = _BACKWARD_GPU_FP32 if dtype == torch.float32 else _BACKWARD_GPU_TMA if tma else _BACKWARD_GPU
        cfg = dict(_by_head_dim(table, head_dim))
    cfg["TMA"] = tma  # flash_backward still checks tma_applies (capability, mask, layout) per call
    return _fit_blocks(cfg, {"DKDV_BLOCK_M": seq_q, "DKDV_BLOCK_N": seq_k, "DQ_BLOCK_M": seq_q, "DQ_BLOCK_N": seq_k})


def _by_head_dim(table: dict, head_dim: int) -> dict:
    return table[min(d for d in table if d >= head_dim)]


def _fit_blocks(cfg: dict, lengths: dict) -> dict:
    """Shrink blocks longer than their sequence (down to 16, tl.dot's least size): a 1-row decode
    query should not pay for a 128-row tile."""
    for key, length in lengths.items():
        cfg[key] = min(cfg[key], max(16, next_power_of_2(length)))
    return cfg


def resolve_config(config: dict | None, defaults: dict, who: str) -> dict:
    """The defaults overridden by the caller's config, checked (unknown keys and bad values raise)."""
    if config is None:
        return defaults
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        raise ValueError(f"{who}: unknown config keys {unknown}; expected some of {list(defaults)}")
    cfg = {**defaults, **config}
    for key, value in cfg.items():
        if key.endswith(("BLOCK_M", "BLOCK_N")) and not (is_power_of_two(value) and 16 <= value <= 256):
            raise ValueError(f"{who}: config {key} must be a power of two in [16, 256], got {value!r}")
    if not (is_power_of_two(cfg["num_warps"]) and cfg["num_warps"] <= 16):
        raise ValueError(f"{who}: config num_warps must be a power of two <= 16, got {cfg['num_warps']!r}")
    if not (_is_int(cfg["num_stages"]) and cfg["num_stages"] >= 1):
        raise ValueError(f"{who}: config num_stages must be a positive int, got {cfg['num_stages']!r}")
    return cfg


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_power_of_two(x) -> bool:
    return _is_int(x) and x > 0 and x & (x - 1) == 0


def check_attention_inputs(who: str, q, k, v, mask, causal: bool, scale) -> None:
    """ValueError naming the expected shape, dtype or device, before anything launches."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"{who}: {name} must be a 4-D tensor [B, heads, seq, head_dim], got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{who}: q, k, v must share one dtype of {DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}")
    check_device(who, q, k=k, v=v)
    (batch, heads, seq_q, head_dim), (kv_heads, seq_k) = q.shape, k.shape[1:3]
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"{who}: k and v must both be [B={batch}, Hkv, Tk, D={head_dim}] (q is {list(q.shape)}), "
                         f"got {list(k.shape)} and {list(v.shape)}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"{who}: query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    if not HEAD_DIMS[0] <= head_dim <= HEAD_DIMS[1]:
        raise ValueError(f"{who}: head_dim must be in [{HEAD_DIMS[0]}, {HEAD_DIMS[1]}], got {head_dim}")
    if causal and seq_q > seq_k:
        raise ValueError(f"{who}: causal attention (bottom-right aligned) needs Tq <= Tk, got Tq={seq_q}, Tk={seq_k}")
    if batch * heads > MAX_GRID_AXIS_1:
        raise ValueError(f"{who}: batch * heads must be at most {MAX_GRID_AXIS_1} (the grid's axis 1), "
                         f"got {batch} * {heads}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"{who}: scale must be a float, got {scale!r}")
    if mask is not None:
        expected = [batch, heads, seq_q, seq_k]
        if not isinstance(mask, Tensor) or mask.dtype not in (*DTYPES, torch.bool):
            raise ValueError(f"{who}: mask must be an additive float tensor of {DTYPES} or a bool one (True "
                             f"keeps the score), got {getattr(mask, 'dtype', type(mask).__name__)}")
        if list(mask.shape) != expected:
            raise ValueError(f"{who}: mask must be expanded to [B, H, Tq, Tk] = {expected}, got {list(mask.shape)}")
        check_device(who, q, mask=mask)


def check_key_slopes(who: str, q: Tensor, key_slopes: Tensor | None) -> None:
    """Per-head position-bias slopes (see add_key_slope): float32 [H] on q's device."""
    if key_slopes is None:
        return
    if not isinstance(key_slopes, Tensor) or key_slopes.dtype != torch.float32 or key_slopes.dim() != 1 \
            or key_slopes.shape[0] != q.shape[1]:
        raise ValueError(f"{who}: key_slopes must be float32 [H] = [{q.shape[1]}], got "
                         f"{getattr(key_slopes, 'dtype', type(key_slopes).__name__)} "
                         f"{list(getattr(key_slopes, 'shape', []))}")
    check_device(who, q, key_slopes=key_slopes)


def check_saved(dout, out, lse, q: Tensor) -> None:
    """flash_backward's saved tensors: dout and out like q; lse float32 [B, H, Tq]."""
    for name, t in (("dout", dout), ("out", out)):
        if not isinstance(t, Tensor) or t.shape != q.shape or t.dtype != q.dtype:
            raise ValueError(f"flash_backward: {name} must be {q.dtype} {list(q.shape)} like q, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', []))}")
    if not isinstance(lse, Tensor) or lse.shape != q.shape[:3] or lse.dtype != torch.float32:
        raise ValueError(f"flash_backward: lse must be float32 {list(q.shape[:3])} ([B, H, Tq]), got "
                         f"{getattr(lse, 'dtype', type(lse).__name__)} {list(getattr(lse, 'shape', []))}")
    check_device("flash_backward", q, dout=dout, out=out, lse=lse)


def check_device(who: str, q: Tensor, **others: Tensor) -> None:
    """Every tensor on q's device, which is a CUDA device or the CPU (the Triton interpreter)."""
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{who}: tensors must be on a cuda device or the cpu (Triton interpreter), got {q.device}")
    for name, t in others.items():
        if t.device != q.device:
            raise ValueError(f"{who}: {name} must be on q's device {q.device}, got {t.device}")


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs get float32 products, as torch's matmul does by default (tf32 would keep about
    3 decimal digits); for 16-bit inputs the setting changes nothing."""
    return "ieee" if dtype == torch.float32 else "tf32"


def launcher(kernel, grid: tuple, device: torch.device):
    """`kernel[grid]`, interpreted for CPU tensors and compiled for CUDA ones (see interpreter_guard)."""
    return launch_guarded(kernel, grid, device, "fxopt flash attention")


@triton.jit
def running_max(row_max, block_max, EMPTY_ROWS: tl.constexpr):
    """The online softmax's (new row max, the shift its exp2 subtracts). EMPTY_ROWS (a mask may hide every
    key seen so far): such a row is shifted by 0, so exp2(-inf - 0) = 0 rather than exp2(-inf + inf) = NaN."""
    new_max = tl.maximum(row_max, block_max)
    shift = new_max
    if EMPTY_ROWS:
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    return new_max, shift


@triton.jit
def softmax_denominator(row_sum, SAFE: tl.constexpr):
    """A finished row's sum of exp2(s - max), to divide its output by. A row with no visible key has sum 0
    (every p was exp2(-inf)): 0 / 0 = NaN, as eager's softmax gives; SAFE (SDPA's softmax) makes it 0."""
    if SAFE:
        row_sum = tl.where(row_sum == 0.0, 1.0, row_sum)
    return row_sum


@triton.jit
def log_sum_exp(row_max, row_sum, SAFE: tl.constexpr):
    """A finished row's natural-log log-sum-exp from its base-2 max and sum; -inf for a row with no visible
    key, or with SAFE +inf: the backward's P = exp2(s - lse) is then 0 for every key, so the row's
    gradients are 0 as SDPA's are, with no test in the backward kernels."""
    lse = (row_max + tl.log2(row_sum)) * LN2
    if SAFE:
        lse = tl.where(row_sum == 0.0, float("inf"), lse)
    return lse


@triton.jit
def head_slope(Slopes, head, HAS_SLOPES: tl.constexpr):
    """The head's position-bias slope in base-2 units (0.0 without slopes)."""
    if HAS_SLOPES:
        slope = tl.load(Slopes + head) * LOG2E
    else:
        slope = 0.0
    return slope


@triton.jit
def add_key_slope(s, slope, q_idx, k_idx, causal_shift):
    """Base-2 scores plus a linear position bias (ALiBi): slope * (key - query - (Tk - Tq)). The bias a
    model builds, slope * (j - i) plus any per-row constant, gives the same softmax; this form is 0 on
    the (bottom-right) diagonal, so it stays as small, and as exact in float32, as the model's own.
    q_idx and k_idx broadcast to the tile."""
    return s + slope * (k_idx - q_idx - causal_shift).to(tl.float32)


@triton.jit
def tile_ptrs(base, row0, rows, stride_r, col0, cols, stride_c):
    """Pointers to the tile [row0 + rows, col0 + cols]: the tile's start in 64 bits (long sequences,
    big masks), the offsets inside it in 32."""
    start = base + tl.cast(row0, tl.int64) * stride_r + tl.cast(col0, tl.int64) * stride_c
    return start + rows[:, None] * stride_r + cols[None, :] * stride_c


@triton.jit
def load_tile(ptrs, offs_r, n_r, offs_c, n_c, EVEN_R: tl.constexpr, EVEN_C: tl.constexpr):
    """A [R, C] tile, zeros where it runs past n_r rows or n_c columns; EVEN_* axes are known to be in
    bounds and get no mask."""
    if EVEN_R:
        if EVEN_C:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=offs_c[None, :] < n_c, other=0.0)
    else:
        if EVEN_C:
            tile = tl.load(ptrs, mask=offs_r[:, None] < n_r, other=0.0)
        else:
            tile = tl.load(ptrs, mask=(offs_r[:, None] < n_r) & (offs_c[None, :] < n_c), other=0.0)
    return tile


@triton.jit
def store_tile(ptrs, tile, offs_r, n_r, offs_c, n_c, EVEN_R: tl.constexpr, EVEN_C: tl.constexpr):
    """Store a [R, C] tile, skipping what runs past n_r rows or n_c columns."""
    if EVEN_R:
        if EVEN_C:
            tl.store(ptrs, tile)
        else:
            tl.store(ptrs, tile, mask=offs_c[None, :] < n_c)
    else:
        if EVEN_C:
            tl.store(ptrs, tile, mask=offs_r[:, None] < n_r)
        else:
            tl.store(ptrs, tile, mask=(offs_r[:, None] < n_r) & (offs_c[None, :] < n_c))


@triton.jit
def load_rows(ptrs, offs, n, EVEN: tl.constexpr):
    """A vector of per-row values (lse, delta), zeros past n."""
    if EVEN:
        rows = tl.load(ptrs)
    else:
        rows = tl.load(ptrs, mask=offs < n, other=0.0)
    return rows


@triton.jit
def store_rows(ptrs, values, offs, n, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptrs, values)
    else:
        tl.store(ptrs, values, mask=offs < n)


@triton.jit
def visible(q_idx, k_idx, seq_q, seq_k, causal_shift, CAUSAL: tl.constexpr):
    """Score-tile mask for the diagonal and ragged-end tiles: both indices inside their sequences and,
    if causal, key <= query + (Tk - Tq) (bottom-right aligned). q_idx and k_idx broadcast to the tile."""
    ok = (q_idx < seq_q) & (k_idx < seq_k)
    if CAUSAL:
        ok = ok & (k_idx <= q_idx + causal_shift)
    return ok


@triton.jit
def key_ranges(m0, seq_k, causal_shift, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """(mask_free_end, end) of the key loop of the query block starting at row m0.

    Key blocks below mask_free_end are seen whole by every row of the block and lie inside the keys:
    no elementwise mask. Blocks in [mask_free_end, end) straddle the causal diagonal or the ragged
    end of the keys. Causal blocks past `end` are invisible to every row and never visited."""
    if CAUSAL:
        mask_free_end = (m0 + causal_shift + 1) // BLOCK_N * BLOCK_N  # row m0 sees keys <= m0 + shift
        end = tl.minimum(m0 + BLOCK_M + causal_shift, seq_k)  # the block's last row sees keys < this
    else:
        mask_free_end = seq_k // BLOCK_N * BLOCK_N
        end = seq_k
    return mask_free_end, end


@triton.jit
def query_ranges(n0, seq_q, causal_shift, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """(first, mask_free_lo, ragged_lo): the query loop of the key block starting at n0.

    Query blocks before `first` see none of the block's keys (causal) and are skipped; blocks in
    [first, mask_free_lo) straddle the causal diagonal; blocks in [mask_free_lo, ragged_lo) see every
    key of the block and lie inside the queries (no elementwise mask); [ragged_lo, Tq) is the ragged
    last query block."""
    last_block_end = tl.cdiv(seq_q, BLOCK_M) * BLOCK_M
    if CAUSAL:
        first = tl.maximum(n0 - causal_shift, 0) // BLOCK_M * BLOCK_M  # row n0 - shift is the first to see key n0
        # row i sees all keys of the block once n0 + BLOCK_N - 1 <= i + shift
        mask_free_lo = tl.minimum(tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - causal_shift, 0), BLOCK_M) * BLOCK_M,
                                  last_block_end)
    else:
        first = 0
        mask_free_lo = 0
    ragged_lo = tl.maximum(mask_free_lo, seq_q // BLOCK_M * BLOCK_M)
    return first, mask_free_lo, ragged_lo


settle_cache_keys(globals())  # each kernel's Triton key the same in every process (codegen/jit_keys.py)
