"""Memory plans for graphs with symbolic sizes: one concrete plan per distinct size, made at the first
call with that size and cached (least recently used dropped past MAX_SIZES).

Why not one symbolic plan: placement compares buffer sizes (best fit, largest first), and which of
two expressions like 4*s0*s1 and 3072*s0 is larger depends on the sizes, so a single symbolic
placement would either be wrong for some sizes or have to assume the worst everywhere. Planning a
concrete size costs well under a millisecond per graph, the liveness intervals are computed once
(their byte counts are sympy expressions), and the concrete plans reuse the planner and its
independent validator unchanged.
"""
from __future__ import annotations

from collections import OrderedDict

import sympy

from ..analysis.liveness import Interval
from ..report import MemoryPlan
from .plan_report import plan_intervals

MAX_SIZES = 64


class SizePlans:
    """Plans of one graph's buffers keyed by the values of its size symbols (in `symbols` order)."""

    def __init__(self, intervals: list[Interval], symbols: list[sympy.Symbol],
                 pairs: list[tuple[str, str]] | None):
        self.intervals, self.symbols, self.pairs = intervals, symbols, pairs
        self.plans: OrderedDict[tuple[int, ...], MemoryPlan] = OrderedDict()
        self._bytes = [sympy.lambdify(symbols, sympy.sympify(iv.nbytes), "math") for iv in intervals]

    def plan(self, values: tuple[int, ...]) -> MemoryPlan:
        """The plan for these symbol values (cached)."""
        values = tuple(int(v) for v in values)
        got = self.plans.get(values)
        if got is not None:
            self.plans.move_to_end(values)
            return got
        concrete = [Interval(iv.name, int(nb(*values)), iv.first_use, iv.last_use, iv.is_output, iv.kernel,
                             iv.placeable)
                    for iv, nb in zip(self.intervals, self._bytes)]
        got = plan_intervals(concrete, self.pairs)
        got.sizes = {s.name: v for s, v in zip(self.symbols, values)}
        self.plans[values] = got
        if len(self.plans) > MAX_SIZES:
            self.plans.popitem(last=False)
        return got

    def offsets(self, **values: int) -> tuple[int, dict[str, int]]:
        """(arena bytes, buffer name -> byte offset) for the wrapper's call with these sizes (by name)."""
        p = self.plan(tuple(values[s.name] for s in self.symbols))
        return p.planned_bytes, {b.name: b.offset for b in p.buffers}

    def template(self) -> MemoryPlan:
        """The buffers with symbolic byte counts and no offsets: what the wrapper is generated from."""
        from ..report import BufferRecord
        from .plan_report import AppliedPlan
        bufs = [BufferRecord(iv.name, iv.nbytes, iv.first_use, iv.last_use, None) for iv in self.intervals]
        return AppliedPlan(naive_bytes=0, lower_bound_bytes=0, planned_bytes=0, buffers=bufs,
                           strategy="per size", inplace=list(self.pairs or []))

    def source(self) -> str:
        """A Python expression that rebuilds these plans, for the wrapper file (a dumped wrapper of a
        symbolic graph runs on its own: the compiled one is handed the live object instead)."""
        spec = [(iv.name, str(iv.nbytes), iv.first_use, iv.last_use, iv.is_output, iv.kernel, iv.placeable)
                for iv in self.intervals]
        return f"StandalonePlans({spec!r}, {[s.name for s in self.symbols]!r}, {self.pairs!r})"

    def in_wrapper(self, source: str) -> str:
        """The wrapper's text with these plans rebuilt as its PLANS, before its input specs."""
        return source.replace("\n\nINPUT_SPECS = ", f"\n\nfrom fxopt.memory.size_plans import StandalonePlans\n"
                              f"PLANS = {self.source()}\n\nINPUT_SPECS = ", 1)


class StandalonePlans:
    """SizePlans from the literal a wrapper file holds (SizePlans.source), built at the first call."""

    def __init__(self, spec: list, symbol_names: list[str], pairs):
        self.spec, self.symbol_names, self.pairs, self._plans = spec, symbol_names, pairs, None

    def offsets(self, **values: int) -> tuple[int, dict[str, int]]:
        if self._plans is None:
            symbols = [sympy.Symbol(n, integer=True, positive=True) for n in self.symbol_names]
            table = {s.name: s for s in symbols}
            intervals = [Interval(name, sympy.sympify(nbytes, locals=table), *rest)
                         for name, nbytes, *rest in self.spec]
            self._plans = SizePlans(intervals, symbols, self.pairs)
        return self._plans.offsets(**values)


def size_plans(gm, applied: bool, symbols: list[sympy.Symbol]) -> SizePlans:
    """The per-size planner of a symbolic graph (what memory_plan does for a static one)."""
    from ..analysis.liveness import buffer_intervals, inplace_pairs
    inner = [iv for iv in buffer_intervals(gm) if not iv.is_output and (iv.placeable or not applied)]
    return SizePlans(inner, symbols, inplace_pairs(gm, inner) if applied else None)
