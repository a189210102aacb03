"""ATen results whose real layout differs from their meta value's: the CPU batch norm of a permuted input
returns a row-major tensor where the meta function keeps the input's strides. Fused kernels and views
index an ATen result with its meta strides, so the wrapper conforms such a result to them
(wrapper_runtime.conform_layout): a sweep found a kernel reading the batch norm's output transposed
(silently wrong) and a `.view` of it failing."""
import torch
import torch.nn as nn

import fxopt
from fxopt.codegen.wrapper_runtime import conform_layout
from tests.helpers import compile_fxopt


class TransposedNorm(nn.Module):
    """BatchNorm1d over [B, C, T] made from a [B, T, C] activation, as sequence models write it."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(16)
        self.fc = nn.Linear(16, 5)

    def forward(self, h):
        y = self.bn(h.transpose(1, 2))
        return self.fc(y.transpose(1, 2)), (y * 2 + 1).sin(), y.exp() + h.transpose(1, 2)


def test_kernels_and_views_read_a_batch_norm_of_a_transposed_input_right(device):
    torch.manual_seed(0)
    model = TransposedNorm().to(device)
    reference = TransposedNorm().to(device).double()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(3, 9, 16, device=device)
    assert any(k.graph == "forward" for k in fxopt.explain(TransposedNorm().to(device), x.requires_grad_()).kernels)
    x64 = x.detach().double().requires_grad_()
    got, want = compile_fxopt(model)(x), reference(x64)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-5)
    sum(g.sum() for g in got).backward()
    sum(w.sum() for w in want).backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-4)
    for p, p64 in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.double(), p64.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.bn.running_mean.double(), reference.bn.running_mean)


def test_conform_layout_copies_only_on_a_mismatch():
    t = torch.randn(4, 6)
    assert conform_layout(t, (4, 6), (6, 1)) is t
    wanted = conform_layout(t, (4, 6), (1, 4))
    assert wanted.stride() == (1, 4) and torch.equal(wanted, t)
