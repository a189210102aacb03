"""Position biases known at compile time are not causal facts: ALiBi becomes per-head slopes the kernel
computes the bias from, a relative-position table held in a buffer is read by the kernel like a padding
mask, and a causal fill beside either still makes the site causal. A bias that needs a gradient stays
unfused with the reason. Numerics against eager in float64; gradients of q, k, v against eager."""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from tests.attention.test_match_spellings import B, D, H, T, fused_sites
from tests.attention.test_match_spellings import qkv as shared_qkv
from tests.helpers import assert_close_to_reference, compile_fxopt, to64


def qkv(device, requires_grad=False):
    return [t.requires_grad_(requires_grad) for t in shared_qkv(device)]


def alibi_causal(q, k, v):
    t = q.shape[-2]
    slopes = torch.tensor([0.5, 0.25], device=q.device)[None, :, None, None]
    pos = torch.arange(t, device=q.device)
    bias = slopes * (pos[None, :] - pos[:, None]).to(q.dtype)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return s.softmax(-1) @ v


class RelativeBias(nn.Module):
    """A per-head bias table in a buffer (no gradient), added to the scaled scores."""

    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.randn(1, H, T, T, generator=torch.Generator().manual_seed(5)))

    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * D ** -0.5 + self.bias, dim=-1) @ v


class LearnedBias(nn.Module):
    """T5's relative attention bias: an embedding looked up per position pair, so it needs a gradient."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(2 * T, H)

    def forward(self, q, k, v):
        pos = torch.arange(T, device=q.device)
        bias = self.table(pos[None, :] - pos[:, None] + T).permute(2, 0, 1)[None]
        return torch.softmax(q @ k.transpose(-1, -2) + bias, dim=-1) @ v


def sites(fn, *inputs):
    return fused_sites(fn, *inputs)[:2]


def test_alibi_with_a_causal_fill_is_fused_causal_with_slopes(device):
    """ALiBi is linear in the key index: the kernel computes it from one slope per head
    (test_alibi_slopes.py covers the spellings and the kernels)."""
    q, k, v = qkv(device)
    fused, unfused = sites(alibi_causal, q, k, v)
    assert len(fused) == 1 and not unfused, [s.reason for s in unfused]
    assert fused[0].causal
    assert "ALiBi" in fused[0].mask and "read by the kernel" not in fused[0].mask, fused[0].mask
    assert_close_to_reference(compile_fxopt(alibi_causal)(q, k, v), alibi_causal(*map(to64, (q, k, v))),
                              torch.float32)


def test_alibi_gradients_equal_eager(device):
    q, k, v = qkv(device, requires_grad=True)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    weight = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(1)).to(device)
    (compile_fxopt(alibi_causal)(q, k, v) * weight).sum().backward()
    (alibi_causal(q64, k64, v64) * weight.double()).sum().backward()
    for got, ref in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert_close_to_reference(got, ref, torch.float32)


def test_a_bias_table_in_a_buffer_is_read_by_the_kernel(device):
    model = RelativeBias().to(device)
    q, k, v = qkv(device)
    fused, unfused = sites(model, q, k, v)
    assert len(fused) == 1 and not unfused and not fused[0].causal
    ref = RelativeBias().to(device).double()
    ref.bias.copy_(model.bias)
    assert_close_to_reference(compile_fxopt(model)(q, k, v), ref(*map(to64, (q, k, v))), torch.float32)


def test_a_learned_bias_stays_unfused_with_the_reason(device):
    model = LearnedBias().to(device)
    q, k, v = qkv(device)
    fused, unfused = sites(model, q, k, v)
    assert not fused and len(unfused) == 1
    assert "requires grad" in unfused[0].reason, unfused[0].reason
    out = compile_fxopt(model)(q, k, v)
    assert_close_to_reference(out, model.double()(*map(to64, (q, k, v))), torch.float32)


def sliding_window(q, k, v, window=4):
    t = q.shape[-2]
    keep = torch.ones(t, t, dtype=torch.bool, device=q.device).tril().triu(-window)
    s = q @ k.transpose(-1, -2) * D ** -0.5
    return torch.softmax(s.masked_fill(~keep, torch.finfo(s.dtype).min), dim=-1) @ v


def block_diagonal_where(q, k, v):
    t = q.shape[-2]
    block = torch.arange(t, device=q.device) // 4
    s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
    return torch.where(block[:, None] == block[None, :], s, float("-inf")).softmax(-1) @ v


def test_non_causal_compile_time_fills_are_read_by_the_kernel(device):
    """A sliding window (Mistral's band) and a block-diagonal pattern: every row keeps a score, so the
    kernel reads the fill as an additive -inf mask, forward and backward equal to eager."""
    for fn in (sliding_window, block_diagonal_where):
        q, k, v = qkv(device, requires_grad=True)
        fused, unfused = sites(fn, q, k, v)
        assert len(fused) == 1 and not unfused, [s.reason for s in unfused]
        assert not fused[0].causal and "read by the kernel" in fused[0].mask
        q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
        out, ref = compile_fxopt(fn)(q, k, v), fn(q64, k64, v64)
        assert_close_to_reference(out, ref, torch.float32)
        out.sum().backward()
        ref.sum().backward()
        for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
            assert_close_to_reference(got, want, torch.float32)


def test_a_compile_time_fill_that_masks_whole_rows_stays_unfused(device):
    def first_rows_masked(q, k, v):
        t = q.shape[-2]
        rows = torch.arange(t, device=q.device)[:, None] >= 2
        keep = torch.ones(t, t, dtype=torch.bool, device=q.device).tril() & rows
        s = q @ k.transpose(-1, -2) * D ** -0.5
        return torch.softmax(s.masked_fill(~keep, torch.finfo(s.dtype).min), dim=-1) @ v

    q, k, v = qkv(device)
    fused, unfused = sites(first_rows_masked, q, k, v)
    assert not fused and "whole rows" in unfused[0].reason, [s.reason for s in unfused]
    out = compile_fxopt(first_rows_masked)(q, k, v)
    assert_close_to_reference(out, first_rows_masked(*map(to64, (q, k, v))), torch.float32)


def test_a_causal_mask_combined_with_and_is_still_a_compile_time_fact(device):
    """`a & b` is operator.and_ in dynamo's graph: a new value, not an in-place write (its trailing
    underscore once made the mask look written in place, so the site stayed unfused)."""
    def causal_and(q, k, v):
        t = q.shape[-2]
        ones = torch.ones(t, t, dtype=torch.bool, device=q.device)
        keep = ones.tril() & ones
        return torch.softmax((q @ k.transpose(-1, -2) * D ** -0.5).masked_fill(~keep, float("-inf")), -1) @ v

    q, k, v = qkv(device)
    fused, unfused = sites(causal_and, q, k, v)
    assert len(fused) == 1 and fused[0].causal, [s.reason for s in unfused]
    assert_close_to_reference(compile_fxopt(causal_and)(q, k, v), causal_and(*map(to64, (q, k, v))), torch.float32)
