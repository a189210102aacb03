"""Near misses of the attention matcher, found by a correctness sweep: each spelling looks like attention
but is not the fused op's math, so it must stay unfused (and equal eager) or fail cleanly. A wrong match is
silent: these would have returned wrong numbers (or crashed at run time) before."""
from __future__ import annotations

import torch
import torch.nn as nn

import fxopt
from tests.helpers import compile_fxopt, to64

T, D = 20, 16


def _qkv(device, h=2, kv_heads=None):
    g = torch.Generator().manual_seed(0)
    make = lambda heads: torch.randn(1, heads, T, D, generator=g).to(device)  # noqa: E731
    return make(h), make(kv_heads or h), make(kv_heads or h)


def _unfused_and_equal(fn, *inputs, why: str, in64: bool = True):
    """Unfused with `why` in the reason, and equal to eager (in float64, or as given where the function
    casts to a fixed dtype itself)."""
    rep = fxopt.explain(fn, *inputs)
    assert rep.attention and not any(s.fused for s in rep.attention), [str(s) for s in rep.attention]
    assert any(why in (s.reason or "") for s in rep.attention), [s.reason for s in rep.attention]
    got = compile_fxopt(fn)(*inputs)
    want = fn(*[to64(x) for x in inputs]) if in64 else fn(*inputs)
    torch.testing.assert_close(got.to(want.dtype), want, rtol=1e-4, atol=1e-5)


def test_a_finite_fill_scaled_afterwards_is_not_a_mask(device):
    """-1e5 then * 1e-5: the masked scores are -1, not dropped by exp()."""
    def f(q, k, v):
        s = (q @ k.mT).masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool, device=q.device), 1), -1e5)
        return torch.softmax(s * 1e-5, -1) @ v
    _unfused_and_equal(f, *_qkv(device), why="before a scale")


def test_lossy_casts_of_scores_or_probabilities_are_not_dropped(device):
    q, k, v = _qkv(device)
    _unfused_and_equal(lambda q, k, v: torch.softmax((q @ k.mT * 3.0).to(torch.int32).to(torch.float32), -1) @ v,
                       q, k, v, why="casts the scores", in64=False)
    _unfused_and_equal(lambda q, k, v: torch.softmax(q @ k.mT * 0.25, -1).half().float() @ v,
                       q, k, v, why="casts the probabilities", in64=False)


def test_a_head_permuting_index_is_not_a_grouped_query_repeat(device):
    def rkv(x, n):
        b, h, t, d = x.shape
        return x[:, [1, 0], None].expand(b, h, n, t, d).reshape(b, h * n, t, d)

    q, k, v = _qkv(device, h=4, kv_heads=2)
    fn = lambda q, k, v: torch.softmax(q @ rkv(k, 2).mT * 0.25, -1) @ rkv(v, 2)  # noqa: E731
    rep = fxopt.explain(fn, q, k, v)
    assert not any("grouped-query" in r for s in rep.attention for r in getattr(s, "recognised", []))
    torch.testing.assert_close(compile_fxopt(fn)(q, k, v).double(), fn(*map(to64, (q, k, v))), rtol=1e-4, atol=1e-5)


class _BufferScale(nn.Module):
    def __init__(self, shape=()):
        super().__init__()
        self.register_buffer("t", torch.full(shape, 0.3))

    def forward(self, q, k, v):
        return torch.softmax(q @ k.mT * self.t, -1) @ v


def test_a_scale_held_in_a_buffer_follows_in_place_updates(device):
    m = _BufferScale().to(device)
    q, k, v = _qkv(device)
    f = torch.compile(m, backend="fxopt")
    f(q, k, v)
    m.t.fill_(2.0)
    torch.testing.assert_close(f(q, k, v), m(q, k, v), rtol=1e-4, atol=1e-5)


def test_a_scale_tensor_that_adds_dims_keeps_eagers_shape(device):
    m = _BufferScale((1, 1, 1, 1)).to(device)
    q, k, v = (x[0] for x in _qkv(device))  # 3-D scores times a [1, 1, 1, 1] tensor: a 4-D result in eager
    got, want = torch.compile(m, backend="fxopt")(q, k, v), m(q, k, v)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_masks_that_grow_the_scores_or_are_not_float_stay_unfused(device):
    q, k, v = _qkv(device, h=1)
    pad = torch.zeros(2, 1, 1, T, device=device)
    pad[1, ..., -3:] = float("-inf")
    _unfused_and_equal(lambda q, k, v, m: torch.softmax(q @ k.mT * 0.25 + m, -1) @ v, q, k, v, pad,
                       why="larger shape")
    keep = torch.rand(1, 1, T, T, device=device) > 0.3
    _unfused_and_equal(lambda q, k, v, m: torch.softmax(q @ k.mT * 0.25 + m, -1) @ v, q, k, v, keep,
                       why="dtype torch.bool")


def test_a_nan_fill_is_not_a_mask(device):
    """masked_fill(causal, NaN): eager's softmax makes every row with a masked key NaN; the NaN passed the
    `fill <= -65504` test as a dropped score (NaN comparisons are False) and the site fused as causal."""
    def f(q, k, v):
        keep = torch.tril(torch.ones(T, T, dtype=torch.bool, device=q.device))
        return (q @ k.mT * 0.25).masked_fill(~keep, float("nan")).softmax(-1) @ v
    rep = fxopt.explain(f, *_qkv(device))
    assert not any(s.fused for s in rep.attention) and "nan" in rep.attention[0].reason
    got = compile_fxopt(f)(*_qkv(device))
    torch.testing.assert_close(got, f(*_qkv(device)), equal_nan=True)
    assert got[..., :-1, :].isnan().all() and not got[..., -1, :].isnan().any()


def test_a_mask_that_requires_grad_fuses_under_no_grad(device):
    """No backward is built under no_grad, so the kernel's missing mask gradient does not matter (the site
    stayed unfused with 'the additive mask requires grad'); with grad enabled it stays unfused."""
    q, k, v = _qkv(device)
    mask = torch.randn(1, 1, T, T, device=device, requires_grad=True)

    def f(q, k, v, m):
        return torch.softmax(q @ k.mT * 0.25 + m, -1) @ v

    with torch.no_grad():
        site = fxopt.explain(f, q, k, v, mask).attention[0]
        assert site.fused, site
        torch.testing.assert_close(compile_fxopt(f)(q, k, v, mask), f(q, k, v, mask), rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()
    assert not fxopt.explain(f, q, k, v, mask).attention[0].fused
