"""Candidate launch configs for benchmarks/tune_attention.py: the grids, rough shared-memory and
register estimates that drop configs which cannot fit or are slow for a known reason, and short labels."""
from __future__ import annotations

import itertools

SMEM_LIMIT = 232448  # bytes of shared memory one block may use on an H100/H200 (227 KiB)
FORWARD_GRID = dict(BLOCK_M=(64, 128), BLOCK_N=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3, 4))
DECODE_GRID = dict(BLOCK_N=(32, 64, 128, 256), num_splits=(None, 16, 32, 64, 128), num_warps=(4, 8),
                   num_stages=(2, 3))
BACKWARD_GRID = dict(resident=(64, 128), streamed=(16, 32, 64), num_warps=(4, 8), num_stages=(1, 2, 3))


def grid(axes: dict) -> list[dict]:
    """Every combination of the values in `axes`, as dicts."""
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def forward_smem(cfg: dict, head_dim: int, elem: int = 2) -> int:
    """Rough shared memory of one forward block: Q [M, D] once, K and V [N, D] num_stages deep."""
    return elem * head_dim * (cfg["BLOCK_M"] + 2 * cfg["num_stages"] * cfg["BLOCK_N"])


def forward_slow(cfg: dict, head_dim: int) -> str | None:
    """Why a forward config that fits is still not worth timing, or None. Off with --full."""
    m, n, threads = cfg["BLOCK_M"], cfg["BLOCK_N"], 32 * cfg["num_warps"]
    if m * n < 16 * threads:
        return "warps idle: fewer than 16 score elements per thread"
    if (m * head_dim + m * n) / threads > 192:
        return "spills: fp32 accumulator plus scores over 192 registers per thread"
    if head_dim <= 64 and n == 32:
        return "key tiles too thin for the tensor cores at this head dim"
    if head_dim <= 128 and cfg["num_stages"] == 2:
        return "two stages cannot hide the K/V loads at this head dim"
    return None


def forward_candidates(head_dim: int, full: bool) -> list[dict]:
    """FORWARD_GRID minus what cannot fit shared memory and (unless full) what forward_slow drops."""
    return [c for c in grid(FORWARD_GRID) if forward_smem(c, head_dim) <= SMEM_LIMIT
            and (full or not forward_slow(c, head_dim))]


def mirrored_backward_config(tiles: dict) -> dict:
    """flash_backward's keys from a (resident, streamed) pair: the dK/dV kernel keeps `resident` keys
    and streams `streamed` queries, the dQ kernel the mirror image (as FlashAttention-2's Triton
    backward does), so one pair sizes both kernels."""
    r, s = tiles["resident"], tiles["streamed"]
    return dict(DKDV_BLOCK_M=s, DKDV_BLOCK_N=r, DQ_BLOCK_M=r, DQ_BLOCK_N=s,
                num_warps=tiles["num_warps"], num_stages=tiles["num_stages"])


def backward_smem(tiles: dict, head_dim: int, elem: int = 2) -> int:
    """Rough shared memory of the dK/dV block: K and V [resident, D], Q and dO [streamed, D] staged."""
    return elem * head_dim * (2 * tiles["resident"] + 2 * tiles["num_stages"] * tiles["streamed"])


def backward_slow(tiles: dict, head_dim: int) -> str | None:
    """Why a backward config that fits is still not worth timing, or None. Off with --full."""
    r, s, threads = tiles["resident"], tiles["streamed"], 32 * tiles["num_warps"]
    if r * s < 16 * threads:
        return "warps idle: fewer than 16 score elements per thread"
    if (2 * r * head_dim + r * s) / threads > 192:
        return "spills: fp32 dK and dV plus scores over 192 registers per thread"
    return None


def backward_candidates(head_dim: int, full: bool) -> list[dict]:
    return [mirrored_backward_config(t) for t in grid(BACKWARD_GRID) if backward_smem(t, head_dim) <= SMEM_LIMIT
            and (full or not backward_slow(t, head_dim))]


def decode_candidates(seq_k: int, full: bool) -> list[dict]:
    """DECODE_GRID minus (unless full) split counts so high that splits of BLOCK_N keys would be empty."""
    return [c for c in grid(DECODE_GRID) if full or c["num_splits"] is None or c["num_splits"] * c["BLOCK_N"] <= seq_k]


def label(cfg: dict | None) -> str:
    """Short name of a config: M128 N64 w8 s3; dkdv32x128 dq128x32 w8 s2; N64 splits=auto w4 s2."""
    if cfg is None:
        return "default"
    parts = []
    if "BLOCK_M" in cfg:
        parts.append(f"M{cfg['BLOCK_M']}")
    if "BLOCK_N" in cfg:
        parts.append(f"N{cfg['BLOCK_N']}")
    for tile in ("DKDV", "DQ"):
        if f"{tile}_BLOCK_M" in cfg:
            parts.append(f"{tile.lower()}{cfg[f'{tile}_BLOCK_M']}x{cfg[f'{tile}_BLOCK_N']}")
    if "num_splits" in cfg:
        parts.append(f"splits={cfg['num_splits'] or 'auto'}")
    parts += [f"w{cfg['num_warps']}", f"s{cfg['num_stages']}"]
    named = {"BLOCK_M", "BLOCK_N", "num_splits", "num_warps", "num_stages", "DKDV_BLOCK_M", "DKDV_BLOCK_N",
             "DQ_BLOCK_M", "DQ_BLOCK_N"}
    return " ".join(parts + [f"{k}={v}" for k, v in cfg.items() if k not in named])
