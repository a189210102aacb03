"""Backward graphs in unusual company (the backward sweep of 2026-12-05): run under vmap (batched
gradients, vectorized Jacobians) and with complex scalars (torch.polar's backward multiplies by 1j).
Each against eager in float64."""
from __future__ import annotations

import torch

from helpers import compile_fxopt


def test_a_compiled_backward_under_vmap_runs_as_aten():
    """autograd.grad(is_grads_batched=True) hands the backward batched tensors, which Triton's launcher
    cannot read (it raised "Cannot access storage of BatchedTensorImpl")."""
    fn = lambda x: (x.exp() * 2).sin()  # noqa: E731
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    y = compile_fxopt(fn)(x)
    eye = torch.eye(12, dtype=torch.float64).view(12, 3, 4)
    got, = torch.autograd.grad(y, x, eye, is_grads_batched=True)
    expected, = torch.autograd.grad(fn(x), x, eye, is_grads_batched=True)
    torch.testing.assert_close(got, expected)
    jac = torch.autograd.functional.jacobian(compile_fxopt(fn), x, vectorize=True)
    torch.testing.assert_close(jac, torch.autograd.functional.jacobian(fn, x, vectorize=True))
    y = compile_fxopt(fn)(x)  # and an ordinary backward afterwards still runs the kernels
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.autograd.grad(fn(x).sum(), x)[0])


def test_complex_scalars_in_a_graph():
    """A complex scalar argument of an ATen call (complex ops stay ATen) is written into the wrapper."""
    x = torch.randn(3, 4, 2, dtype=torch.float64)
    f = lambda t: torch.view_as_real(torch.view_as_complex(t) * (1 + 2j))  # noqa: E731
    torch.testing.assert_close(compile_fxopt(f)(x), f(x))
    g = lambda t, fr: torch.view_as_real(torch.view_as_complex(t) * torch.polar(torch.ones_like(fr), fr))  # noqa: E731
    a, fa = x.clone().requires_grad_(), torch.randn(4, dtype=torch.float64, requires_grad=True)
    b, fb = a.detach().clone().requires_grad_(), fa.detach().clone().requires_grad_()
    compile_fxopt(g)(a, fa).square().sum().backward()
    g(b, fb).square().sum().backward()
    torch.testing.assert_close(a.grad, b.grad)
    torch.testing.assert_close(fa.grad, fb.grad)
