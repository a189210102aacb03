"""Graphs with symbolic shapes are not compiled yet: they must still run correctly, as ATen."""
import torch

import fxopt


def f(x):
    return torch.sigmoid(x) * x + 1


def test_dynamic_true_runs_unfused_and_correct():
    g = torch.compile(f, backend="fxopt", dynamic=True)
    for n in (3, 7, 11):
        x = torch.randn(n, 5)
        torch.testing.assert_close(g(x), f(x))


def test_automatic_dynamic_after_a_second_shape_stays_correct():
    g = torch.compile(f, backend="fxopt")
    for n in (4, 6, 9):
        x = torch.randn(n, 3)
        torch.testing.assert_close(g(x), f(x))


def test_explain_says_why_a_symbolic_graph_was_not_fused():
    from fxopt.backend import compile_dynamo_graph
    rep = fxopt.Report()

    def backend(gm, inputs):
        return compile_dynamo_graph(gm, inputs, fxopt.Options(), rep)

    torch.compile(f, backend=backend, dynamic=True)(torch.randn(5, 5))
    assert rep.graphs and rep.graphs[0].notes and "symbolic" in rep.graphs[0].notes[0]
    assert not rep.kernels and rep.fallbacks
