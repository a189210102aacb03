"""The memory plan of a compiled graph as the report shows it: numbers, buffers, and an SVG picture."""
from __future__ import annotations

import html

import torch.fx as fx

from ..analysis.liveness import buffer_intervals
from ..report import BufferRecord, MemoryPlan
from .planner import align, arena_bytes, lower_bound, plan


def memory_plan(gm: fx.GraphModule) -> MemoryPlan:
    """Plan the intermediates of the final graph (graph outputs are allocated on their own)."""
    inner = [iv for iv in buffer_intervals(gm) if not iv.is_output]
    placed, strategy = plan(inner)
    buffers = [BufferRecord(p.interval.name, p.interval.nbytes, p.interval.first_use, p.interval.last_use,
                            p.offset) for p in placed]
    return MemoryPlan(naive_bytes=sum(align(iv.nbytes) for iv in inner), lower_bound_bytes=lower_bound(inner),
                      planned_bytes=arena_bytes(placed), buffers=buffers, strategy=strategy)


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
