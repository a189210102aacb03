"""The attention matcher: every spelling the issue lists is found (structure asserted through
rep.attention) and the compiled result equals eager in float64; sites that must not match stay unfused
with a reason. On the CPU the fused op runs fxopt's Triton kernels in the interpreter (conftest sets
TRITON_INTERPRET=1); the same tests run on CUDA when a GPU is present."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import fxopt
from tests.helpers import assert_close_to_reference, compile_fxopt, to64

B, H, T, D = 2, 2, 12, 16


def qkv(device, dtype=torch.float32, b=B, h=H, t=T, d=D, kv_heads=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, d, generator=g, dtype=dtype).to(device)
    k = torch.randn(b, kv_heads or h, t, d, generator=g, dtype=dtype).to(device)
    v = torch.randn(b, kv_heads or h, t, d, generator=g, dtype=dtype).to(device)
    return q, k, v


def fused_sites(fn, *inputs):
    rep = fxopt.explain(fn, *inputs)
    return [s for s in rep.attention if s.fused], [s for s in rep.attention if not s.fused], rep


def check(fn, *inputs, dtype=torch.float32):
    """Compiled == eager evaluated in float64."""
    out = compile_fxopt(fn)(*inputs)
    ref = fn(*[to64(x) for x in inputs])
    assert_close_to_reference(out, ref, dtype)


# ------------------------------------------------------------------ spellings that must fuse

def gpt2_masked_fill(q, k, v):
    t = q.shape[-2]
    bias = torch.tril(torch.ones(32, 32, dtype=torch.bool, device=q.device)).view(1, 1, 32, 32)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
    att = att.masked_fill(bias[:, :, :t, :t] == 0, float("-inf"))
    att = F.softmax(att, dim=-1)
    att = F.dropout(att, 0.1, training=False)
    return att @ v


def triu_masked_fill_div(q, k, v):
    t = q.shape[-2]
    mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=q.device), diagonal=1)
    s = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.shape[-1])
    return torch.matmul(s.masked_fill(mask, float("-inf")).softmax(dim=-1), v)


def additive_full_triu(q, k, v):
    t = q.shape[-2]
    mask = torch.full((t, t), float("-inf"), device=q.device).triu(1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + mask
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def scale_split_over_q_and_k_permute(q, k, v):
    scale = q.shape[-1] ** -0.25
    kt = k.permute(0, 1, 3, 2) * scale
    return torch.softmax((q * scale) @ kt, dim=-1) @ v


def permute_dims_keyword(q, k, v):
    """k.permute(dims=...): the dims as a keyword (the matcher once read only positional dims)."""
    return torch.softmax(q @ k.permute(dims=(0, 1, 3, 2)) * 0.5, dim=-1) @ v


def bmm_three_d(q, k, v):
    b, h, t, d = q.shape
    q3, k3, v3 = (x.reshape(b * h, t, d) for x in (q, k, v))
    p = torch.bmm(q3, k3.transpose(1, 2)).div(math.sqrt(d)).softmax(-1)
    return torch.bmm(p, v3).view(b, h, t, d)


SPELLINGS = {
    "gpt2_masked_fill": (gpt2_masked_fill, True, 0.25),
    "triu_masked_fill_div": (triu_masked_fill_div, True, 0.25),
    "additive_full_triu_fp32_softmax": (additive_full_triu, True, 0.25),
    "scale_split_q_k_permute": (scale_split_over_q_and_k_permute, False, 0.25),
    "bmm_three_d": (bmm_three_d, False, 0.25),
    "permute_dims_keyword": (permute_dims_keyword, False, 0.5),
}


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_spelling_is_fused_and_exact(name, device):
    fn, causal, scale = SPELLINGS[name]
    q, k, v = qkv(device)
    fused, unfused, _ = fused_sites(fn, q, k, v)
    assert len(fused) == 1 and not unfused, [str(s) for s in unfused]
    assert fused[0].causal is causal
    assert fused[0].scale == pytest.approx(scale)
    check(fn, q, k, v)


def test_fp16_softmax_in_fp32_with_casts(device):
    q, k, v = qkv(device, torch.float16)
    fused, _, _ = fused_sites(additive_full_triu, q, k, v)
    assert len(fused) == 1 and fused[0].causal
    check(additive_full_triu, q, k, v, dtype=torch.float16)


def test_probabilities_cast_back_then_dropout_in_eval_fuse(device):
    """HF GPT-2 under mixed precision: softmax in fp32, `.type(value.dtype)`, `attn_dropout` in eval mode,
    then P @ V (the cast's user was the dropout, not the matmul, so the site stayed unfused); a cast to a
    dtype the matmul does not compute in still refuses."""
    def f(q, k, v, out_dtype=None):
        p = torch.softmax((q @ k.mT).float() * D ** -0.5, -1).type(v.dtype)
        p = F.dropout(p, 0.1, training=False)
        return p @ v if out_dtype is None else p.to(out_dtype) @ v.to(out_dtype)
    q, k, v = qkv(device, torch.float16)
    fused, _, _ = fused_sites(f, q, k, v)
    assert len(fused) == 1
    check(f, q, k, v, dtype=torch.float16)
    g = lambda q, k, v: f(q, k, v, torch.float32)  # noqa: E731 - P rounded to fp16, then P @ V in fp32
    fused, unfused, _ = fused_sites(g, q, k, v)
    assert not fused and "casts the probabilities" in unfused[0].reason


def test_query_shorter_than_keys_is_causal_bottom_right(device):
    q, _, _ = qkv(device, t=5)
    _, k, v = qkv(device, t=T, seed=1)

    def kv_cache_step(q, k, v):  # GPT-2 slices its causal buffer [Tk - Tq : Tk, :Tk]
        tq, tk = q.shape[-2], k.shape[-2]
        bias = torch.tril(torch.ones(32, 32, dtype=torch.bool, device=q.device))
        s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        s = torch.where(bias[tk - tq:tk, :tk], s, torch.finfo(s.dtype).min)
        return F.softmax(s, dim=-1) @ v

    fused, _, _ = fused_sites(kv_cache_step, q, k, v)
    assert len(fused) == 1 and fused[0].causal
    check(kv_cache_step, q, k, v)


def test_grouped_query_repeat_interleave(device):
    q, k, v = qkv(device, h=4, kv_heads=2)

    def gqa(q, k, v):
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        return torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1) @ v

    fused, _, _ = fused_sites(gqa, q, k, v)
    assert len(fused) == 1 and fused[0].kv_groups == 2
    check(gqa, q, k, v)


def test_existing_sdpa_call_is_taken_over(device):
    q, k, v = qkv(device)
    keep = torch.rand(B, 1, 1, T, generator=torch.Generator().manual_seed(3)).to(device) > 0.3
    keep[..., 0] = True

    def sdpa(q, k, v, keep):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True) + \
            F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    fused, _, _ = fused_sites(sdpa, q, k, v, keep)
    assert len(fused) == 2 and {s.causal for s in fused} == {True, False}
    assert any("bool" in s.mask and "safe softmax" in s.mask for s in fused)
    check(sdpa, q, k, v, keep)


def test_sdpa_with_a_row_masked_entirely_equals_eager(device):
    """SDPA gives 0 for a row its mask removes entirely (and 0 gradients); a sweep found fxopt's kernels
    giving NaN there. The fused op now runs them with SDPA's safe softmax (test_safe_softmax.py)."""
    q, k, v = (x.requires_grad_() for x in qkv(device))
    keep = torch.ones(1, 1, T, T, dtype=torch.bool, device=device)
    keep[..., 3, :] = False
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=keep)  # noqa: E731
    out = compile_fxopt(fn)(q, k, v)
    want = fn(q, k, v)
    assert not out.isnan().any()
    torch.testing.assert_close(out, want)
    for got, ref in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v))):
        torch.testing.assert_close(got, ref)


# ------------------------------------------------------------------ must not fuse (and stay exact)

def softmax_over_queries(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1), dim=-2) @ v


def weights_also_returned(q, k, v):
    p = torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1)
    return p @ v, p


def mask_from_values(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    return torch.softmax(s.masked_fill(s < 0, float("-inf")), dim=-1) @ v


def dropout_in_training(q, k, v):
    return F.dropout(torch.softmax(q @ k.transpose(-2, -1), dim=-1), p=0.5, training=True) @ v


NEGATIVE = {
    "softmax_over_queries": (softmax_over_queries, "not the last"),
    "weights_also_returned": (weights_also_returned, "used outside the attention"),
    "mask_from_values": (mask_from_values, "used outside the attention"),
    "dropout_in_training": (dropout_in_training, "dropout"),
}


@pytest.mark.parametrize("name", list(NEGATIVE))
def test_sites_that_must_not_fuse_stay_exact_with_a_reason(name, device):
    fn, reason = NEGATIVE[name]
    q, k, v = qkv(device)
    fused, unfused, _ = fused_sites(fn, q, k, v)
    assert not fused
    assert len(unfused) == 1 and reason in unfused[0].reason, unfused[0].reason
    if name != "dropout_in_training":
        check(fn, q, k, v)


def test_head_dim_outside_the_kernels_range_is_refused(device):
    q, k, v = qkv(device, d=8)
    fused, unfused, _ = fused_sites(triu_masked_fill_div, q, k, v)
    assert not fused and "head dim 8" in unfused[0].reason
    check(triu_masked_fill_div, q, k, v)


def test_plain_softmax_is_not_an_attention_site(device):
    x = torch.randn(4, 16, device=device)
    rep = fxopt.explain(lambda x: torch.softmax(x * 2, -1), x)
    assert rep.attention == []


def test_attention_disabled_by_option(device):
    q, k, v = qkv(device)
    rep = fxopt.explain(gpt2_masked_fill, q, k, v, attention=False)
    assert rep.attention == [] and "fuse_attention" not in [p.name for p in rep.pre_autograd]


def test_report_text_lists_the_site(device):
    q, k, v = qkv(device)
    text = str(fxopt.explain(gpt2_masked_fill, q, k, v))
    assert "attention sites (1 of 1 fused)" in text and "causal=True" in text


# ------------------------------------------------------------------ buffers read at compile time

class BufferMaskAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(32, 32, dtype=torch.bool)), persistent=False)

    def forward(self, q, k, v):
        t = q.shape[-2]
        s = (q @ k.transpose(-2, -1)) * 0.25
        s = s.masked_fill(self.bias[:t, :t] == 0, float("-inf"))
        return F.softmax(s, dim=-1) @ v


def test_causal_buffer_changed_in_place_is_caught(device):
    if device == "cuda":  # a device-side assertion ends the CUDA context: see it happen in a child process
        code = ("import torch, pytest\n"
                "from tests.attention.test_match_spellings import _change_causal_buffer_after_compiling\n"
                "_change_causal_buffer_after_compiling('cuda')\ntorch.cuda.synchronize()\n")
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                             cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        assert run.returncode != 0 and "device-side assert" in run.stderr, run.stderr[-2000:]
        return
    mod, got, q, k, v = _change_causal_buffer_after_compiling(device)  # on the CPU: the graph runs unfused
    torch.testing.assert_close(got, mod(q, k, v), rtol=1e-4, atol=1e-5)


def _change_causal_buffer_after_compiling(device):
    mod = BufferMaskAttention().to(device)
    q, k, v = qkv(device)
    compiled = compile_fxopt(mod)
    torch.testing.assert_close(compiled(q, k, v), mod(q, k, v), rtol=1e-4, atol=1e-5)
    mod.bias.zero_()
    mod.bias[:, 0] = True  # no longer causal: the compiled kernel would be wrong
    return mod, compiled(q, k, v), q, k, v


def test_buffer_rewritten_with_the_same_values_is_accepted(device):
    mod = BufferMaskAttention().to(device)
    q, k, v = qkv(device)
    compiled = compile_fxopt(mod)
    compiled(q, k, v)
    mod.bias.copy_(torch.tril(torch.ones(32, 32, dtype=torch.bool)))
    torch.testing.assert_close(compiled(q, k, v), mod(q, k, v), rtol=1e-4, atol=1e-5)


def test_dynamic_shapes_with_a_symbolic_head_dim_fuse_with_the_scale_per_call(device):
    """Every size symbolic (q passed in): the scale 1/sqrt(head dim) is a symbolic value, proved equal to
    the default scale, so the fused op computes it per call; results exact at every length.
    (More spellings, and scales that are not the default: tests/attention/test_dynamic_built_masks.py.)"""
    from fxopt.backend import compile_dynamo_graph
    from fxopt.options import Options
    from fxopt.report import Report

    rep = Report()
    compiled = torch.compile(gpt2_masked_fill, dynamic=True,
                             backend=lambda gm, ex: compile_dynamo_graph(gm, ex, Options(), rep))
    for t in (9, 12):
        q, k, v = qkv(device, t=t)
        torch.testing.assert_close(compiled(q, k, v), gpt2_masked_fill(q, k, v), rtol=1e-4, atol=1e-5)
    assert rep.attention and all(s.fused and s.scale is None for s in rep.attention), rep.attention


def test_kv_cache_decode_step_runs_the_split_kv_kernel(device, monkeypatch):
    """A few new tokens over a long cache: matched as causal (bottom-right), run by flash_decode."""
    import fxopt.attention.flash_decode as flash_decode

    calls = []
    real = flash_decode.flash_decode
    monkeypatch.setattr(flash_decode, "flash_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, _, _ = qkv(device, t=3)
    _, k, v = qkv(device, t=300, seed=2)

    def decode_step(q, k, v):
        tq, tk = q.shape[-2], k.shape[-2]
        bias = torch.tril(torch.ones(512, 512, dtype=torch.bool, device=q.device))
        s = (q @ k.transpose(-1, -2)) * 0.25
        s = s.masked_fill(~bias[tk - tq:tk, :tk], float("-inf"))
        return torch.softmax(s, -1) @ v

    fused, _, _ = fused_sites(decode_step, q, k, v)
    assert len(fused) == 1 and fused[0].causal
    check(decode_step, q, k, v)
    assert calls, "the decode kernel did not run"


def test_a_matcher_failure_leaves_the_site_as_written_with_the_reason(device, monkeypatch):
    """Matching only reads the graph, so an unexpected error in it (a matcher bug) must not fail the
    compile: the site stays unfused, exact, and rep.attention says what failed."""
    import fxopt.passes.attention as attention_pass

    def broken(node, values):
        raise RuntimeError("simulated matcher bug")
    monkeypatch.setattr(attention_pass, "match_site", broken)
    q, k, v = qkv(device)
    torch.testing.assert_close(compile_fxopt(gpt2_masked_fill)(q, k, v), gpt2_masked_fill(q, k, v),
                               rtol=1e-4, atol=1e-5)
    site, = fxopt.explain(gpt2_masked_fill, q, k, v).attention
    assert not site.fused and "matcher failed (RuntimeError: simulated matcher bug)" in site.reason
