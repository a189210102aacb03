"""The memory planner: valid plans (checked by an independent validator), bounds, and the report."""
import sys
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fxopt
from fxopt.analysis.liveness import Interval
from fxopt.memory.planner import ALIGN, arena_bytes, lower_bound, plan

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))


def validate(placed) -> None:
    """Independent of the planner: any two buffers alive at a common node occupy disjoint bytes."""
    for i, a in enumerate(placed):
        assert a.offset % ALIGN == 0
        for b in placed[i + 1:]:
            live_together = a.interval.first_use <= b.interval.last_use and b.interval.first_use <= a.interval.last_use
            disjoint = a.offset + a.interval.nbytes <= b.offset or b.offset + b.interval.nbytes <= a.offset
            assert not live_together or disjoint, (a, b)


intervals = st.lists(st.builds(lambda n, s, d: Interval(f"b{n}", s, d[0], d[0] + d[1]),
                               st.integers(0, 10**6), st.integers(1, 1 << 20),
                               st.tuples(st.integers(0, 40), st.integers(0, 15))), max_size=40)


@settings(max_examples=150, deadline=None)
@given(intervals)
def test_random_lifetimes_give_valid_plans_between_the_bounds(ivs):
    placed, strategy = plan(ivs)
    validate(placed)
    assert len(placed) == len(ivs)
    naive = sum((iv.nbytes + ALIGN - 1) // ALIGN * ALIGN for iv in ivs)
    assert lower_bound(ivs) <= arena_bytes(placed) <= naive


def test_disjoint_lifetimes_share_memory():
    ivs = [Interval("a", 1000, 0, 1), Interval("b", 1000, 2, 3), Interval("c", 1000, 4, 5)]
    placed, _ = plan(ivs)
    assert arena_bytes(placed) == 1024 == lower_bound(ivs)


def test_gpt_graphs_report_a_plan_close_to_the_bound(tmp_path):
    from tiny_gpt import GPTConfig, make

    model, inputs = make(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=8), batch=2, seq=8)
    rep = fxopt.explain(model, *inputs)
    for g in rep.graphs:
        mp = g.memory_plan
        assert mp is not None and mp.buffers
        assert mp.lower_bound_bytes <= mp.planned_bytes <= mp.naive_bytes
        assert mp.ratio <= 1.25, (g.name, mp.ratio)
    assert "memory plan" in str(rep)
    rep.save(str(tmp_path))
    svg = (tmp_path / "memory.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<rect") == len(rep.memory_plan.buffers)
    assert "<svg" in (tmp_path / "report.html").read_text()


def test_graph_outputs_are_never_planned_into_the_arena():
    def f(x):
        y = torch.relu(x) * 2
        return (y @ y.t()).sum(), y

    rep = fxopt.explain(f, torch.randn(6, 6))
    names = {b.name for b in rep.memory_plan.buffers}
    returned = {a.name for a in next(n for n in rep.graph(after="cleanup_after_fuse").graph.nodes
                                     if n.op == "output").all_input_nodes}
    assert not names & returned
