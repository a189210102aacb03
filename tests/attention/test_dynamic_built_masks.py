"""Hand-written attention under dynamic=True whose mask is built in the forward from the symbolic length
(`triu(ones(T, T), 1)` and kin) and whose scale is `1 / sqrt(q.size(-1))` of a symbolic head dim: one
compilation fuses it as causal attention with the default scale for every (batch, length, head dim),
forward and gradients equal eager (float64); masks that are not causal for every length, and scales
that are not 1/sqrt(head dim), are not taken for what they are not."""
import math

import pytest
import torch

from helpers import CountingBackend

SIZES = [(2, 8, 16), (3, 5, 16), (2, 17, 32)]  # (batch, length, head dim); 4 heads (no duck sizing)


def _attend(q, k, v, scores_to_probs):
    att = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.size(-1)))
    return scores_to_probs(att, q.size(-2)) @ v


def _triu_bool(att, T):
    future = torch.triu(torch.ones(T, T, dtype=torch.bool, device=att.device), diagonal=1)
    return torch.softmax(att.masked_fill(future, float("-inf")).float(), dim=-1).to(att.dtype)


def _tril_eq_zero(att, T):
    mask = torch.tril(torch.ones(T, T, device=att.device)).view(1, 1, T, T)
    return torch.softmax(att.masked_fill(mask == 0, float("-inf")), dim=-1)


def _additive_full_triu(att, T):
    return torch.softmax(att + torch.full((T, T), float("-inf"), device=att.device).triu(1), dim=-1)


def _where_tril_finfo_min(att, T):
    keep = torch.ones(T, T, dtype=torch.bool, device=att.device).tril()
    return torch.softmax(torch.where(keep, att, torch.finfo(att.dtype).min), dim=-1)


def _run(fn, sizes=SIZES):
    """Compile once with dynamic=True; forward and gradients (float32, the kernels' dtype under
    TRITON_INTERPRET=1) against eager in float64 at every size."""
    torch.manual_seed(0)
    backend = CountingBackend()
    compiled = torch.compile(fn, backend=backend, dynamic=True)
    for b, t, d in sizes:
        q, k, v = (torch.randn(b, 4, t, d, requires_grad=True) for _ in range(3))
        q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
        out, ref = compiled(q, k, v), fn(q64, k64, v64)
        torch.testing.assert_close(out, ref.float(), rtol=1e-4, atol=1e-5)
        go = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), go)
        want = torch.autograd.grad(ref, (q64, k64, v64), go.double())
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w.float(), rtol=1e-4, atol=1e-4)
    return backend


@pytest.mark.parametrize("probs", [_triu_bool, _tril_eq_zero, _additive_full_triu, _where_tril_finfo_min])
def test_masks_built_from_the_symbolic_length_are_the_causal_fact(probs):
    backend = _run(lambda q, k, v: _attend(q, k, v, probs))
    assert backend.calls == 1
    site = backend.report.attention[0]
    assert site.fused and site.causal and site.mask.startswith("causal (a triangle built"), site
    assert site.scale is None  # 1/sqrt(head dim), computed per call


def _band(att, T):
    """A sliding window of 2 keys: causal at length 2, not beyond; must not be taken as causal."""
    keep = torch.tril(torch.ones(T, T, device=att.device)) * torch.triu(torch.ones(T, T, device=att.device), -1)
    return torch.softmax(att.masked_fill(keep == 0, float("-inf")), dim=-1)


def _upper_skip(att, T):
    """Masks j >= i + 2 only: each query also sees the next key."""
    future = torch.triu(torch.ones(T, T, dtype=torch.bool, device=att.device), diagonal=2)
    return torch.softmax(att.masked_fill(future, float("-inf")), dim=-1)


@pytest.mark.parametrize("probs", [_band, _upper_skip])
def test_masks_that_are_not_causal_for_every_length_are_read_per_call(probs):
    backend = _run(lambda q, k, v: _attend(q, k, v, probs))
    site = backend.report.attention[0]
    assert not site.causal, site


def test_a_scale_of_the_sequence_length_is_not_taken_for_the_default():
    def fn(q, k, v):
        att = torch.softmax(q @ k.transpose(-2, -1) / q.size(-2), dim=-1)
        return att @ v

    backend = _run(fn)
    site = backend.report.attention[0]
    assert not site.fused and "1/sqrt(head dim" in site.reason, site


@pytest.mark.parametrize("spelling", ["pow", "div_sqrt"])
def test_other_spellings_of_the_default_scale(spelling):
    def fn(q, k, v):
        s = q @ k.transpose(-2, -1)
        s = s * q.size(-1) ** -0.5 if spelling == "pow" else s / math.sqrt(k.size(-1))
        return torch.softmax(s, dim=-1) @ v

    backend = _run(fn)
    site = backend.report.attention[0]
    assert site.fused and site.scale is None, site


def test_a_head_dim_outside_the_kernels_range_runs_the_reference():
    """Head dim 8 (the kernels take 16..256): still correct, through the torch reference."""
    backend = _run(lambda q, k, v: _attend(q, k, v, _triu_bool), sizes=[(2, 8, 16), (2, 9, 8)])
    assert backend.calls == 1 and backend.report.attention[0].fused


def test_a_default_scale_split_across_q_and_k():
    """q and k each times head_dim ** -0.25 (some models split the scale): the product is proved
    1/sqrt(head dim)."""
    def fn(q, k, v):
        d = q.size(-1)
        s = (q * d ** -0.25) @ (k * d ** -0.25).transpose(-2, -1)
        return _triu_bool(s, q.size(-2)) @ v

    backend = _run(fn)
    site = backend.report.attention[0]
    assert site.fused and site.causal and site.scale is None, site


def _triangle_times_a_size(att, T):
    """The triangle scaled by a value of the sizes before the fill: its entries change with the head
    dim, so the mask is not taken as the built causal shape (it is read per call), and compiling it
    does not fail."""
    future = torch.triu(torch.ones(T, T, device=att.device), diagonal=1) * (1.0 / math.sqrt(att.size(0)))
    return torch.softmax(att.masked_fill(future > 0, float("-inf")), dim=-1)


def test_a_triangle_combined_with_a_value_of_the_sizes_is_not_the_built_shape():
    backend = _run(lambda q, k, v: _attend(q, k, v, _triangle_times_a_size))
    site = backend.report.attention[0]
    assert site.fused and not site.causal, site


@pytest.mark.parametrize("by, power", [(0.25, 1), (4.0, -1), (-1.0, 1)])
def test_the_op_scales_by_a_runtime_scalar(by, power):
    """scale_by (a 0-d tensor: a module's float attribute dynamo made an input) multiplies the scale per
    call, forward and gradients, against float64; a non-positive result takes the reference."""
    from fxopt.attention.op import flash_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 16, requires_grad=True) for _ in range(3))
    out = flash_attention(q, k, v, None, 0.5, True, torch.tensor(by), power)[0]
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    scale = 0.5 * by ** power
    ref = _triu_bool(q64 @ k64.transpose(-2, -1) * scale, 9) @ v64
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    go = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), go)
    want = torch.autograd.grad(ref, (q64, k64, v64), go.double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4)


class LlamaLikeScaling(torch.nn.Module):
    """HF Llama keeps `self.scaling = head_dim ** -0.5`, a float attribute: under dynamic=True dynamo
    passes it as a tensor input, then specialises it when the fused op needs a number (one restarted
    trace). The site is fused with the attribute's value, reported once."""

    def __init__(self):
        super().__init__()
        self.scaling = 16 ** -0.5

    def forward(self, q, k, v):
        att = (q @ k.transpose(-2, -1)) * self.scaling
        return _triu_bool(att, q.size(-2)) @ v


def test_a_float_attribute_scale_is_fused_and_reported_once():
    backend = _run(LlamaLikeScaling(), sizes=[(2, 8, 16), (3, 5, 16)])
    sites = backend.report.attention
    assert len(sites) == 1 and sites[0].fused and sites[0].causal and sites[0].scale == pytest.approx(0.25), sites
