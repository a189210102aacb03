"""fxopt.profile: every kernel and ATen call of every compiled graph timed, next to its roofline row."""
import re

import torch

import fxopt
from fxopt.analysis.roofline import Ceilings
from fxopt.codegen.wrapper import PROFILE_HEADER

M, K, N = 8, 16, 4


def matmul_then_break(x, w):
    y = torch.relu(x @ w) * 2 + 1
    torch._dynamo.graph_break()  # a second compiled graph
    return torch.softmax(y, -1).sum(0)


def test_profile_times_every_kernel_and_aten_call_of_every_graph():
    x, w = torch.randn(M, K), torch.randn(K, N)
    prof = fxopt.profile(matmul_then_break, x, w, warmup=1, repeat=2)
    graphs = prof.report.graphs
    assert len(graphs) == 2
    expected = {(f"{i}_{g.name}", r.name) for i, g in enumerate(graphs) for r in g.roofline}
    assert expected <= {(r.graph, r.name) for r in prof.rows}
    assert all(r.seconds > 0 and r.calls == 1 for r in prof.rows)
    mm = next(r for r in prof.rows if r.kind == "matmul")
    assert mm.flops == 2 * M * N * K
    assert mm.percent_of_roofline == 100 * mm.least_seconds / mm.seconds
    assert prof.step_seconds >= prof.attributed_seconds > 0
    assert prof.flops == sum(r.flops for r in prof.rows)
    assert prof.mfu == prof.flops / prof.step_seconds / Ceilings().matmul_flops_per_s
    text = str(prof)
    assert "CPU wall clock" in text and "not representative" in text and "MFU" in text
    assert "% of roofline" in text and mm.name in text


def test_profile_covers_forward_and_backward_without_touching_grads():
    model = torch.nn.Sequential(torch.nn.Linear(K, N), torch.nn.GELU())
    prof = fxopt.profile(model, torch.randn(M, K), warmup=1, repeat=1)
    assert {r.graph for r in prof.rows} == {"0_forward", "1_backward"}
    assert {"pointwise", "matmul"} <= {r.kind for r in prof.rows if r.graph == "0_forward"}
    assert all(p.grad is None for p in model.parameters())  # gradients returned, not accumulated


def test_profiling_wrapper_only_adds_regions_and_computes_the_same():
    x, w = torch.randn(M, K), torch.randn(K, N)
    f = lambda x, w: torch.relu(x @ w) * 2 + 1  # noqa: E731
    plain = fxopt.optimize(f, x, w)
    torch._dynamo.reset()
    timed = fxopt.optimize(f, x, w, profile=True)
    assert torch.equal(plain(x, w), timed(x, w))
    source = timed.report.wrapper_source
    assert "with region('mm'):" in source and re.search(r"with region\('fused_\w+'\):", source)
    assert _without_regions(source) == plain.report.wrapper_source
    namespace = {}  # standalone, region is torch.profiler.record_function
    exec(compile(source, "<wrapper>", "exec"), namespace)  # noqa: S102 - our own generated code
    assert torch.equal(namespace["call"]([x, w])[0], plain(x, w))


def _without_regions(source: str) -> str:
    """The profiling wrapper with its region lines taken out and their bodies dedented."""
    head, rest = source.replace(PROFILE_HEADER, "", 1).split("\ndef call(args):\n")
    body, tail = rest.split("\nINPUT_SPECS = ")
    lines = [line[4:] if line.startswith(" " * 8) else line for line in body.split("\n")
             if not re.fullmatch(r"    with region\('\w+'\):", line)]
    return head + "\ndef call(args):\n" + "\n".join(lines) + "\nINPUT_SPECS = " + tail


def test_profile_with_dynamic_shapes_compiles_symbolic_graphs():
    """dynamic=True reaches torch.compile: the profiled graphs have size symbols, and the rows are timed."""
    import fxopt

    def f(x):
        return torch.softmax(x * 2.0, dim=-1)

    prof = fxopt.profile(f, torch.randn(6, 40), warmup=1, repeat=2, dynamic=True)
    assert prof.report.graphs and all(g.symbols for g in prof.report.graphs)
    assert prof.rows and all(r.seconds >= 0 for r in prof.rows)
