"""Collectives in compiled graphs (what DDP and FSDP2 put there), checked in one process with torch's
"fake" process group: they stay ATen calls in their order with the reason shown, the input of an
asynchronous collective stays alive (and unplanned over) until its wait, and CUDA graphs capture them
only on NCCL (waits only with their collective in the same graph)."""
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

import fxopt
from fxopt.analysis.liveness import buffer_intervals
from fxopt import cudagraph_checks
from fxopt.cudagraphs import refusal_reason
from fxopt.memory.validate import validate_plan


@pytest.fixture
def fake_group():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _reduce_then_gather(x):
    y = torch.sigmoid(x) * 2
    gathered = funcol.all_gather_tensor(y + 1, 0, dist.group.WORLD)  # issued here, waited at its first use
    unrelated = torch.sin(x) * 3 + y  # runs while the gather is in flight
    reduced = funcol.all_reduce(unrelated, "sum", dist.group.WORLD)
    return gathered * 2, reduced + 1


def test_collectives_stay_aten_calls_in_order_with_the_reason(fake_group):
    rep = fxopt.explain(_reduce_then_gather, torch.randn(4, 8))
    calls = [line.split("_c10d_functional.")[1].split(".")[0] for line in rep.graphs[0].wrapper_source.splitlines()
             if "_c10d_functional." in line and "wait_tensor" not in line]
    assert calls == ["all_gather_into_tensor", "all_reduce"]  # the program's order
    reasons = [r for n, r in rep.fallbacks if "all_" in n or "wait" in n]
    assert reasons and all("collective communication" in r and "keep their order" in r for r in reasons)


def _wrapper_lines(rep) -> list[str]:
    src = rep.graphs[0].wrapper_source
    body = src[src.index("def call"):]
    return [ln.strip() for ln in body[:body.index("return")].splitlines() if ln.strip()]


def test_waits_move_to_the_end_when_their_values_only_reach_outputs(fake_group):
    """Both collectives are issued before either wait; the waits, and the kernels that only turn their
    results into outputs, run last (the communication overlaps whatever runs in between)."""
    lines = _wrapper_lines(fxopt.explain(_reduce_then_gather, torch.randn(4, 8)))
    at = lambda text: next(i for i, ln in enumerate(lines) if text in ln)  # noqa: E731
    issued = [at("all_gather_into_tensor.default("), at("all_reduce.default(")]
    waits = [i for i, ln in enumerate(lines) if "wait_tensor.default(" in ln]
    assert len(waits) == 2 and max(issued) < min(waits), lines
    assert all("wait_tensor" in ln or ln.startswith(("del ", "fused")) for ln in lines[min(waits):]), \
        lines[min(waits):]  # only the waits and the outputs' kernels after them


def _reduce_then_write(x, buf):
    reduced = funcol.all_reduce(x * 2, "sum", dist.group.WORLD)
    buf.add_(1)  # an in-place write: a wait never moves past it
    return reduced + 1


def _sunk(fn, *inputs) -> list[str]:
    from fxopt.options import Environment, Options
    from fxopt.pass_manager import PassContext
    from fxopt.passes.collective_waits import SinkCollectiveWaits
    gm = make_fx(fn)(*inputs)
    SinkCollectiveWaits()(gm, PassContext(Options(), Environment.read()))
    return [str(n.target) for n in gm.graph.nodes]


def test_a_wait_never_moves_past_an_in_place_write(fake_group):
    order = _sunk(_reduce_then_write, torch.randn(4, 8), torch.zeros(4, 8))
    wait = next(i for i, t in enumerate(order) if "wait_tensor" in t)
    write = next(i for i, t in enumerate(order) if "add_" in t)
    assert wait < write, order


def test_async_collective_input_lives_until_its_wait(fake_group):
    """Traced graphs wait right after issuing; a graph that overlaps communication (the wait moved to
    the result's first use, as a scheduler would) has the gather in flight while other ops run: its
    input must not die at the gather."""
    gm = make_fx(_reduce_then_gather)(torch.randn(4, 8))
    gather = next(n for n in gm.graph.nodes if "all_gather" in str(n.target))
    wait = next(u for u in gather.users if "wait_tensor" in str(u.target))
    min(wait.users, key=lambda u: list(gm.graph.nodes).index(u)).prepend(wait)  # wait at first use
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    assert position[wait] > position[gather] + 1  # something runs between issue and wait
    intervals = {iv.name: iv for iv in buffer_intervals(gm)}
    assert intervals[gather.args[0].name].last_use >= position[wait]


def test_applied_plan_never_reuses_a_gather_input_before_its_wait(fake_group):
    x = torch.randn(4, 8)
    rep = fxopt.explain(_reduce_then_gather, x, memory_plan="apply")
    plan = rep.graphs[0].memory_plan
    validate_plan(plan)
    out = torch.compile(_reduce_then_gather, backend=fxopt.backend(memory_plan="apply"), dynamic=False)(x)
    for got, want in zip(out, _reduce_then_gather(x)):
        torch.testing.assert_close(got, want)


def test_cuda_graphs_refuse_collectives_on_a_group_that_is_not_nccl(fake_group):
    gm = make_fx(_reduce_then_gather)(torch.randn(4, 8))
    reason = refusal_reason(gm, "cuda")
    assert reason is not None and "collective" in reason and "FakeProcessGroup" in reason and "NCCL only" in reason


def _on_cuda(gm):
    """The graph as if traced on a GPU (its inputs fake CUDA tensors), which a CPU-only machine allows."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        for n in gm.graph.find_nodes(op="placeholder"):
            n.meta["val"] = torch.empty(n.meta["val"].shape, device="cuda")
    return gm


def test_cuda_graphs_capture_functional_collectives_on_nccl_and_their_waits(fake_group, monkeypatch):
    gm = _on_cuda(make_fx(_reduce_then_gather)(torch.randn(4, 8)))
    seen = []

    def backend_of(group):
        seen.append(group)
        return "ProcessGroupNCCL"
    monkeypatch.setattr(cudagraph_checks, "process_group_backend", backend_of)
    assert refusal_reason(gm, "cuda") is None
    assert len(seen) == 2  # the gather and the reduce, each by its group; the waits by their collective


def test_cuda_graphs_refuse_a_wait_on_communication_issued_outside_the_graph(fake_group, monkeypatch):
    monkeypatch.setattr(cudagraph_checks, "process_group_backend", lambda group: "ProcessGroupNCCL")
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (x,)))
    reason = refusal_reason(torch.fx.GraphModule(torch.nn.Module(), graph), "cuda")
    assert reason is not None and "outside this graph" in reason


def test_skipping_the_pass_keeps_each_wait_where_the_graph_put_it(fake_group):
    lines = _wrapper_lines(fxopt.explain(_reduce_then_gather, torch.randn(4, 8),
                                         skip_passes=("sink_collective_waits",)))
    ops = [ln.split("_c10d_functional.")[1].split(".")[0] for ln in lines if "_c10d_functional." in ln]
    assert ops == ["all_gather_into_tensor", "wait_tensor", "all_reduce", "wait_tensor"]


def _reduce_then_draw(x):
    reduced = funcol.all_reduce(x, "sum", dist.group.WORLD)
    noise = torch.rand_like(reduced)  # random draws keep their order: the generator's sequence
    return reduced + noise, torch.rand(3)


def test_random_ops_are_never_moved_with_a_waits_tail(fake_group):
    order = _sunk(_reduce_then_draw, torch.randn(4, 8))
    draws = [t for t in order if "rand" in t]
    assert draws == ["aten.rand_like.default", "aten.rand.default"], order
