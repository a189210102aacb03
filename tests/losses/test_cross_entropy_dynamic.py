"""The fused cross-entropy under symbolic sizes: [rows, classes] logits with a symbolic row count and a
static or symbolic class count (the kernels read it per call) are fused, one compilation serving every
size; other symbolic layouts stay ATen with the reason."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import CountingBackend


class Head(nn.Module):
    """An LM head and its loss, as model code writes them: logits [B, T, V] viewed as [B*T, V]."""

    def __init__(self, d=16, vocab=37):
        super().__init__()
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, h, targets):
        logits = self.lm_head(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


@pytest.mark.parametrize("head_fused", [True, False])
def test_lm_loss_with_symbolic_batch_and_length_is_fused_once(head_fused):
    torch.manual_seed(0)
    skip = () if head_fused else ("fuse_linear_cross_entropy",)
    model, backend = Head(), CountingBackend(skip_passes=skip)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for b, t in [(2, 5), (3, 7), (2, 13)]:
        h = torch.randn(b, t, 16, requires_grad=True)  # fp32: the fused op takes fp32/bf16/fp16
        targets = torch.randint(0, 37, (b, t))
        targets[0, 0] = -1  # an ignored position
        loss, ref = compiled(h, targets), model(h, targets)
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
        params = (h, model.lm_head.weight)
        for got, want in zip(torch.autograd.grad(loss, params), torch.autograd.grad(ref, params)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert backend.calls == 1
    sources = " ".join(g.wrapper_source for g in backend.report.graphs)
    if head_fused:  # the head and its loss as one op: chunks of logits, sized per call
        assert "fxopt_ops.linear_cross_entropy(" in sources and "fxopt_ops.cross_entropy(" not in sources
        assert all(g.symbols for g in backend.report.graphs)
        return
    assert "fxopt_ops.cross_entropy(" in sources
    # (the logits are the head's matmul output, saved for the loss only: their gradient is written over them)
    assert any("fxopt_ops.cross_entropy_backward_over_logits(" in g.wrapper_source for g in backend.report.graphs)
    assert all(g.symbols for g in backend.report.graphs)


def _per_position(logits, targets):
    return F.cross_entropy(logits, targets, reduction="none")  # logits [B, V, T]: classes in dim 1


def test_symbolic_logits_with_classes_not_last_stay_aten_and_exact():
    backend = CountingBackend()
    compiled = torch.compile(_per_position, backend=backend, dynamic=True)
    for b, t in [(2, 5), (3, 6)]:
        logits, targets = torch.randn(b, 11, t), torch.randint(0, 11, (b, t))
        torch.testing.assert_close(compiled(logits, targets), _per_position(logits, targets), rtol=1e-5, atol=1e-6)
    assert any("symbolic" in reason for _, reason in backend.report.fallbacks), backend.report.fallbacks


def _token_loss(logits, targets):
    return F.cross_entropy(logits, targets)


def test_symbolic_class_count_is_fused_once_and_exact():
    """Logits passed in with dynamic=True: rows and classes both symbolic (the benchmark's case)."""
    torch.manual_seed(0)
    backend = CountingBackend()
    compiled = torch.compile(_token_loss, backend=backend, dynamic=True)
    for rows, classes in [(6, 37), (9, 130), (4, 1000)]:
        logits = torch.randn(rows, classes, requires_grad=True)
        targets = torch.randint(0, classes, (rows,))
        loss = compiled(logits, targets)
        logits64 = logits.detach().double().requires_grad_()
        ref = _token_loss(logits64, targets)
        torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
        (got,), (want,) = torch.autograd.grad(loss, (logits,)), torch.autograd.grad(ref, (logits64,))
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)
    assert backend.calls == 1
    assert any("fxopt_ops.cross_entropy(" in g.wrapper_source for g in backend.report.graphs)
    # (the logits are the caller's leaf: their gradient is a new tensor)
    assert any("fxopt_ops.cross_entropy_backward(" in g.wrapper_source for g in backend.report.graphs)
