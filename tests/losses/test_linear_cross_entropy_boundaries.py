"""What the LM head + loss fusion must not move its reads across (passes/cross_entropy.check_moved_reads,
used by both loss passes): the fused op runs where the loss was, so an in-place write to the hidden
state, weight or logits after the head (or log_softmax, up-cast) read them, or a no_grad/inference_mode
region between the inputs and the loss, keeps head and loss apart. Against float64 eager; CPU kernels in
the Triton interpreter."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxopt
from tests.helpers import compile_fxopt
from tests.losses.test_linear_cross_entropy import V, assert_compiled_step_matches_float64, inputs


def hidden_written_after_the_head(h, w, t):
    x = torch.tanh(h)
    logits = x @ w.t()
    x.add_(1.0)  # the residual stream updated in place after the head read it
    return F.cross_entropy(logits, t)


def weight_written_after_the_head(h, w, t):
    w = w.clone()
    logits = h @ w.t()
    w.zero_()
    return F.cross_entropy(logits, t)


def logits_written_after_log_softmax(h, w, t):
    y = h @ w.t() * 2
    ls = F.log_softmax(y, -1)
    y.add_(100.0)  # (plain loss pass: log_softmax folded into the op at the loss would read this)
    return F.nll_loss(ls, t)


def hidden_relu_in_place_positionally(h, w, t):
    x = h * 1.0
    logits = x @ w.t()
    F.relu(x, True)  # inplace=True by position: a write too
    return F.cross_entropy(logits, t)


def hidden_written_through_an_unlisted_alias(h, w, t):
    x = h * 1.0
    alias = x.reshape_as(x)  # an alias by an op the mutation analysis does not name as a view
    logits = x @ w.t()
    alias.mul_(0.5)
    return F.cross_entropy(logits, t)


@pytest.mark.parametrize("fn", [hidden_written_after_the_head, weight_written_after_the_head,
                                logits_written_after_log_softmax, hidden_relu_in_place_positionally,
                                hidden_written_through_an_unlisted_alias])
def test_a_write_between_the_head_and_its_loss_keeps_them_apart(fn):
    h, w, t = inputs()
    with torch.no_grad():
        got = compile_fxopt(fn)(h.clone(), w.clone(), t)
        want = fn(h.double(), w.double(), t)
        rep = fxopt.explain(fn, h.clone(), w.clone(), t)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert any("in place" in why for _, why in rep.fallbacks), rep.fallbacks


def test_a_write_through_an_aliasing_input_keeps_them_apart():
    """Two inputs sharing memory (h and h[:]): a write through one after the head read the other; the graph
    cannot see the aliasing, so any write to an input in between keeps head and loss apart."""
    def fn(h, h_alias, w, t):
        logits = h @ w.t()
        h_alias.mul_(0.5)
        return F.cross_entropy(logits, t)

    h, w, t = inputs()
    with torch.no_grad():
        x = h.clone()
        got = compile_fxopt(fn)(x, x[:], w, t)
        x64 = h.double()
        want = fn(x64, x64[:], w.double(), t)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_grad_mode_is_read_from_no_grad_and_inference_mode_regions():
    """analysis/torch_ops.grad_enabled_at follows dynamo's `_set_grad_enabled` and inference-mode nodes."""
    from fxopt.analysis.torch_ops import grad_enabled_at
    seen = {}

    def backend(gm, example_inputs):
        seen.update({n.name: grad_enabled_at(n) for n in gm.graph.nodes})
        return gm

    def fn(w):
        a = w * 2
        with torch.inference_mode():
            b = a.t()
        with torch.no_grad():
            c = a + 1
        return a, b, c, a - 1

    torch.compile(fn, backend=backend)(torch.randn(3, 3))
    assert [seen[n] for n in ("a", "b", "c", "sub")] == [True, False, False, True], seen


def view_under_no_grad(h, w, t):
    logits = h @ w.t()
    with torch.no_grad():
        flat = logits.view(-1, V)
    return F.cross_entropy(flat, t) + (h ** 2).mean()


def weight_transposed_under_no_grad(h, w, t):
    with torch.no_grad():
        wt = w.t()
    return F.cross_entropy(h @ wt, t) + (h ** 2).mean()


def head_under_no_grad_loss_outside(h, w, t):
    with torch.no_grad():
        logits = h @ w.t()
    return F.cross_entropy(logits, t) + (h ** 2).mean()


def log_softmax_under_no_grad(h, w, t):
    y = h @ w.t() * 2
    with torch.no_grad():
        ls = F.log_softmax(y, -1)
    return F.nll_loss(ls, t) + (h ** 2).mean()


@pytest.mark.parametrize("fn", [view_under_no_grad, weight_transposed_under_no_grad,
                                head_under_no_grad_loss_outside, log_softmax_under_no_grad])
def test_no_grad_between_the_inputs_and_the_loss_lets_no_gradient_through(fn):
    """Eager's loss gives hidden and weight no gradient through a node made under no_grad; the fused
    ops once differentiated straight through (or, for a head made under no_grad, failed to compile)."""
    assert_compiled_step_matches_float64(fn, *inputs())
