"""`cat` inside a fused pointwise kernel: each input is a piece of the output's domain, read from memory
at its offset along the cat dim with a mask, and the cat's value is the piece the lane falls in.

    cat_dim3 = x0                                   # the lane's coordinate along the cat dim
    cat_p0 = tl.load(in_ptr1 + (x0 + 16*x1), xmask & (cat_dim3 < 16), other=0)
    cat_p1 = tl.load(in_ptr2 + (x0 + 16*x1 - 16), xmask & (cat_dim3 >= 16), other=0)
    cat = tl.where(cat_dim3 < 16, cat_p0, cat_p1)  # aten.cat.default

A piece is laid out over the whole domain (its own strides, its offset moved back by its start along
the dim times its stride there), so the iteration space indexes it like any operand; lanes outside the
piece are masked and never read. A coordinate operand (stride 1 along the cat dim, 0 elsewhere) gives
the lane's coordinate along the dim and keeps that dim from being merged with its neighbours.
Rotary embeddings (`cat((-x2, x1), dim=-1)`) and packed projections are the cats models write; the
multiply-add that consumes them fuses into the same kernel instead of an ATen cat writing a copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from ..analysis.op_classes import GATHERS, is_view
from ..analysis.symbolic import sizes
from .indexing import Layout


@dataclass(frozen=True)
class Piece:
    cat: fx.Node
    index: int  # position among the cat's inputs
    source: fx.Node  # the placeholder (or view chain of one) read
    dim: int
    start: int  # first coordinate of the piece along dim
    end: int

    @property
    def name(self) -> str:
        return f"{self.cat.name}_p{self.index}"


def cat_pieces(nodes: list[fx.Node]) -> list[Piece]:
    """Every input of every cat in the group, in order."""
    pieces = []
    for n in nodes:
        if n.op != "call_function" or n.target not in GATHERS:
            continue
        rank = n.meta["val"].dim()
        dim = (n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)) % rank
        start = 0
        for j, src in enumerate(n.args[0]):
            if not _read_from_memory(src):
                raise NotImplementedError(f"cat '{n.name}': input '{src.name}' is computed in the same kernel")
            size = int(sizes(src.meta["val"])[dim])
            pieces.append(Piece(n, j, src, dim, start, start + size))
            start += size
    return pieces


def _read_from_memory(src: fx.Node) -> bool:
    """A placeholder of the group, or a view chain of one (views absorbed by the fuse pass)."""
    while is_view(src):
        src = src.args[0]
    return src.op == "placeholder"


def piece_layout(piece: Piece, own: Layout, domain: tuple) -> Layout:
    """The piece's layout `own` stretched over the whole domain, shifted back by its start."""
    return Layout(tuple(domain), own.stride, own.offset - piece.start * own.stride[piece.dim])


def coordinate_layout(dim: int, domain: tuple) -> Layout:
    return Layout(tuple(domain), tuple(1 if k == dim else 0 for k in range(len(domain))), 0)


def coordinate_name(dim: int) -> str:
    return f"cat_dim{dim}"


def piece_mask(piece: Piece, last: bool) -> str:
    coord = coordinate_name(piece.dim)
    lower = f"({coord} >= {piece.start})" if piece.start > 0 else ""
    upper = f"({coord} < {piece.end})" if not last else ""
    return " & ".join(m for m in (lower, upper) if m)


def cat_value(n: fx.Node, pieces: list[Piece]) -> str:
    """The nested tl.where choosing each lane's piece."""
    mine = [p for p in pieces if p.cat is n]
    value = mine[-1].name
    for p in reversed(mine[:-1]):
        value = f"tl.where({coordinate_name(p.dim)} < {p.end}, {p.name}, {value})"
    return value


def is_gather(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target in GATHERS
