"""Regions inside a compiled function that change how its graph must be read: grad mode switched by the
function itself, autocast regions, torch.func transforms. Each case is checked against eager (float64
where values are compared); each failed before its fix (sweep of 2026-12-06)."""
import pytest
import torch

import fxopt


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    torch.set_grad_enabled(True)
    yield
    torch.set_grad_enabled(True)


def _run(fn, backend, *inputs):
    out = torch.compile(fn, backend=backend)(*inputs)
    return out, torch.is_grad_enabled()


@pytest.mark.parametrize("backend", ["fxopt", "precision"])
def test_graph_ending_grad_disabled_is_compiled_for_training(backend):
    """Compiling used to run the graph's own set_grad_enabled(False) for real: the graph was then traced
    as an inference graph (outputs without grad) and the caller's grad mode differed from eager's."""
    def f(x, w):
        h = (x * w).tanh()
        torch.set_grad_enabled(False)
        return h, h * 2

    b = fxopt.backend(precision="bf16") if backend == "precision" else "fxopt"
    x, w = torch.randn(6, 32, requires_grad=True), torch.randn(32, requires_grad=True)
    eager, eager_mode = f(x, w), torch.is_grad_enabled()
    torch.set_grad_enabled(True)
    out, mode = _run(f, b, x, w)
    assert out[0].requires_grad == eager[0].requires_grad is True
    assert out[1].requires_grad == eager[1].requires_grad is False
    assert mode == eager_mode is False


def test_attention_scores_under_no_grad_stay_unfused():
    """Scores made under no_grad give q and k no gradient in eager; the fused op placed at the output
    (outside the region) gave them one."""
    def f(q, k, v):
        with torch.no_grad():
            s = q @ k.transpose(-1, -2) / 4.0
        return torch.softmax(s, -1) @ v

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, 16, requires_grad=True) for _ in range(3))
    torch.compile(f, backend="fxopt")(q, k, v).sum().backward()
    assert q.grad is None and k.grad is None
    v_ref = v.detach().double().requires_grad_()
    f(q.detach().double(), k.detach().double(), v_ref).sum().backward()
    torch.testing.assert_close(v.grad.double(), v_ref.grad, rtol=1e-5, atol=1e-5)


def test_precision_leaves_no_grad_copy_detached():
    """precision= cancelled the fp32 copy made under no_grad against its bf16 source, so x and W1 got
    gradients eager gives as zeros."""
    def f(x, w1, w2):
        h = x @ w1
        with torch.no_grad():
            hf = h.to(torch.float32, copy=True)
        return (hf @ w2).sum() + h.sum() * 0

    torch.manual_seed(0)
    x, w1, w2 = torch.randn(6, 32), torch.randn(32, 32) * 0.2, torch.randn(32, 32) * 0.2
    x, w1, w2 = (t.requires_grad_() for t in (x, w1, w2))
    torch.compile(f, backend=fxopt.backend(precision="bf16"))(x, w1, w2).backward()
    assert x.grad.abs().sum() == 0 and w1.grad.abs().sum() == 0
    assert w2.grad.abs().sum() > 0


def test_precision_keeps_a_users_fp32_autocast_region():
    """A matmul inside autocast(enabled=False) is the user's fp32 choice: precision= cast it to bf16
    (error 0.066 against float64 where eager's is 3e-6)."""
    def f(x, w):
        with torch.autocast("cpu", enabled=False):
            a = x @ w
        return a.softmax(-1) * 3

    torch.manual_seed(0)
    x, w = torch.randn(6, 64), torch.randn(64, 64)
    ref = f(x.double(), w.double())
    out = torch.compile(f, backend=fxopt.backend(precision="bf16"))(x, w)
    assert (out.double() - ref).abs().max() < 1e-4


def test_precision_with_vmap_inside_runs_as_written():
    """A torch.func transform inside the graph crashed the precision pass (a cast made outside the
    transform's level); it is left as written now, with the reason in the report."""
    def f(x, w):
        return torch.func.vmap(lambda r: (r @ w).tanh())(x).sum(-1)

    torch.manual_seed(0)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    out = torch.compile(f, backend=fxopt.backend(precision="bf16"))(x, w)
    torch.testing.assert_close(out.double(), f(x.double(), w.double()), rtol=1e-5, atol=1e-5)
