"""Masks read from module buffers at compile time (fxopt/buffer_guards.py): a later call whose buffer no longer
holds the compiled fact (written in place, or another instance's) runs the graph unfused and gets eager's
answer; a mask that hid nothing at compile time (an all-ones buffer, a zero bias) is guarded like a causal one.
CPU (interpreter); on a GPU a buffer written in place at the same address is checked on the device
(test_match_spellings.py runs that path in a child process)."""
from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F

import fxopt
from tests.helpers import compile_fxopt

T = 8


def qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, T, 16, generator=g) for _ in range(3)]


def scores(q, k):
    return (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))


class OnesMask(torch.nn.Module):
    """GPT-2's `masked_fill(bias == 0, -inf)` over a buffer that starts all ones (hides nothing)."""
    def __init__(self, keep=None):
        super().__init__()
        self.register_buffer("bias", torch.ones(1, 1, T, T) if keep is None else keep.float().view(1, 1, T, T))

    def forward(self, q, k, v):
        return scores(q, k).masked_fill(self.bias == 0, float("-inf")).softmax(-1) @ v


class ZeroBias(torch.nn.Module):
    """An additive position bias that is all zeros when compiled (before a checkpoint is loaded)."""
    def __init__(self):
        super().__init__()
        self.register_buffer("pos_bias", torch.zeros(1, 2, T, T))

    def forward(self, q, k, v):
        return (scores(q, k) + self.pos_bias).softmax(-1) @ v


class WhereKeep(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("keep", torch.ones(1, 1, T, T, dtype=torch.bool))

    def forward(self, q, k, v):
        s = scores(q, k)
        return torch.where(self.keep, s, torch.finfo(s.dtype).min).softmax(-1) @ v


class SdpaBoolMask(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("keep", torch.ones(T, T, dtype=torch.bool))

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.keep)


def tril(dtype=torch.bool):
    return torch.tril(torch.ones(T, T, dtype=dtype))


@pytest.mark.parametrize("cls, write, guarded", [
    (OnesMask, lambda m: m.bias.copy_(tril(torch.float32).view(1, 1, T, T)), True),
    (ZeroBias, lambda m: m.load_state_dict({"pos_bias": torch.randn(1, 2, T, T) * 3}), True),
    (WhereKeep, lambda m: m.keep.copy_(tril().view(1, 1, T, T)), True),
    (SdpaBoolMask, lambda m: m.keep.copy_(tril()), False),  # SDPA's attn_mask: read by the kernel per call
], ids=["ones_masked_fill", "zero_bias_loaded", "where_keep", "sdpa_bool"])
def test_a_mask_that_hid_nothing_is_guarded(cls, write, guarded, caplog):
    """The mask was dropped from the site (it hid nothing); a write after compiling used to be ignored:
    unmasked attention, off by 2 against eager."""
    model, (q, k, v) = cls(), qkv()
    torch._dynamo.reset()
    compiled = compile_fxopt(model)
    torch.testing.assert_close(compiled(q, k, v), model(q, k, v), rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        write(model)
    with caplog.at_level(logging.WARNING, logger="fxopt.attention"):
        got = compiled(q, k, v)
    torch.testing.assert_close(got, model(q, k, v), rtol=1e-4, atol=1e-5)
    assert ("no longer holds the value" in caplog.text and "unfused" in caplog.text) == guarded


@pytest.mark.parametrize("first, second", [(tril(), torch.ones(T, T, dtype=torch.bool)),
                                           (torch.ones(T, T, dtype=torch.bool), tril())],
                         ids=["causal_then_ones", "ones_then_causal"])
def test_two_instances_with_different_buffers_share_a_graph(first, second, device):
    """dynamo reuses the graph compiled for the first instance of a class for the second (buffers are graph
    inputs, guarded by shape only): the second instance's calls ran the first one's mask fact (silently
    wrong) or raised 'changed after compilation' for a buffer nobody changed. (On a GPU too: the second
    buffer's address is new, so it is compared on the host once.)"""
    a, b = OnesMask(first).to(device), OnesMask(second).to(device)
    q, k, v = (t.to(device) for t in qkv(1))
    torch._dynamo.reset()
    compiled_a, compiled_b = compile_fxopt(a), compile_fxopt(b)
    for _ in range(2):  # alternating: each instance's verdict is remembered, not recomputed
        torch.testing.assert_close(compiled_a(q, k, v), a(q, k, v), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(compiled_b(q, k, v), b(q, k, v), rtol=1e-4, atol=1e-5)


def test_guarded_buffer_inside_a_checkpoint_region_falls_back_whole():
    """The fallback graph is copied with its checkpoint bodies before their attention is rewritten."""
    model, (q, k, v) = OnesMask(tril()), qkv(2)
    q.requires_grad_(True)

    def f(q, k, v):
        return torch.utils.checkpoint.checkpoint(model, q, k, v, use_reentrant=False)

    torch._dynamo.reset()
    compiled = compile_fxopt(f)
    torch.testing.assert_close(compiled(q, k, v), model(q, k, v), rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        model.bias.fill_(1.0)
    got = compiled(q, k, v)
    torch.testing.assert_close(got, model(q, k, v), rtol=1e-4, atol=1e-5)
    (grad,) = torch.autograd.grad(got.sum(), q)
    (expected,) = torch.autograd.grad(model(q, k, v).sum(), q)
    torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-5)


def test_unchanged_or_rewritten_equal_buffers_keep_the_fused_kernel(caplog):
    """While the buffer holds the fact (untouched, or written with the same values) the fused graph runs:
    no fallback warning."""
    model, (q, k, v) = OnesMask(tril()), qkv(3)
    rep = fxopt.explain(model, q, k, v)
    assert [s.fused for s in rep.attention] == [True] and rep.attention[0].causal
    torch._dynamo.reset()
    compiled = compile_fxopt(model)
    with caplog.at_level(logging.WARNING, logger="fxopt.attention"):
        compiled(q, k, v)
        with torch.no_grad():
            model.bias.copy_(tril(torch.float32).view(1, 1, T, T))
        torch.testing.assert_close(compiled(q, k, v), model(q, k, v), rtol=1e-4, atol=1e-5)
    assert "no longer holds" not in caplog.text
