"""Row sums that do not depend on each other, reduced together: one `tl.reduce` over a tuple.

LayerNorm's backward takes two sums of each row, `sum(g * w)` and `sum(g * w * xhat)`; neither reads
the other. Two `tl.sum`s are two trips through shared memory, each ending in a barrier, one after the
other; a tuple reduce makes one trip with both values (benchmarks/results/2026-12-02-h200-d.md).
Emitting them together needs the first sum moved down to the second: the ops between that use the
first sum move after both, which keeps the order topological (the second sum reads none of them, or it
would depend on the first).

Only on the GPU: in the Triton interpreter a @triton.jit combine function leaves triton.language
patched for the rest of the process (reduction_schedules.lane_reduce), so there each sum keeps its
own `tl.sum` (the reordering is the same, so the interpreter still checks it).
"""
from __future__ import annotations

import re

import torch.fx as fx

from ..analysis.reductions import reduction_info
from .reduction_schedules import lane_reduce


def joint_order(nodes: list[fx.Node], joinable) -> list:
    """`nodes` in an order that emits reducible-together sums at one place: each item is a node or a
    tuple of sum nodes (in graph order) to reduce together. `joinable(n)` says which sums may join
    (kind sum or mean, same accumulator dtype, not a column sum); groups are formed greedily, the
    first sum with every later joinable sum of the same dtype that reads none of the group."""
    order: list = list(nodes)
    while True:
        group = _next_group(order, joinable)
        if group is None:
            return order
        order = _gather(order, group)


def _next_group(order: list, joinable) -> tuple | None:
    keys = {n: joinable(n) for n in order if isinstance(n, fx.Node)}
    sums = [n for n, key in keys.items() if key]
    for i, first in enumerate(sums):
        group, read = [first], _readers([first])
        for later in sums[i + 1:]:
            if keys[later] == keys[first] and later not in read:
                group.append(later)
                read |= _readers([later])
        if len(group) > 1:
            return tuple(group)
    return None


def _readers(nodes) -> set:
    """Every node that reads one of `nodes`, transitively (through users)."""
    out, stack = set(), [u for n in nodes for u in n.users]
    while stack:
        n = stack.pop()
        if n not in out:
            out.add(n)
            stack += n.users
    return out


def _gather(order: list, group: tuple) -> list:
    """Defer the group's members, and whatever reads them, to the last member's place."""
    members, read, last = set(group), _readers(group), group[-1]
    out, deferred, done = [], [], False
    for item in order:
        if done:
            out.append(item)
        elif item is last:
            out.append(group)
            out += deferred
            done = True
        elif item in members:
            continue
        elif any(x in read for x in (item if isinstance(item, tuple) else (item,))):
            deferred.append(item)
        else:
            out.append(item)
    return out


def joint_reduce(names: list[str], blocks: list[str], target: str) -> tuple[list[str], list[str]]:
    """(lines, expressions): the [XBLOCK, 1] row sum of each of `blocks`, one reduce for all on the GPU
    (its results named after `names`); in the interpreter no lines and one tl.sum per block."""
    if target == "interpret":
        return [], [lane_reduce("sum", b, target) for b in blocks]
    joint = [f"{n}_j" for n in names]
    return ([f"{', '.join(joint)} = tl.reduce(({', '.join(blocks)}), 1, {combine_name(len(names))})"],
            [f"{j}[:, None]" for j in joint])


_CALLED = re.compile(r"\b_fx_sum(\d+)\b")


def combine_name(k: int) -> str:
    return f"_fx_sum{k}"


def with_combine_helpers(source: str, lines: list[str]) -> str:
    """Prepend the tuple-sum combine functions the kernel's lines call."""
    helpers = []
    for k in sorted({int(m) for line in lines for m in _CALLED.findall(line)}):
        a, b = [f"a{i}" for i in range(k)], [f"b{i}" for i in range(k)]
        helpers.append(f"@triton.jit\ndef {combine_name(k)}({', '.join(a + b)}):\n"
                       f"    return {', '.join(f'{x} + {y}' for x, y in zip(a, b))}\n")
    return "\n\n".join(helpers + [source]) if helpers else source


def sum_kind(n: fx.Node) -> str | None:
    info = reduction_info(n)
    return info.kind if info is not None and info.kind in ("sum", "mean") else None
