"""The cross-entropy gradient written over the logits (passes/grad_over_logits.py): an LM head's
logits, made in the graph and saved only for the loss's backward, take their own gradient, so the loss
step never holds two [N, V] buffers. Checked against float64 eager, with the kernels' `out=` argument
spied on to see where the gradient went; the cases where the logits must survive (returned, a leaf,
read again by `retain_graph=True`) keep a new gradient tensor. CPU: the kernels run in the Triton
interpreter (conftest sets TRITON_INTERPRET=1)."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

import fxopt
import fxopt.losses.cross_entropy_kernels as ce_kernels
from tests import helpers

# The LM head and its loss fuse into one chunked op (passes/linear_cross_entropy.py, its own tests), which
# has no [N, V] logits to write over; these tests keep the head a matmul and the loss fxopt::cross_entropy.
UNFUSED_HEAD = ("fuse_linear_cross_entropy",)


def compile_fxopt(fn, **options):
    return helpers.compile_fxopt(fn, skip_passes=UNFUSED_HEAD, **options)

N, D, V = 12, 8, 70  # 70: a ragged last block of the backward kernel's row loop


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def writes(monkeypatch):
    """Every cross_entropy_grad call a backward makes: (whether out= was given, whether it is the logits'
    memory). (Not the compile's stand-in calls on CUDA, which only ask for the kernel's compile.)"""
    seen = []
    real = ce_kernels.cross_entropy_grad

    def spy(logits, *args, out=None, **kwargs):
        if torch._C._current_graph_task_id() != -1:
            seen.append((out is not None, out is not None and out.data_ptr() == logits.data_ptr()))
        return real(logits, *args, out=out, **kwargs)

    monkeypatch.setattr(ce_kernels, "cross_entropy_grad", spy)
    return seen


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(N, D, generator=g)).requires_grad_()
    w = (torch.randn(V, D, generator=g) * 0.5).requires_grad_()
    return h, w, torch.randint(0, V, (N,), generator=g)


def lm_loss(h, w, t):
    return F.cross_entropy(h @ w.t(), t)


def float64_grads(fn, h, w, t, backwards=1):
    h64, w64 = (x.detach().double().requires_grad_() for x in (h, w))
    loss = fn(h64, w64, t)
    loss = loss[-1] if isinstance(loss, tuple) else loss
    for i in range(backwards):
        loss.backward(retain_graph=i < backwards - 1)
    return h64.grad, w64.grad


def assert_grads(h, w, ref):
    torch.testing.assert_close(h.grad, ref[0].float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad, ref[1].float(), rtol=1e-4, atol=1e-5)


def test_lm_head_gradient_is_written_over_its_logits(writes):
    h, w, t = inputs()
    compile_fxopt(lm_loss)(h, w, t).backward()
    assert writes == [(True, True)]  # the backward kernel wrote into the logits' own memory
    assert_grads(h, w, float64_grads(lm_loss, h, w, t))


def test_the_pass_is_in_the_report():
    h, w, t = inputs()
    rep = fxopt.explain(lm_loss, h, w, t, skip_passes=UNFUSED_HEAD)
    stats = [r.stats for r in rep.passes if r.name == "grad_over_logits" and r.graph == "backward"]
    assert stats == [{"gradients_over_logits": 1}]
    backward = next(g for g in rep.graphs if g.name == "backward")
    assert "cross_entropy_backward_over_logits" in backward.wrapper_source


def compile_backward_with_forward(monkeypatch):
    """As on CUDA: the backward graph compiles right after the forward, before any backward call says
    whether it retains the graph (elsewhere torch compiles it at the first backward call and, for a
    retain_graph=True one, hands over no donated buffers at all)."""
    monkeypatch.setattr(sys.modules["fxopt.backend"], "backward_with_forward", lambda *args, **kwargs: True)


@pytest.mark.parametrize("with_forward", [False, True], ids=["lazy_backward", "backward_with_forward"])
def test_retain_graph_gets_a_new_gradient_then_overwrites_on_the_last_backward(writes, monkeypatch, with_forward):
    if with_forward:
        compile_backward_with_forward(monkeypatch)
    h, w, t = inputs()
    loss = compile_fxopt(lm_loss)(h, w, t)
    loss.backward(retain_graph=True)  # the saved logits are read again below: not consumed
    loss.backward()
    assert writes == [(False, False), (with_forward, with_forward)]
    assert_grads(h, w, float64_grads(lm_loss, h, w, t, backwards=2))


def returns_logits(h, w, t):
    logits = h @ w.t()
    return logits, F.cross_entropy(logits, t)


def test_returned_logits_are_left_as_they_were(writes):
    h, w, t = inputs()
    logits, loss = compile_fxopt(returns_logits)(h, w, t)
    before = logits.detach().clone()
    loss.backward()
    assert writes == [(False, False)]  # aot_autograd does not donate a returned value
    torch.testing.assert_close(logits.detach(), before, rtol=0, atol=0)
    assert_grads(h, w, float64_grads(returns_logits, h, w, t))


def test_leaf_logits_keep_their_values(writes):
    h, w, t = inputs()
    logits = (h @ w.t()).detach().requires_grad_()
    before = logits.detach().clone()
    loss = compile_fxopt(lambda x, y: F.cross_entropy(x, y))(logits, t)
    loss.backward()
    assert writes == [(False, False)]
    torch.testing.assert_close(logits.detach(), before, rtol=0, atol=0)
    x64 = before.double().requires_grad_()
    F.cross_entropy(x64, t).backward()
    torch.testing.assert_close(logits.grad, x64.grad.float(), rtol=1e-4, atol=1e-6)


def logits_read_again(h, w, t):
    logits = h @ w.t()
    return F.cross_entropy(logits, t) + 0.1 * logits.square().mean()


def test_logits_another_backward_node_reads_stay_right(writes):
    h, w, t = inputs()
    compile_fxopt(logits_read_again)(h, w, t).backward()
    assert_grads(h, w, float64_grads(logits_read_again, h, w, t))


def heads_around_the_loss(h, w, p, t):
    lg = h @ w.t()
    a = (lg @ p[:, :1]).tanh().mean()  # a value head before the loss ...
    c = F.cross_entropy(lg, t)
    b = (lg @ p[:, 1:]).relu().mean()  # ... and an auxiliary head after it
    return a + c + b


def test_logits_read_after_the_loss_through_an_earlier_view_are_not_overwritten(writes):
    """In the backward graph CSE leaves one permute(logits) before the loss's backward for both heads'
    matmuls after it: the logits' last reader is the view's reader (dp was wrong by its own size)."""
    h, w, _ = inputs()
    p = (torch.randn(V, 5, generator=torch.Generator().manual_seed(3)) * 0.1).requires_grad_()
    t = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(4))
    compile_fxopt(heads_around_the_loss)(h, w, p, t).backward()
    assert writes == [(False, False)]
    h64, w64, p64 = (x.detach().double().requires_grad_() for x in (h, w, p))
    heads_around_the_loss(h64, w64, p64, t).backward()
    for got, want in ((h.grad, h64.grad), (w.grad, w64.grad), (p.grad, p64.grad)):
        torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-5)


def attention_as_logits(q, k, v, t):
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.cross_entropy(y.reshape(-1, y.shape[-1]), t)


def test_logits_viewing_another_saved_tensor_are_not_overwritten(writes):
    """The loss's logits are a view of the attention output, which the attention backward reads after
    the loss's backward: torch donates both (it checks saved tensors against the forward's inputs and
    outputs, not against each other), and writing over one gave wrong q, k, v gradients."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g).requires_grad_() for _ in range(3))
    t = torch.randint(0, 16, (16,), generator=g)
    got = torch.autograd.grad(compile_fxopt(attention_as_logits)(q, k, v, t), (q, k, v))
    assert writes == [(False, False)]
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = torch.autograd.grad(attention_as_logits(q64, k64, v64, t), (q64, k64, v64))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b.float(), rtol=1e-4, atol=1e-5)


def test_create_graph_gets_a_new_gradient(writes):
    h, w, t = inputs()
    (gh,) = torch.autograd.grad(compile_fxopt(lm_loss)(h, w, t), h, create_graph=True)
    assert writes == [(False, False)]
    h64, w64 = (x.detach().double() for x in (h, w))
    h64.requires_grad_()
    (ref,) = torch.autograd.grad(lm_loss(h64, w64, t), h64)
    torch.testing.assert_close(gh, ref.float(), rtol=1e-4, atol=1e-6)


def test_batched_gradients_get_a_new_gradient(writes):
    """autograd.grad(is_grads_batched=True) hands the loss's backward a batched gradient: the graph runs
    as ATen ops, and the op's own batching rule must serve it (the kernels cannot read batched tensors)."""
    h, w, t = inputs()
    go = torch.tensor([1.0, 2.0, -1.0])
    (got,) = torch.autograd.grad(compile_fxopt(lm_loss)(h, w, t), h, go, is_grads_batched=True)
    (want,) = torch.autograd.grad(lm_loss(h, w, t), h, go, is_grads_batched=True)
    assert all(not over for over, _ in writes)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_verify_and_applied_plan_agree_with_eager(writes):
    h, w, t = inputs()
    compile_fxopt(lm_loss, verify=True, memory_plan="apply")(h, w, t).backward()
    assert writes[-1] == (True, True)  # verify's own runs (outside a backward) wrote nothing over their inputs
    assert_grads(h, w, float64_grads(lm_loss, h, w, t))


def test_backward_compiled_with_its_forward_accepts_retain_graph(monkeypatch):
    """On CUDA fxopt compiles a training step's backward right after its forward; torch then refused
    every retain_graph=True backward of a graph with donated buffers (its check is for compilers that
    consume them unconditionally; aot.donated_backward_inputs empties the list)."""
    compile_backward_with_forward(monkeypatch)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    x = torch.randn(4, 8)
    loss = compile_fxopt(lambda v: net(v).sigmoid().sum())(x)
    loss.backward(retain_graph=True)
    loss.backward()
    got = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    ref = net(x).sigmoid().sum()
    ref.backward(retain_graph=True)
    ref.backward()
    for a, b in zip(got, [p.grad for p in net.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_lm_head_step_overwrites_its_logits_and_retains_a_graph(writes):
    """On CUDA the backward compiles with the forward (no monkeypatching): a bf16 LM head's gradient goes
    over its logits, gradients match float64 within bf16 error, and retain_graph=True works."""
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(256, 64, generator=g) * 0.5).to("cuda", torch.bfloat16).requires_grad_()
    w = (torch.randn(5000, 64, generator=g) * 0.5).to("cuda", torch.bfloat16).requires_grad_()
    t = torch.randint(0, 5000, (256,), generator=g).cuda()
    step = compile_fxopt(lm_loss)
    step(h, w, t).backward()
    assert writes == [(True, True)]
    ref = float64_grads(lm_loss, h, w, t)
    for got, want in zip((h.grad, w.grad), ref):
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-3)
    h.grad = w.grad = None
    loss = step(h, w, t)
    loss.backward(retain_graph=True)
    loss.backward()
    assert writes[1:] == [(False, False), (True, True)]
    for got, want in zip((h.grad, w.grad), ref):
        torch.testing.assert_close(got.double(), 2 * want, rtol=2e-2, atol=4e-3)
