"""A 16-bit logsumexp runs on its fp32 up-cast (passes/logsumexp_upcast.py): its backward,
grad * exp(x - result), then subtracts an unrounded saved result from x. Before, the backward recomputed
x = logits * scale unrounded and subtracted the rounded result: fp16 values near 1e4 gave gradients off by
up to e^4. Checked against float64: fxopt's gradient no further from it than eager's, its value eager's."""
from __future__ import annotations

import pytest
import torch

from helpers import compile_fxopt


def _run(fn, x, scale):
    t = x.clone().requires_grad_()
    out = fn(t, scale)
    (out.double() * torch.arange(1, out.numel() + 1, device=out.device).view(out.shape)).sum().backward()
    return out.detach(), t.grad


@pytest.mark.parametrize("method", [False, True])
def test_logsumexp_gradient_of_large_scaled_values(method, device):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 37, generator=g) * 3e3).half().to(device)
    scale = torch.linspace(0.5, 2.0, 37).half().to(device)
    fn = (lambda t, s: (t * s).logsumexp(-1)) if method else (lambda t, s: torch.logsumexp(t * s, dim=-1))
    out, grad = _run(compile_fxopt(fn), x, scale)
    eager_out, eager_grad = _run(fn, x, scale)
    _, ref_grad = _run(fn, x.double(), scale.double())
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, eager_out, rtol=2 ** -10, atol=0)
    err, eager_err = (grad.double() - ref_grad).abs().max(), (eager_grad.double() - ref_grad).abs().max()
    assert err <= 1.5 * eager_err + 1e-3, (err, eager_err)


def test_keepdim_and_fp32_are_unchanged(device):
    x = torch.randn(4, 9, device=device)
    for fn in (lambda t: t.logsumexp(1, keepdim=True) * 2, lambda t: torch.logsumexp(t.half() * 3, (0, 1))):
        torch.testing.assert_close(compile_fxopt(fn)(x), fn(x), rtol=1e-3, atol=1e-3)
