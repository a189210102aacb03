"""Index arithmetic for pointwise kernels: one flat `xindex` over the iteration domain, mapped to each
operand's address through its strides (broadcast dims have stride 0).

The domain's dims are put in the memory order of the first output (so its stores are coalesced, also
for transposed layouts), size-1 dims are dropped, and adjacent dims that every operand walks
contiguously are merged. Addresses are built and simplified as sympy expressions; an operand laid out
like the domain itself indexes with `xindex` alone (no division or modulo).

When some operand is contiguous along an outer dim while being strided along the innermost one (a
transposed input next to a contiguous output), one flat index cannot coalesce both: `TiledSpace`
splits the domain into 2-D tiles, `yindex` over the outer dims (with the transposed operand's
contiguous dim innermost among them) and `xindex` over the innermost dim, so each operand is read
along whichever of the two axes it is contiguous in.

Sizes and strides may be sympy expressions of dynamo's size symbols (dynamic shapes): every decision
here is structural (`same`: equal for all values of the symbols) or uses the symbols' ranges
(`known_ge`), never the example values, so the index arithmetic holds for every size the graph serves.
"""
from __future__ import annotations

from dataclasses import dataclass

import re

import sympy

from ..analysis.symbolic import is_symbolic, known_ge, pexpr, same


@dataclass(frozen=True)
class Layout:
    """An operand as the kernel sees it: sizes and strides in elements, offset from its pointer."""

    size: tuple  # ints or sympy expressions of the size symbols
    stride: tuple
    offset: object = 0


def broadcast_strides(layout: Layout, domain: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of `layout` over the domain's dims, right-aligned as torch broadcasting does."""
    pad = len(domain) - len(layout.size)
    if pad < 0:
        raise ValueError(f"operand of shape {layout.size} does not broadcast to {domain}")
    out = []
    for d, dom in enumerate(domain):
        k = d - pad
        if k < 0 or layout.size[k] == 1:
            out.append(0)
        elif same(layout.size[k], dom):
            out.append(layout.stride[k])
        else:
            raise ValueError(f"operand of shape {layout.size} does not broadcast to {domain}")
    return tuple(out)


class IterationSpace:
    """The loop nest of a pointwise kernel, flattened onto one index."""

    def __init__(self, domain: tuple[int, ...], order_stride: tuple[int, ...], operands: list[Layout],
                 prefix: str = "x"):
        self.prefix = prefix
        self.numel = 1
        for s in domain:
            self.numel *= s
        strides = [broadcast_strides(op, domain) for op in operands]
        # outer -> inner in the memory order of the reference (first output) layout
        dims = [d for d in sorted(range(len(domain)), key=lambda d: -order_stride[d]) if domain[d] != 1]
        sizes = [domain[d] for d in dims]
        per_op = [[s[d] for d in dims] for s in strides]
        sizes, per_op = _merge_dims(sizes, per_op)
        self.sizes = sizes
        self.operand_strides = per_op
        self.offsets = [op.offset for op in operands]
        self.xindex = sympy.Symbol(f"{prefix}index", integer=True, nonnegative=True)
        self.coords = [sympy.Symbol(f"{prefix}{k}", integer=True, nonnegative=True) for k in range(len(sizes))]
        self.pitches = [_prod(sizes[k + 1:]) for k in range(len(sizes))]

    def address(self, i: int) -> sympy.Expr:
        """The element offset of operand i at the current index, in coordinates x0..xk.

        An operand that walks the domain in its own order (strides equal to the domain's pitches)
        is addressed by xindex itself: sum(pitch_k * x_k) == xindex by construction of the x_k."""
        strides = self.operand_strides[i]
        if self.coords and all(same(s, p) for s, p in zip(strides, self.pitches)):
            return self.xindex + self.offsets[i]
        return sympy.Add(*(s * x for s, x in zip(strides, self.coords)), self.offsets[i])

    def max_address(self, i: int) -> int:
        return self.offsets[i] + sum(abs(s) * (n - 1) for s, n in zip(self.operand_strides[i], self.sizes))

    def coord_lines(self, used: set[sympy.Symbol]) -> list[str]:
        """Lines defining the coordinates that the addresses use."""
        return _coord_lines(self.xindex, self.coords, self.sizes, self.pitches, used)


class TiledSpace:
    """The loop nest as 2-D tiles of an IterationSpace: y = the outer dims flattened (row-major, the
    tiled dim `ydim` moved innermost), x = the innermost dim alone, so `xindex` is its coordinate.

    An operand's address is (y strides . y coordinates) + (x stride * xindex) + offset; where its y
    strides are a multiple c of the y pitches (laid out like y, e.g. a contiguous output: c = xnumel,
    or a transposed input: c = 1), the y part is c * yindex, without division or modulo."""

    def __init__(self, space: IterationSpace, ydim: int):
        outer = len(space.sizes) - 1
        if not 0 <= ydim < outer:
            raise ValueError(f"tiled dim {ydim} is not an outer dim of {space.sizes}")
        order = [d for d in range(outer) if d != ydim] + [ydim]
        ysizes, ystrides = _merge_dims([space.sizes[d] for d in order],
                                       [[s[d] for d in order] for s in space.operand_strides])
        self.ysizes = ysizes
        self.ynumel = _prod(ysizes)
        self.xnumel = space.sizes[-1]
        self.numel = space.numel
        self.y_strides = ystrides
        self.x_strides = [s[-1] for s in space.operand_strides]
        self.offsets = list(space.offsets)
        self.yindex = sympy.Symbol("yindex", integer=True, nonnegative=True)
        self.xindex = sympy.Symbol("xindex", integer=True, nonnegative=True)
        self.ycoords = [sympy.Symbol(f"y{k}", integer=True, nonnegative=True) for k in range(len(ysizes))]
        self.ypitches = [_prod(ysizes[k + 1:]) for k in range(len(ysizes))]
        self.ysymbols = {self.yindex, *self.ycoords}

    def address(self, i: int) -> sympy.Expr:
        """The element offset of operand i in the tile, in yindex (or y0..yk) and xindex."""
        ys = self.y_strides[i]
        c = ys[-1]
        if all(same(s, c * p) for s, p in zip(ys, self.ypitches)):
            ypart = c * self.yindex
        else:
            ypart = sympy.Add(*(s * y for s, y in zip(ys, self.ycoords)))
        return ypart + self.x_strides[i] * self.xindex + self.offsets[i]

    def max_address(self, i: int) -> int:
        return (self.offsets[i] + sum(abs(s) * (n - 1) for s, n in zip(self.y_strides[i], self.ysizes))
                + abs(self.x_strides[i]) * (self.xnumel - 1))

    def coord_lines(self, used: set[sympy.Symbol]) -> list[str]:
        """Lines defining the y coordinates that the addresses use."""
        return _coord_lines(self.yindex, self.ycoords, self.ysizes, self.ypitches, used)


def tile_dim(space: IterationSpace) -> int | None:
    """The outer dim to tile against the innermost one, or None when the flat index serves every operand.

    An operand wants dim k when it is contiguous there (stride 1) and strided along the innermost dim
    (stride > 1: neighbouring lanes of a flat index would be that far apart); tiling pays when another
    operand is contiguous along the innermost dim. The first operand that wants a dim picks it."""
    if len(space.sizes) < 2:
        return None
    inner = [s[-1] for s in space.operand_strides]
    if 1 not in inner:
        return None
    for s in space.operand_strides:
        if known_ge(abs(s[-1]), 2) and 1 in s[:-1]:
            return list(s).index(1)
    return None


def _coord_lines(index, coords, sizes, pitches, used) -> list[str]:
    """`x1 = (xindex // 4096) % 8`-style lines for the coordinates in `used`, outermost first."""
    lines = []
    for k, (x, size, pitch) in enumerate(zip(coords, sizes, pitches)):
        if x not in used:
            continue
        expr = f"{index}" if pitch == 1 else f"({index} // {_paren(pitch)})"
        if k > 0:  # the outermost coordinate never wraps
            expr = f"{expr} % {_paren(size)}"
        lines.append(f"{x} = {expr}")
    return lines


def _paren(e) -> str:
    if not is_symbolic(e):
        return str(e)
    return pexpr(e) if isinstance(e, sympy.Symbol) else f"({pexpr(e)})"


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def _merge_dims(sizes: list[int], per_op: list[list[int]]):
    """Merge dim k into k+1 where every operand has stride[k] == stride[k+1] * size[k+1]."""
    k = 0
    sizes = list(sizes)
    per_op = [list(s) for s in per_op]
    while k + 1 < len(sizes):
        if all(same(s[k], s[k + 1] * sizes[k + 1]) for s in per_op):
            sizes[k + 1] *= sizes[k]
            del sizes[k]
            for s in per_op:
                del s[k]
        else:
            k += 1
    return sizes, per_op


def print_index(expr: sympy.Expr) -> str:
    """Python/Triton source for an address expression (sympy's str printer writes valid Python)."""
    return pexpr(expr) if size_symbols(expr) else str(expr)  # static kernels keep their text


INDEX_NAME = re.compile(r"^[xyr](index|\d+)$")  # the kernel's own index symbols, not sizes


def size_symbols(*exprs) -> list[sympy.Symbol]:
    """The size symbols (dynamo's s0, s1, ...) the expressions use, sorted by name: kernel arguments."""
    found = set()
    for e in exprs:
        if isinstance(e, sympy.Basic):
            found |= {s for s in e.free_symbols if not INDEX_NAME.match(s.name)}
    return sorted(found, key=lambda s: (len(s.name), s.name))


def index_symbols(e) -> set:
    """The kernel's own index symbols an address uses (size symbols are arguments, not lanes)."""
    if not isinstance(e, sympy.Basic):
        return set()
    return {s for s in e.free_symbols if INDEX_NAME.match(s.name)}


def needs_int64(numel, max_addresses) -> bool:
    """Index arithmetic in int64: some offset may pass 2**31 - 1. Symbolic sizes have no upper bound
    (a later call may be larger), so a kernel over symbolic sizes always indexes in int64."""
    exprs = [numel, *max_addresses]
    if any(is_symbolic(e) for e in exprs):
        return True
    return any(int(e) > 2**31 - 1 for e in exprs)
