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


def test_sizes_equal_only_through_a_guard_stay_aten_with_the_reason():
    """a.view(-1) - b.view(-1) of [2, 6, C] and [3, 4, C] under dynamic=True: the sizes s0*s1*C and s2*s3*C
    are equal by a guard only, which the kernels' indexing (by the sizes' expressions) cannot use; codegen
    crashed there (and, under automatic dynamic shapes, in label-smoothed cross-entropy of
    logits.view(-1, V) against targets.view(-1))."""
    import torch.nn.functional as F

    def mse(a, b):
        return F.mse_loss(a.view(-1), b.view(-1))

    rep, calls = fxopt.Report(), []
    g = torch.compile(mse, backend=_counting(rep, calls), dynamic=True)
    for a_shape, b_shape in (((2, 6), (3, 4)), ((4, 6), (3, 8)), ((2, 10), (4, 5))):
        a, b = torch.randn(*a_shape, 11, requires_grad=True), torch.randn(*b_shape, 11)
        got = g(a, b)
        a64 = a.detach().double().requires_grad_()
        want = mse(a64, b.double())
        torch.testing.assert_close(got.double(), want)
        torch.testing.assert_close(torch.autograd.grad(got, a)[0].double(), torch.autograd.grad(want, a64)[0])
    assert any("only through a guard" in reason for _, reason in rep.fallbacks), rep.fallbacks
