"""Attention under symbolic sizes (dynamic=True): F.scaled_dot_product_attention calls, and hand-written
attention whose mask is computed per call (a causal buffer sliced to the length), are fused with batch
and sequence symbolic (the head dim must be static), one compilation for every size, forward and
gradients equal eager; what cannot be proven without a guard, or a mask that would have to be
evaluated at compile time, stays unfused with the reason."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import CountingBackend


class SelfAttention(nn.Module):
    def __init__(self, d=32, heads=2, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * kv_heads * self.hd)
        self.proj = nn.Linear(d, d)

    def forward(self, x, bias=None):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(B, T, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=bias is None,
                                           enable_gqa=self.heads != self.kv_heads)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


def _check_sizes(model, sizes, with_bias=False):
    torch.manual_seed(0)
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for b, t in sizes:
        x = torch.randn(b, t, model.q.in_features, requires_grad=True)
        extra = (torch.randn(b, 1, t, t),) if with_bias else ()
        out, ref = compiled(x, *extra), model(x, *extra)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
        go = torch.randn_like(ref)
        params = (x, model.q.weight, model.kv.weight)
        for got, want in zip(torch.autograd.grad(out, params, go), torch.autograd.grad(ref, params, go)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    return backend


def test_causal_sdpa_is_fused_once_for_every_batch_and_length():
    backend = _check_sizes(SelfAttention(), [(2, 8), (3, 5), (2, 11), (4, 17)])
    assert backend.calls == 1
    assert [s.fused for s in backend.report.attention] == [True]
    wrappers = {g.name: g.wrapper_source for g in backend.report.graphs}
    assert "fxopt_ops.flash_attention(" in wrappers["forward"]
    assert "fxopt_ops.flash_attention_backward(" in wrappers["backward"]
    assert all(g.symbols for g in backend.report.graphs)  # the graphs really are symbolic


def test_grouped_query_sdpa_with_symbolic_lengths():
    backend = _check_sizes(SelfAttention(d=64, heads=4, kv_heads=2), [(2, 8), (3, 13)])
    site = backend.report.attention[0]
    assert site.fused and site.kv_groups == 2


def _repeat_interleave_gqa(q, k, v):
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1) @ v


def test_hand_written_grouped_query_with_symbolic_head_counts():
    """Under dynamic=True dynamo makes the head counts symbols too (q's 2*s0 against k's s0): the group
    size is still the whole number 2 for every size, so the site fuses (a sweep found it left unfused)."""
    backend = CountingBackend()
    compiled = torch.compile(_repeat_interleave_gqa, backend=backend, dynamic=True)
    g = torch.Generator().manual_seed(0)
    for b, kv_heads, t in ((2, 2, 8), (3, 3, 11), (2, 4, 5)):
        q = torch.randn(b, 2 * kv_heads, t, 16, generator=g, requires_grad=True)
        k, v = (torch.randn(b, kv_heads, t, 16, generator=g, requires_grad=True) for _ in range(2))
        out = compiled(q, k, v)
        q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
        ref = _repeat_interleave_gqa(q64, k64, v64)
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
        for got, want in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q64, k64, v64))):
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    assert backend.report.attention and all(s.fused and s.kv_groups == 2 for s in backend.report.attention)


def test_additive_mask_input_with_symbolic_sizes_is_read_by_the_kernel():
    backend = _check_sizes(SelfAttention(), [(2, 8), (3, 6)], with_bias=True)
    site = backend.report.attention[0]
    assert site.fused and "additive" in site.mask and "safe softmax" in site.mask


def _cross(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_causal_with_lengths_not_provably_equal_stays_unfused_and_exact():
    """q and k lengths are separate symbols: SDPA aligns top-left, the kernel bottom-right; they agree
    only when the lengths are equal, which fxopt cannot prove without adding a guard."""
    backend = CountingBackend()
    compiled = torch.compile(_cross, backend=backend)
    for tq, tk in [(4, 9), (6, 11)]:
        q, k, v = torch.randn(1, 2, tq, 16), torch.randn(1, 2, tk, 16), torch.randn(1, 2, tk, 16)
        for t in (q, k, v):
            torch._dynamo.mark_dynamic(t, 2)  # the lengths symbolic, the head dim static
        torch.testing.assert_close(compiled(q, k, v), _cross(q, k, v), rtol=1e-5, atol=1e-6)
    site = backend.report.attention[0]
    assert not site.fused and "may differ" in site.reason


class HandWritten(nn.Module):
    """nanoGPT's attention: a registered tril buffer sliced to the length, masked_fill with -inf."""

    def __init__(self, d=32, heads=2, max_len=32, fill=float("-inf")):
        super().__init__()
        self.heads, self.hd, self.fill = heads, d // heads, fill
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * d)
        self.proj = nn.Linear(d, d)
        self.register_buffer("bias", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool)).view(1, 1, max_len, max_len))

    def forward(self, x):
        B, T, C = x.shape
        q = self.q(x).view(B, T, self.heads, self.hd).transpose(1, 2)
        k, v = (t.view(B, T, self.heads, self.hd).transpose(1, 2) for t in self.kv(x).split(C, dim=2))
        att = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(self.hd))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, self.fill)
        y = torch.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


def test_hand_written_attention_with_a_sliced_causal_buffer_is_causal_for_every_length():
    """bias[:, :, :T, :T] of a tril buffer: every top-left square of it is causal, so the kernel gets the
    causal fact (block skipping, no mask read) for every length, and the buffer is guarded."""
    backend = _check_sizes(HandWritten(), [(2, 8), (3, 5), (2, 17)])
    assert backend.calls <= 2  # dynamo may call the backend twice on the very first call
    site = backend.report.attention[-1]
    assert site.fused and site.causal and "sliced to the length" in site.mask, site


def test_finite_fill_of_a_sliced_causal_buffer_is_causal_too():
    """HF's finfo.min instead of -inf: a causal mask leaves every row a key, so exp() drops the fill."""
    backend = _check_sizes(HandWritten(fill=torch.finfo(torch.float32).min), [(2, 8), (3, 5)])
    site = backend.report.attention[-1]
    assert site.fused and site.causal, site


def test_a_sliced_buffer_that_is_not_causal_is_read_per_call():
    """An anti-causal (triu) buffer: not the causal fact; with a -inf fill the kernel reads the mask."""
    model = HandWritten()
    model.bias.copy_(torch.triu(torch.ones(32, 32, dtype=torch.bool)).view(1, 1, 32, 32))
    backend = _check_sizes(model, [(2, 8), (3, 5)])
    site = backend.report.attention[-1]
    assert site.fused and not site.causal and "read by the kernel" in site.mask, site


def test_changing_the_sliced_buffer_after_compiling_runs_it_unfused():
    """A changed causal buffer is never used as causal: the call runs the captured graph (buffer_guards.py)."""
    model = HandWritten()
    compiled = torch.compile(model, backend=CountingBackend(), dynamic=True)
    compiled(torch.randn(2, 8, 32))
    compiled(torch.randn(3, 5, 32))
    with torch.no_grad():
        model.bias[..., 0, 1] = True  # no longer causal
        x = torch.randn(2, 7, 32)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


def test_a_constant_mask_over_a_symbolic_batch_is_evaluated_at_compile_time():
    """Only the batch symbolic (the length static): the sliced buffer is a compile-time constant and
    must still give the causal fact (it broadcasts over the symbolic batch). The GPT-2 block of the
    benchmarks (buffer as long as the sequence) lost its fused attention under dynamic=True this way."""
    torch.manual_seed(0)
    model = HandWritten(max_len=8)
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend)
    for b in (2, 3, 5):
        x = torch.randn(b, 8, 32)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    assert backend.calls == 1
    site = backend.report.attention[-1]
    assert site.fused and site.causal and "sliced" not in site.mask, site
    assert backend.report.graphs[0].symbols  # the batch really is symbolic


class ScaledBufferMask(HandWritten):
    """The sliced buffer times a value of the sizes before the comparison: not the sliced causal shape
    (its entries may change with the length), so read per call; compiling it must not fail."""

    def forward(self, x):
        B, T, C = x.shape
        q = self.q(x).view(B, T, self.heads, self.hd).transpose(1, 2)
        k, v = (t.view(B, T, self.heads, self.hd).transpose(1, 2) for t in self.kv(x).split(C, dim=2))
        att = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(self.hd))
        keep = self.bias[:, :, :T, :T] * (1.0 / T)
        att = att.masked_fill(keep == 0, float("-inf"))
        y = torch.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


def test_a_sliced_buffer_combined_with_a_value_of_the_sizes_compiles_and_is_exact():
    backend = _check_sizes(ScaledBufferMask(), [(2, 8), (3, 5)])
    site = backend.report.attention[-1]
    assert site.fused and "sliced to the length" not in site.mask, site
