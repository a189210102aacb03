"""validate_plan, the independent checker: every plan the planner makes passes it; broken plans do not."""
from hypothesis import given, settings
from hypothesis import strategies as st

from fxopt.analysis.liveness import Interval
from fxopt.memory.planner import ALIGN, arena_bytes, plan
from fxopt.memory.validate import ALIGNMENT, validate_plan
from fxopt.report import BufferRecord, MemoryPlan

intervals = st.lists(st.builds(lambda s, d: (s, d[0], d[0] + d[1]), st.integers(1, 1 << 20),
                               st.tuples(st.integers(0, 40), st.integers(0, 15))), max_size=40)


def _as_plan(ivs) -> MemoryPlan:
    placed, strategy = plan([Interval(f"b{i}", s, a, b) for i, (s, a, b) in enumerate(ivs)])
    buffers = [BufferRecord(p.interval.name, p.interval.nbytes, p.interval.first_use, p.interval.last_use, p.offset)
               for p in placed]
    return MemoryPlan(0, 0, arena_bytes(placed), buffers, strategy)


@settings(max_examples=200, deadline=None)
@given(intervals)
def test_planned_random_lifetimes_validate(ivs):
    assert validate_plan(_as_plan(ivs)) == []


@settings(max_examples=60, deadline=None)
@given(intervals.filter(lambda ivs: len(ivs) >= 2), st.data())
def test_moving_a_buffer_onto_a_live_neighbour_is_caught(ivs, data):
    mp = _as_plan(ivs)
    a, b = data.draw(st.sampled_from([(x, y) for x in mp.buffers for y in mp.buffers if x is not y]))
    together = a.first_use <= b.last_use and b.first_use <= a.last_use
    b.offset = a.offset  # both start at the same byte: they share it if their lifetimes meet
    mp.planned_bytes = max(mp.planned_bytes, b.offset + b.nbytes)
    named = [p for p in validate_plan(mp) if f"{a.name} (" in p and f"{b.name} (" in p and "share bytes" in p]
    assert bool(named) == together


def test_each_kind_of_broken_plan_is_named():
    assert ALIGNMENT == ALIGN
    good = [BufferRecord("a", 1000, 0, 3, 0), BufferRecord("b", 1000, 2, 5, 1024), BufferRecord("c", 1000, 4, 6, 0)]
    assert validate_plan(MemoryPlan(0, 0, 2048, good)) == []
    overlap = [BufferRecord("a", 1000, 0, 3, 0), BufferRecord("b", 1000, 3, 5, 768)]  # meet at node 3
    assert any("a" in p and "b" in p and "share bytes" in p for p in validate_plan(MemoryPlan(0, 0, 2048, overlap)))
    adjacent = [BufferRecord("a", 1000, 0, 3, 0), BufferRecord("b", 1000, 3, 5, 1024)]
    assert validate_plan(MemoryPlan(0, 0, 2048, adjacent)) == []
    (p,) = validate_plan(MemoryPlan(0, 0, 2048, [BufferRecord("a", 100, 0, 1, 100)]))
    assert "aligned" in p
    (p,) = validate_plan(MemoryPlan(0, 0, 1024, [BufferRecord("a", 2000, 0, 1, 0)]))
    assert "past the arena" in p
    (p,) = validate_plan(MemoryPlan(0, 0, 1024, [BufferRecord("a", 10, 3, 1, 0)]))
    assert "before it is born" in p


def test_in_place_pairs_are_the_only_exception():
    from fxopt.memory.plan_report import AppliedPlan

    a, b = BufferRecord("a", 1024, 0, 3, 0), BufferRecord("b", 1024, 3, 5, 0)  # b written where a dies
    assert validate_plan(AppliedPlan(0, 0, 1024, [a, b], inplace=[("a", "b")])) == []
    assert any("share bytes" in p for p in validate_plan(AppliedPlan(0, 0, 1024, [a, b])))  # undeclared
    late = BufferRecord("b", 1024, 2, 5, 0)  # born while a is still read later: not in place
    assert any("in-place pair a -> b" in p for p in validate_plan(AppliedPlan(0, 0, 1024, [a, late],
                                                                                inplace=[("a", "b")])))
    moved = BufferRecord("b", 1024, 3, 5, 256)
    assert any("in-place pair a -> b" in p for p in validate_plan(AppliedPlan(0, 0, 2048, [a, moved],
                                                                                 inplace=[("a", "b")])))
