"""An independent check of a memory plan: written from the definition, sharing no code with planner.py.

A plan is valid when every buffer starts at an aligned offset, ends inside the arena, and any two
buffers alive at a common node (lifetimes are inclusive node positions) occupy disjoint bytes. The one
exception is an in-place pair (the plan's `inplace`, (dying, born) names): the dying buffer's last use
is the node that writes the born one, and both have the same offset and size.
"""
from __future__ import annotations

from ..report import MemoryPlan

ALIGNMENT = 256  # bytes; the planner's ALIGN, restated here so a change there is caught here


def validate_plan(plan: MemoryPlan, alignment: int = ALIGNMENT) -> list[str]:
    """Every problem found, as a sentence naming the buffers; an empty list means the plan is valid."""
    problems: list[str] = []
    bufs = plan.buffers
    seen: set[str] = set()
    for b in bufs:
        if b.name in seen:
            problems.append(f"buffer {b.name} is planned twice")
        seen.add(b.name)
        if b.nbytes < 0 or b.offset < 0:
            problems.append(f"buffer {b.name} has a negative size or offset ({b.nbytes} bytes at {b.offset})")
        if b.first_use > b.last_use:
            problems.append(f"buffer {b.name} dies (node {b.last_use}) before it is born (node {b.first_use})")
        if b.offset % alignment:
            problems.append(f"buffer {b.name} at offset {b.offset} is not {alignment}-byte aligned")
        if b.offset + b.nbytes > plan.planned_bytes:
            problems.append(f"buffer {b.name} ends at byte {b.offset + b.nbytes}, past the arena's end "
                            f"({plan.planned_bytes} bytes)")
    inplace = {tuple(p) for p in getattr(plan, "inplace", ()) or ()}
    by_name = {b.name: b for b in bufs}
    for dying, born in inplace:
        d, b = by_name.get(dying), by_name.get(born)
        if d is None or b is None:
            problems.append(f"in-place pair ({dying}, {born}) names a buffer the plan does not hold")
        elif d.last_use != b.first_use or d.offset != b.offset or d.nbytes != b.nbytes:
            problems.append(f"in-place pair {dying} -> {born} is not one: {dying} must die (node {d.last_use}) "
                            f"where {born} is born (node {b.first_use}), at the same offset ({d.offset} vs "
                            f"{b.offset}) and size ({d.nbytes} vs {b.nbytes})")
    # sweep in order of birth: only buffers born no later than b's death can share a node with it
    order = sorted(bufs, key=lambda b: b.first_use)
    for i, a in enumerate(order):
        for b in order[i + 1:]:
            if b.first_use > a.last_use:
                break
            if (a.name, b.name) in inplace or (b.name, a.name) in inplace:
                continue  # checked above
            if a.nbytes and b.nbytes and a.offset < b.offset + b.nbytes and b.offset < a.offset + a.nbytes:
                problems.append(f"buffers {a.name} (nodes {a.first_use}-{a.last_use}, bytes {a.offset}-"
                                f"{a.offset + a.nbytes}) and {b.name} (nodes {b.first_use}-{b.last_use}, bytes "
                                f"{b.offset}-{b.offset + b.nbytes}) are alive together and share bytes")
    return problems
