"""SDPA's "safe" softmax: a query row its mask removes entirely gives 0 and 0 gradients, where eager's
softmax (and hand-written attention) gives NaN. SDPA calls with an attn_mask are fused with the
kernels' safe_softmax flag; the reference is SDPA itself in float64 (its math path).

Kernels run in the Triton interpreter on CPU tensors (float32 here) and for real on CUDA."""
import pytest
import torch
import torch.nn.functional as F

import fxopt
from fxopt.attention.flash_backward import flash_backward
from fxopt.attention.flash_decode import flash_decode
from fxopt.attention.flash_forward import flash_forward
from tests.helpers import CountingBackend, compile_fxopt

TOL = dict(rtol=2e-5, atol=2e-5)


def tensors(device, b=2, h=2, tq=12, tk=12, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, t, d, generator=g) for t in (tq, tk, tk))
    keep = torch.rand(b, 1, tq, tk, generator=g) > 0.3
    keep[..., 0] = True
    keep[0, :, min(3, tq - 1), :] = False  # a query row of batch 0 that sees no key
    keep[1, :, -1, :] = False
    return q.to(device), k.to(device), v.to(device), keep.to(device)


def sdpa64(q, k, v, keep, dout):
    """SDPA's output and q, k, v gradients in float64 (the math path, safe softmax)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    return (out, *torch.autograd.grad(out, (q, k, v), dout.double()))


def additive(keep):
    return torch.zeros(keep.shape, device=keep.device).masked_fill(~keep, float("-inf"))


def test_forward_and_backward_kernels_zero_rows_masked_entirely(device):
    q, k, v, keep = tensors(device)
    dout = torch.randn_like(q)
    mask = additive(keep).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    out, lse = flash_forward(q, k, v, scale=0.25, causal=False, mask=mask, safe_softmax=True)
    assert torch.isposinf(lse[0, :, 3]).all() and torch.isfinite(lse[0, :, :3]).all()
    grads = flash_backward(dout, q, k, v, out, lse, scale=0.25, causal=False, mask=mask)
    want = sdpa64(q * 1.0, k, v, keep, dout)  # (SDPA's default scale is 1/sqrt(16) = 0.25)
    for got, ref in zip((out, *grads), want):
        assert not got.isnan().any()
        torch.testing.assert_close(got.double(), ref, **TOL)
    assert (out[0, :, 3] == 0).all() and (grads[0][0, :, 3] == 0).all()


def test_without_the_flag_a_row_masked_entirely_stays_nan(device):
    """(Eager's softmax, which hand-written attention is matched against, gives NaN there.)"""
    q, k, v, keep = tensors(device)
    mask = additive(keep).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    out, lse = flash_forward(q, k, v, scale=0.25, causal=False, mask=mask)
    assert out[0, :, 3].isnan().all() and torch.isneginf(lse[0, :, 3]).all()
    assert not out[0, :, :3].isnan().any()


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_kernel_zeroes_rows_masked_entirely(device, splits):
    q, k, v, keep = tensors(device, tq=2, tk=512)
    mask = additive(keep).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    out, lse = flash_decode(q, k, v, scale=0.25, causal=False, mask=mask, num_splits=splits, safe_softmax=True)
    ref = sdpa64(q, k, v, keep, torch.zeros_like(q))[0]
    torch.testing.assert_close(out.double(), ref, **TOL)
    assert (out[0, :, 1] == 0).all() and torch.isposinf(lse[0, :, 1]).all()


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_sdpa_with_a_mask_is_fused_and_equals_sdpa(device, kind):
    q, k, v, keep = tensors(device)
    mask = keep if kind == "bool" else additive(keep) + 0.5 * keep  # a float mask: -inf and finite biases
    fn = lambda q, k, v, mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # noqa: E731
    site = fxopt.explain(fn, q, k, v, mask).attention[0]
    assert site.fused and "safe softmax" in site.mask, site
    out, *grads = compiled_against_float64(fn, q, k, v, mask)
    for got in (out, *grads):
        assert not got.isnan().any()


def compiled_against_float64(fn, q, k, v, mask):
    """fn compiled by fxopt, output and q, k, v gradients, each equal (NaN where it is NaN) to fn's in
    float64 eager; returns the compiled ones."""
    torch._dynamo.reset()
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = compile_fxopt(fn)(q, k, v, mask)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = fn(q64, k64, v64, mask.double() if mask.is_floating_point() else mask)
    want = (ref, *torch.autograd.grad(ref, (q64, k64, v64), dout.double()))
    for got, r in zip((out, *grads), want):
        torch.testing.assert_close(got.double(), r, equal_nan=True, **TOL)
    return (out, *grads)


def _masked_fill(q, k, v, keep):
    return (q @ k.transpose(-2, -1) * 0.25).masked_fill(~keep, float("-inf")).softmax(-1) @ v


def _where(q, k, v, keep):
    return torch.where(keep, q @ k.transpose(-2, -1) * 0.25, float("-inf")).softmax(-1) @ v


def _added(q, k, v, keep):
    bias = torch.zeros(keep.shape, device=keep.device).masked_fill(~keep, float("-inf"))
    return (q @ k.transpose(-2, -1) * 0.25 + bias).softmax(-1) @ v


@pytest.mark.parametrize("fn", [_masked_fill, _where, _added], ids=lambda f: f.__name__.strip("_"))
def test_hand_written_rows_masked_entirely_keep_eagers_gradients(device, fn):
    """Hand-written attention keeps eager's NaN output for a row masked entirely; its gradients follow the
    spelling: a -inf fill's backward gives masked scores 0, so dq and dk get nothing from the row (dv is
    NaN, from the NaN probabilities), while an added -inf mask passes the NaN to dq and dk too. A sweep
    found the fused backward giving NaN dq and dk for fills (a fully padded sequence's keys)."""
    q, k, v, keep = tensors(device)
    keep = keep.clone()
    keep[1] = False  # batch 1: every key padded
    site = fxopt.explain(fn, q, k, v, keep).attention[0]
    assert site.fused, site
    out = compiled_against_float64(fn, q, k, v, keep)[0]
    assert out[1].isnan().all() and out[0, :, 3].isnan().all() and not out[0, :, :3].isnan().any()


def _diagonal_masked(q, k, v):
    t = q.size(-2)
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool,
                                                                           device=q.device)), float("-inf"))
    return s.softmax(-1) @ v  # row 0 sees no key


def test_a_mask_built_from_the_length_that_empties_a_row_under_dynamic_shapes(device):
    """Static compiles leave such a site unfused (the compile-time mask is evaluated); under dynamic=True it
    is a fill read by the kernel, and the empty row's NaN output and gradients must still be eager's."""
    q, k, v, _ = tensors(device, tq=9, tk=9)
    torch._dynamo.reset()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    backend = CountingBackend()
    out = torch.compile(_diagonal_masked, backend=backend, dynamic=True)(q, k, v)
    assert backend.report.attention[0].fused
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _diagonal_masked(q64, k64, v64)
    want = (ref, *torch.autograd.grad(ref, (q64, k64, v64), dout.double()))
    for got, r in zip((out, *grads), want):
        torch.testing.assert_close(got.double(), r, equal_nan=True, **TOL)
    assert out[:, :, 0].isnan().all() and not grads[0].isnan().any()


def _finite_causal_bool_padding(q, k, v, am):
    """A causal fill of finfo.min, then a bool key padding mask filled with -inf (left padding)."""
    t = q.size(-2)
    keep = torch.tril(torch.ones(t, t, dtype=torch.bool, device=q.device))
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~keep, torch.finfo(torch.float32).min)
    return s.masked_fill(am[:, None, None, :] == 0, float("-inf")).softmax(-1) @ v


def test_a_finite_causal_fill_beside_a_padding_fill_keeps_left_padded_rows_finite(device):
    """Left-padded query rows see only padded (-inf) keys; eager's softmax averages the future keys, which
    hold the causal fill's finfo.min. With causal block skipping the kernel gave those rows NaN, and the
    next layer's P @ V spread it to every row (0 * NaN): the site now reads the causal fill folded into its
    mask. Forward equal to eager; gradients too where the loss does not read the padding rows."""
    q, k, v, _ = tensors(device, tq=9, tk=9)
    am = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * 9], device=device)
    site = fxopt.explain(_finite_causal_bool_padding, q, k, v, am).attention[0]
    assert site.fused and "finite fill" in site.mask, site
    torch._dynamo.reset()
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = compile_fxopt(_finite_causal_bool_padding)(q, k, v, am)
    two_layers = compile_fxopt(lambda q, k, v, am: _finite_causal_bool_padding(q, k, _finite_causal_bool_padding(
        q, k, v, am), am))(q, k, v, am)
    assert not out.isnan().any() and not two_layers.isnan().any()
    dout = torch.randn_like(out) * (am[:, None, :, None] != 0)  # the loss reads real tokens only
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _finite_causal_bool_padding(q64, k64, v64, am)
    want = (ref, *torch.autograd.grad(ref, (q64, k64, v64), dout.double()))
    for got, r in zip((out, *grads), want):
        torch.testing.assert_close(got.double(), r, **TOL)
