"""The memory plan of a compiled graph as the report shows it: numbers, buffers, and an SVG picture."""
from __future__ import annotations

import html
from dataclasses import dataclass, field

import torch.fx as fx

from ..analysis.liveness import Interval, buffer_intervals, inplace_pairs
from ..report import BufferRecord, MemoryPlan
from .planner import align, arena_bytes, lower_bound, plan


@dataclass
class AppliedPlan(MemoryPlan):
    """The plan the wrapper follows (Options(memory_plan="apply")): kernel outputs only, plus the
    in-place pairs, (dying, born) buffers at the same offset, the born one written by the kernel where
    the dying one is last read. lower_bound_bytes counts each pair once."""
    inplace: list[tuple[str, str]] = field(default_factory=list)


def memory_plan(gm: fx.GraphModule, applied: bool = False) -> MemoryPlan:
    """Plan the intermediates of the final graph (graph outputs are allocated on their own).
    applied: plan only the buffers the wrapper allocates (fused kernels' outputs, and the results of
    ATen calls it makes through their out= overload: op_classes.OUT_VARIANTS), with in-place reuse, for
    Options(memory_plan="apply"); other ATen calls allocate their own results."""
    inner = [iv for iv in buffer_intervals(gm) if not iv.is_output and (iv.placeable or not applied)]
    return plan_intervals(inner, inplace_pairs(gm, inner) if applied else None)


def plan_intervals(inner: list[Interval], pairs: list[tuple[str, str]] | None) -> MemoryPlan:
    """Place concrete intervals: a MemoryPlan, or with `pairs` (in-place (dying, born) names) the
    AppliedPlan the wrapper follows."""
    if pairs is None:
        placed, strategy = plan(inner)
        buffers = [BufferRecord(p.interval.name, p.interval.nbytes, p.interval.first_use, p.interval.last_use,
                                p.offset) for p in placed]
        return MemoryPlan(naive_bytes=sum(align(iv.nbytes) for iv in inner), lower_bound_bytes=lower_bound(inner),
                          planned_bytes=arena_bytes(placed), buffers=buffers, strategy=strategy)
    root = {iv.name: iv.name for iv in inner}
    for dying, born in pairs:  # chains a -> b -> c share a's slot
        root[born] = root[dying]
    for name in root:
        while root[root[name]] != root[name]:
            root[name] = root[root[name]]
    slots: dict[str, Interval] = {}
    for iv in inner:  # one interval per slot: the chain's first birth to its last use
        r = root[iv.name]
        s = slots.setdefault(r, Interval(r, iv.nbytes, iv.first_use, iv.last_use, kernel=True, placeable=True))
        s.first_use, s.last_use = min(s.first_use, iv.first_use), max(s.last_use, iv.last_use)
    placed, strategy = plan(list(slots.values()))
    offset = {p.interval.name: p.offset for p in placed}
    buffers = [BufferRecord(iv.name, iv.nbytes, iv.first_use, iv.last_use, offset[root[iv.name]]) for iv in inner]
    return AppliedPlan(naive_bytes=sum(align(iv.nbytes) for iv in inner),
                       lower_bound_bytes=lower_bound(list(slots.values())), planned_bytes=arena_bytes(placed),
                       buffers=buffers, strategy=strategy, inplace=list(pairs))


def memory_svg(mp: MemoryPlan, width: int = 800, height: int = 400) -> str:
    """Buffers over time: x = node position, y = offset in the arena. No dependencies, no scripts."""
    if not mp.buffers:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="40"><text x="4" y="24">' \
               f'no intermediate buffers</text></svg>'
    t_end = max(b.last_use for b in mp.buffers) + 1
    top = max(mp.planned_bytes, 1)
    sx, sy = (width - 60) / t_end, (height - 40) / top
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="10">',
             f'<text x="4" y="12">arena {mp.planned_bytes / 2**20:.2f} MiB (lower bound '
             f'{mp.lower_bound_bytes / 2**20:.2f} MiB); x: node position, y: offset</text>']
    for i, b in enumerate(mp.buffers):
        x, y = 50 + b.first_use * sx, 20 + b.offset * sy
        w, h = max(1.0, (b.last_use - b.first_use + 1) * sx), max(1.0, align(b.nbytes) * sy)
        hue = (i * 67) % 360
        parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" '
                     f'fill="hsl({hue},60%,70%)" stroke="#333" stroke-width="0.5">'
                     f'<title>{html.escape(b.name)}: {b.nbytes} bytes, nodes {b.first_use}-{b.last_use}, '
                     f'offset {b.offset}</title></rect>')
    parts.append("</svg>")
    return "\n".join(parts)
