"""Launch shapes of a fused pointwise kernel: the 1-D block and warps, the 2-D tile plan and its grid.

Kept apart from the source emitter (triton_pointwise.py): these are numbers the wrapper launches with,
chosen from the iteration space alone.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..analysis.symbolic import is_symbolic, pexpr
from .indexing import IterationSpace, TiledSpace, tile_dim


def launch_config(numel: int) -> tuple[int, int]:
    """XBLOCK and num_warps: 1024 elements over 4 warps (8 per thread) for large tensors (and for
    symbolic sizes, whose tail block is masked like any other)."""
    xblock = 1024
    if is_symbolic(numel):
        return xblock, 4
    while xblock > 64 and xblock >= 2 * numel:
        xblock //= 2
    return xblock, max(1, min(4, xblock // 256))


@dataclass(frozen=True)
class TilePlan:
    space: TiledSpace
    yblock: int
    xblock: int
    num_warps: int
    grid: tuple | str  # (y tiles, x tiles): program axes 0 and 1; or, when the innermost dim is symbolic,
    # one axis of y tiles * x tiles (source over the size symbols): axis 1's limit of 65535 could be passed


GRID_MAX = (2**31 - 1, 65535)  # CUDA's limits on grid axes 0 and 1


def _pow2(n) -> int:
    if is_symbolic(n):
        return 1 << 30  # unknown: as large as any block; the config clamps it
    return 1 << max(0, (n - 1).bit_length())


def cdiv_source(numel, block: int):
    """The programs that cover numel in blocks: an int, or source the wrapper evaluates per call."""
    if is_symbolic(numel):
        return f"cdiv({pexpr(numel)}, {block})"
    return -(-numel // block)


def tile_config(ynumel: int, xnumel: int) -> tuple[int, int, int]:
    """YBLOCK, XBLOCK and num_warps of a tiled kernel: 64x64 tiles over 4 warps; an axis shorter than
    64 gives the rest of the 4096-element tile to the other axis (a tile never exceeds either axis)."""
    elements = 4096
    xblock = min(64, _pow2(xnumel))
    yblock = min(elements // xblock, _pow2(ynumel))
    xblock = min(elements // yblock, _pow2(xnumel))
    return yblock, xblock, max(1, min(4, yblock * xblock // 256))


def plan_tiles(space: IterationSpace) -> TilePlan | None:
    """A 2-D tiling when some operand is contiguous along an outer dim and strided along the innermost
    (see indexing.tile_dim), None otherwise or when the tiled grid would exceed CUDA's limits."""
    ydim = tile_dim(space)
    if ydim is None:
        return None
    tiles = TiledSpace(space, ydim)
    yblock, xblock, warps = tile_config(tiles.ynumel, tiles.xnumel)
    grid = (cdiv_source(tiles.ynumel, yblock), cdiv_source(tiles.xnumel, xblock))
    if is_symbolic(tiles.xnumel):
        return TilePlan(tiles, yblock, xblock, warps, f"{grid[0]} * {grid[1]}")
    if any(isinstance(g, int) and g > limit for g, limit in zip(grid, GRID_MAX)):
        return None
    return TilePlan(tiles, yblock, xblock, warps, grid)
