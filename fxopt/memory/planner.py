"""Place buffers at byte offsets of one arena so that buffers alive at the same time never overlap.

Several orders are tried with one placement rule (each buffer into the smallest gap that fits beside
the buffers already placed whose lifetimes overlap its own, else on top) and the smallest arena kept:
- by size: largest buffers first, ties broken by the longer lifetime;
- by area: largest bytes x lifetime first (a long-lived buffer pins its bytes for longer);
- by time: buffers in order of birth.
By size alone planned the Llama block's backward graph (d2048, 34 buffers) at 1.083x the lower bound;
the lifetime tie-break and by area both reach the bound there (tests/memory/test_planner.py).
The lower bound is the most bytes alive at any one node; no plan can use less. Graph outputs are not
placed (they are returned to the user and must not share memory fxopt reuses).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..analysis.liveness import Interval

ALIGN = 256


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class Placement:
    interval: Interval
    offset: int


def overlaps(a: Interval, b: Interval) -> bool:
    """Lifetimes share a node. A buffer dying at node t and one born at t overlap (the kernel at t
    reads one while writing the other). In-place pairs are merged into one interval before placement
    (plan_report.memory_plan with applied=True), so the planner never sees them as two."""
    return a.first_use <= b.last_use and b.first_use <= a.last_use


def _place(order: list[Interval]) -> list[Placement]:
    placed: list[Placement] = []
    for iv in order:
        busy = sorted((p.offset, p.offset + align(p.interval.nbytes)) for p in placed if overlaps(p.interval, iv))
        size, offset, best = align(iv.nbytes), 0, None
        for start, stop in busy:  # gaps between busy ranges, smallest that fits
            if start - offset >= size and (best is None or start - offset < best[1]):
                best = (offset, start - offset)
            offset = max(offset, stop)
        placed.append(Placement(iv, best[0] if best else offset))
    return placed


def lower_bound(intervals: list[Interval]) -> int:
    if not intervals:
        return 0
    last = max(iv.last_use for iv in intervals)
    return max(sum(align(iv.nbytes) for iv in intervals if iv.first_use <= t <= iv.last_use)
               for t in range(last + 1))


def arena_bytes(placed: list[Placement]) -> int:
    return max((p.offset + align(p.interval.nbytes) for p in placed), default=0)


def plan(intervals: list[Interval]) -> tuple[list[Placement], str]:
    """The smallest arena of the strategies, and the strategy's name."""
    def life(iv: Interval) -> int:
        return iv.last_use - iv.first_use + 1

    candidates = {
        "by size": _place(sorted(intervals, key=lambda iv: (-iv.nbytes, -life(iv), iv.first_use))),
        "by area": _place(sorted(intervals, key=lambda iv: (-iv.nbytes * life(iv), iv.first_use))),
        "by time": _place(sorted(intervals, key=lambda iv: (iv.first_use, -iv.nbytes))),
    }
    name = min(candidates, key=lambda k: arena_bytes(candidates[k]))
    return candidates[name], name
