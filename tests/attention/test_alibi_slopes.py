"""ALiBi from per-head slopes: the flash kernels compute slope[h] * (j - i - (Tk - Tq)) instead of reading a
[H, Tq, Tk] bias, and the graph pass replaces a compile-time bias linear in the key index with those slopes.

Why: the bias is added inside the kernels (forward, TMA forward, backward, and the decode path's
materialised mask), so each is checked against float64 eager with the bias written out; the analysis must
accept only biases it can reproduce exactly (not bfloat16-rounded or symmetric ones), and a buffer the
slopes came from must be guarded. Kernels run in the Triton interpreter on CPU tensors (conftest); the
graph-level tests run on CUDA too where present, and the `gpu` test checks the real compiler in bfloat16
(`TRITON_INTERPRET=0 pytest -m gpu`).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from fxopt.analysis.attention_masks import MASKED_AT_MOST
from fxopt.analysis.position_slopes import linear_key_slopes
from fxopt.attention import flash_decode as decode_module
from fxopt.attention import flash_forward_tma as tma_module
from fxopt.attention.flash_backward import flash_backward
from fxopt.attention.flash_forward import flash_forward
from fxopt.attention.op import flash_attention
from fxopt.attention.reference import key_slope_bias
from fxopt.attention import flash_backward_tma as tma_backward_module
from tests.attention.test_flash_forward_tma import TMA, TMA_BACKWARD, _count_calls
from tests.attention.test_flash_kernels import GRAD_TOL, OUT_TOL, assert_close, make_qkv, padding_mask, reference
from tests.attention.test_match_spellings import B, D, H, T, fused_sites, qkv
from tests.helpers import assert_close_to_reference, compile_fxopt, to64

SLOPES = (0.5, 0.25)  # one per head of the graph-level tests (H = 2)


def alibi_slopes(heads, device="cpu"):
    return torch.tensor([2.0 ** (-8 * (h + 1) / heads) for h in range(heads)], device=device)


def bias64(slopes, seq_q, seq_k):
    """The bias written out in float64 (also checks reference.key_slope_bias, which the op's decode path uses)."""
    rows = torch.arange(seq_q, dtype=torch.float64)[:, None] + (seq_k - seq_q)
    bias = (slopes.double().cpu()[:, None, None] * (torch.arange(seq_k, dtype=torch.float64) - rows))[None]
    torch.testing.assert_close(key_slope_bias(slopes.cpu(), seq_q, seq_k).double(), bias)
    return bias.to(slopes.device)


def check_with_slopes(q, k, v, slopes, *, causal, mask=None, config=None, backward=True, lse_tol=(1e-5, 1e-4),
                      backward_config=None):
    """flash_forward / flash_backward with key_slopes against float64 autograd of the reference."""
    scale = q.shape[-1] ** -0.5
    out, lse = flash_forward(q, k, v, scale=scale, causal=causal, mask=mask, config=config, key_slopes=slopes)
    ref_mask = bias64(slopes, q.shape[2], k.shape[2]) + (0 if mask is None else mask.double())
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference(*leaves, scale=scale, causal=causal, mask=ref_mask)
    assert_close(out, ref_out.detach(), OUT_TOL[q.dtype])
    torch.testing.assert_close(lse.double(), ref_lse.detach(), rtol=lse_tol[0], atol=lse_tol[1])
    if not backward:
        return
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(7)).to(q.device, q.dtype)
    grads = flash_backward(dout, q, k, v, out, lse, scale=scale, causal=causal, mask=mask, key_slopes=slopes,
                           config=backward_config)
    ref_out.backward(dout.double())
    for got, leaf in zip(grads, leaves):
        assert_close(got, leaf.grad, GRAD_TOL[q.dtype])


# (batch, heads, kv_heads, seq_q, seq_k, head_dim, dtype): ragged lengths, Tq < Tk, GQA, one float16 case
KERNEL_CASES = [
    (2, 2, 2, 37, 37, 16, torch.float32),
    (1, 4, 2, 20, 45, 16, torch.float32),
    (1, 4, 2, 37, 37, 32, torch.float16),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=["B2H2q37k37-fp32", "B1H4kv2q20k45-fp32", "B1H4kv2q37-fp16"])
def test_kernels_with_slopes_match_float64(case, causal):
    *shape, dtype = case
    check_with_slopes(*make_qkv(*shape, dtype, seed=shape[3] + shape[4]), alibi_slopes(shape[1]), causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_slopes_with_a_padding_mask(causal):
    """The slopes' bias and an additive mask read by the kernel add up (keys past 45 of batch 1 dropped)."""
    q, k, v = make_qkv(2, 4, 2, 37, 70, 16, torch.float32, seed=5)
    mask = padding_mask(2, 4, 37, 70, lengths=[70, 45])
    check_with_slopes(q, k, v, alibi_slopes(4), causal=causal, mask=mask)


def test_tma_forward_with_slopes_float16(monkeypatch):
    """The TMA forward computes the bias too (it must leave its mask-free max shortcut for that)."""
    tma_calls = _count_calls(monkeypatch, "fxopt.attention.flash_forward.flash_forward_tma",
                             tma_module.flash_forward_tma)
    q, k, v = make_qkv(2, 4, 2, 40, 56, 32, torch.float16, transposed=True, seed=9)
    check_with_slopes(q, k, v, alibi_slopes(4), causal=True, config=TMA, backward=False)
    assert len(tma_calls) == 1


def test_tma_backward_with_slopes_float16(monkeypatch):
    """The TMA backward recomputes the bias in its dK/dV and dQ kernels."""
    tma_calls = _count_calls(monkeypatch, "fxopt.attention.flash_backward.flash_backward_tma",
                             tma_backward_module.flash_backward_tma)
    q, k, v = make_qkv(1, 4, 2, 40, 56, 32, torch.float16, transposed=True, seed=10)
    check_with_slopes(q, k, v, alibi_slopes(4), causal=True, backward_config=TMA_BACKWARD)
    assert len(tma_calls) == 1


@pytest.mark.parametrize("seq_k", [70, 260], ids=["flash", "decode"])
def test_op_short_queries_with_slopes(seq_k, monkeypatch):
    """Two query rows: over 260 keys the op takes the decode kernel (slopes as a materialised mask), over
    70 the flash forward; forward, lse and the autograd backward against float64."""
    decodes = _count_calls(monkeypatch, "fxopt.attention.flash_decode.flash_decode", decode_module.flash_decode)
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 4, 2, 2, seq_k, 16, torch.float32, seed=seq_k))
    slopes = alibi_slopes(4)
    out, lse = flash_attention(q, k, v, None, 0.25, True, key_slopes=slopes)
    assert len(decodes) == (seq_k >= 256)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference(*leaves, scale=0.25, causal=True, mask=bias64(slopes, 2, seq_k))
    assert_close(out, ref_out.detach(), OUT_TOL[torch.float32])
    torch.testing.assert_close(lse.double(), ref_lse.detach(), rtol=1e-5, atol=1e-4)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    out.backward(dout)
    ref_out.backward(dout.double())
    for got, leaf in zip((q.grad, k.grad, v.grad), leaves):
        assert_close(got, leaf.grad, GRAD_TOL[torch.float32])


def test_bad_key_slopes_are_refused():
    q, k, v = make_qkv(1, 4, 2, 8, 8, 16, torch.float32)
    out, lse = flash_forward(q, k, v, scale=0.25, causal=False)
    for bad in (alibi_slopes(4).double(), alibi_slopes(3), alibi_slopes(4)[None]):
        with pytest.raises(ValueError, match="key_slopes"):
            flash_forward(q, k, v, scale=0.25, causal=False, key_slopes=bad)
        with pytest.raises(ValueError, match="key_slopes"):
            flash_backward(torch.ones_like(out), q, k, v, out, lse, scale=0.25, causal=False, key_slopes=bad)


# ------------------------------------------------------------------ linear_key_slopes

def relative(t):
    pos = torch.arange(t)
    return (pos[None, :] - pos[:, None]).float()


def test_linear_key_slopes_reads_causal_alibi():
    slopes = torch.tensor([0.5, 0.25, 2.0 ** -7])
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    bias = (slopes[:, None, None] * relative(9)).masked_fill(~causal, float("-inf"))[None]
    got, kept = linear_key_slopes(bias, MASKED_AT_MOST)
    torch.testing.assert_close(got, slopes.double(), rtol=1e-6, atol=0)
    assert torch.equal(kept, causal.expand(1, 3, 9, 9))


def test_linear_key_slopes_refuses_what_slopes_cannot_reproduce():
    slopes = torch.tensor([0.37, 0.11])
    exact = (slopes[:, None, None] * relative(64))[None]
    assert linear_key_slopes(exact, MASKED_AT_MOST) is not None  # the control: float32 values are linear
    assert linear_key_slopes(exact.bfloat16().float(), MASKED_AT_MOST) is None  # rounding off by up to 0.06
    assert linear_key_slopes(-exact.abs(), MASKED_AT_MOST) is None  # encoders' symmetric -slope * |i - j|


def test_linear_key_slopes_reads_mpt_key_only_bias():
    """MPT keeps slopes * (j - (T - 1)), one row broadcast over queries: the row constant is free."""
    slopes = alibi_slopes(4)
    bias = (slopes.view(1, 4, 1, 1) * torch.arange(-15, 1).view(1, 1, 1, 16)).expand(1, 4, 16, 16)
    got, kept = linear_key_slopes(bias, MASKED_AT_MOST)
    torch.testing.assert_close(got, slopes.double(), rtol=1e-6, atol=0)
    assert bool(kept.all())


# ------------------------------------------------------------------ graph level

def causal_fill(s):
    t = s.shape[-1]
    return s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=s.device).triu(1), float("-inf"))


def alibi_relative(q, k, v):
    pos = torch.arange(q.shape[-2], device=q.device)
    slopes = torch.tensor(SLOPES, device=q.device, dtype=q.dtype)
    s = q @ k.transpose(-1, -2) * D ** -0.5 + slopes[None, :, None, None] * (pos[None, :] - pos[:, None])
    return causal_fill(s).softmax(-1) @ v


def alibi_key_only(q, k, v):
    """BLOOM's spelling: the bias depends on the key index alone (softmax ignores the row constant)."""
    pos = torch.arange(q.shape[-2], device=q.device)
    slopes = torch.tensor(SLOPES, device=q.device, dtype=q.dtype)
    s = q @ k.transpose(-1, -2) * D ** -0.5 + slopes[None, :, None, None] * pos[None, :]
    return causal_fill(s).softmax(-1) @ v


class MptAttention(nn.Module):
    """MPT: the bias kept in a buffer, slopes * (j - (T - 1)); the causal fill from a tril buffer."""

    def __init__(self, where=True):
        super().__init__()
        self.where = where
        alibi = torch.tensor(SLOPES).view(1, H, 1, 1) * torch.arange(1 - T, 1).view(1, 1, 1, T)
        self.register_buffer("alibi", alibi)
        self.register_buffer("keep", torch.ones(T, T, dtype=torch.bool).tril())

    def forward(self, q, k, v):
        s = q @ k.transpose(-1, -2) * D ** -0.5 + self.alibi
        if self.where:
            return torch.where(self.keep, s, torch.finfo(s.dtype).min).softmax(-1) @ v
        return s.masked_fill(~self.keep, float("-inf")).softmax(-1) @ v


def assert_alibi_site(fn, *inputs):
    fused, unfused, _ = fused_sites(fn, *inputs)
    assert len(fused) == 1 and not unfused, [s.reason for s in unfused]
    assert "ALiBi" in fused[0].mask and fused[0].causal, fused[0].mask
    return fused[0]


@pytest.mark.parametrize("spelling", ["relative", "mpt-where", "mpt-masked-fill", "key-only"])
def test_alibi_spellings_fuse_with_slopes(spelling, device):
    fn = {"relative": alibi_relative, "key-only": alibi_key_only}.get(spelling)
    fn = fn or MptAttention(where=spelling == "mpt-where").to(device)
    eager64 = copy.deepcopy(fn).double() if isinstance(fn, nn.Module) else fn
    q, k, v = qkv(device)
    assert_alibi_site(fn, q, k, v)
    assert_close_to_reference(compile_fxopt(fn)(q, k, v), eager64(*map(to64, (q, k, v))), torch.float32)


def check_gradients(fn, *inputs):
    """Forward and q, k, v gradients of the compiled fn against float64 eager."""
    q, k, v, *rest = inputs
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.device)
    out, ref = compile_fxopt(fn)(q, k, v, *rest), fn(q64, k64, v64, *map(to64, rest))
    assert_close_to_reference(out, ref, torch.float32)
    (out * weight).sum().backward()
    (ref * weight.double()).sum().backward()
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert_close_to_reference(got, want, torch.float32)


def test_alibi_gradients_equal_eager(device):
    check_gradients(alibi_relative, *qkv(device))


def alibi_padded(q, k, v, pad):
    pos = torch.arange(q.shape[-2], device=q.device)
    slopes = torch.tensor(SLOPES, device=q.device, dtype=q.dtype)
    s = q @ k.transpose(-1, -2) * D ** -0.5 + slopes[None, :, None, None] * (pos[None, :] - pos[:, None]) + pad
    return causal_fill(s).softmax(-1) @ v


def test_alibi_with_an_input_padding_mask(device):
    """The slopes go to the kernel, the input-dependent mask is read beside them."""
    pad = torch.zeros(B, 1, 1, T, device=device)
    pad[1, ..., -3:] = torch.finfo(torch.float32).min
    q, k, v = qkv(device)
    site = assert_alibi_site(alibi_padded, q, k, v, pad)
    assert "read by the kernel" in site.mask, site.mask
    check_gradients(alibi_padded, q, k, v, pad)


def alibi_symmetric(q, k, v):
    pos = torch.arange(q.shape[-2], device=q.device)
    slopes = torch.tensor(SLOPES, device=q.device, dtype=q.dtype)
    bias = -slopes[None, :, None, None] * (pos[None, :] - pos[:, None]).abs()
    return (q @ k.transpose(-1, -2) * D ** -0.5 + bias).softmax(-1) @ v


def test_symmetric_encoder_alibi_is_read_as_a_tensor(device):
    """-slope * |i - j| is not linear in j: slopes would change the attention, so the kernel reads it."""
    q, k, v = qkv(device)
    fused, unfused, _ = fused_sites(alibi_symmetric, q, k, v)
    assert len(fused) == 1 and not unfused, [s.reason for s in unfused]
    assert "read by the kernel" in fused[0].mask and "ALiBi" not in fused[0].mask and not fused[0].causal
    assert_close_to_reference(compile_fxopt(alibi_symmetric)(q, k, v), alibi_symmetric(*map(to64, (q, k, v))),
                              torch.float32)


def test_alibi_buffer_changed_after_compiling_is_caught(device):
    if device != "cpu":
        pytest.skip("on CUDA the guard is a device-side assertion (test_match_spellings checks that path)")
    model = MptAttention()
    q, k, v = qkv(device)
    compiled = compile_fxopt(model)
    assert_close_to_reference(compiled(q, k, v), copy.deepcopy(model).double()(*map(to64, (q, k, v))),
                              torch.float32)
    model.alibi.mul_(2)  # new slopes: the compiled kernel would use the old ones; the graph runs unfused
    assert_close_to_reference(compiled(q, k, v), copy.deepcopy(model).double()(*map(to64, (q, k, v))),
                              torch.float32)


@pytest.mark.gpu
def test_gpu_bf16_causal_hd128_with_slopes():
    """The real compiler: bfloat16, head dim 128, T = 256, GQA, ALiBi slopes; TMA forward on sm90+."""
    q, k, v = (t.cuda() for t in make_qkv(2, 8, 2, 256, 256, 128, torch.bfloat16, transposed=True, seed=12))
    slopes = alibi_slopes(8, "cuda")
    scale = 128 ** -0.5
    out, lse = flash_forward(q, k, v, scale=scale, causal=True, key_slopes=slopes)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16).cuda()
    dq, dk, dv = flash_backward(dout, q, k, v, out, lse, scale=scale, causal=True, key_slopes=slopes)

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference(*leaves, scale=scale, causal=True, mask=bias64(slopes, 256, 256))
    ref_out.backward(dout.double())
    assert_close(out, ref_out.detach(), OUT_TOL[torch.bfloat16])
    torch.testing.assert_close(lse.double(), ref_lse.detach(), rtol=1e-4, atol=1e-3)
    for got, leaf in zip((dq, dk, dv), leaves):
        assert_close(got, leaf.grad, GRAD_TOL[torch.bfloat16])
