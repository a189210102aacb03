"""Graphs with symbolic shapes are compiled (fused kernels over symbolic sizes) and stay correct,
whether dynamo made them symbolic up front (dynamic=True) or after a second shape (automatic dynamic)."""
import torch

import fxopt
from fxopt.backend import compile_dynamo_graph


def f(x):
    return torch.sigmoid(x) * x + 1


def _counting(rep, calls):
    def backend(gm, inputs):
        calls.append(gm)
        return compile_dynamo_graph(gm, inputs, fxopt.Options(), rep)
    return backend


def test_dynamic_true_is_fused_and_correct():
    rep, calls = fxopt.Report(), []
    g = torch.compile(f, backend=_counting(rep, calls), dynamic=True)
    for n in (3, 7, 11):
        x = torch.randn(n, 5)
        torch.testing.assert_close(g(x), f(x))
    assert len(calls) == 1 and len(rep.kernels) == 1 and not rep.fallbacks
    assert rep.graphs[0].symbols  # compiled for symbolic sizes, not specialised


def test_automatic_dynamic_after_a_second_shape_compiles_symbolic_once():
    rep, calls = fxopt.Report(), []
    g = torch.compile(f, backend=_counting(rep, calls))
    for n in (4, 6, 9, 13):
        x = torch.randn(n, 3)
        torch.testing.assert_close(g(x), f(x))
    assert len(calls) == 2  # static for the first shape, symbolic from the second on
    static, dynamic = rep.graphs
    assert not static.symbols and list(dynamic.symbols.values()) == [6]  # example value: the second size
    assert dynamic.kernels


def test_explain_shows_the_symbols_and_guards_of_a_symbolic_graph():
    rep, calls = fxopt.Report(), []
    torch.compile(f, backend=_counting(rep, calls), dynamic=True)(torch.randn(5, 4))
    g = rep.graphs[0]
    assert set(g.symbols.values()) == {5, 4} and all(name.startswith("s") for name in g.symbols)
    assert all(f"2 <= {name}" in g.guards for name in g.symbols)
    assert any("symbolic sizes" in note for note in g.notes)
    assert rep.kernels and not rep.fallbacks
