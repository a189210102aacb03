"""An input mask filled with a finite value (HF's `masked_fill(~mask, torch.finfo(dtype).min)`): the kernels
read it as an additive mask of fp32's finfo.min, which they drop as eager's equal fills, so a query row
masked entirely is the uniform average, as in eager. Fused for inference; in training it stays unfused
(eager's fill gives such a row 0 in dq and dk, the kernels' backward would not), with the reason."""
from __future__ import annotations

import pytest
import torch

import fxopt
from tests.helpers import compile_fxopt, to64

T, D = 6, 16


def f(q, k, v, keep):
    s = (q @ k.mT) * 0.25
    return s.masked_fill(~keep, torch.finfo(s.dtype).min).softmax(-1) @ v


def g(q, k, v, keep):
    s = torch.where(keep, (q @ k.mT) * 0.25, -65504.0)
    return torch.softmax(s, -1) @ v


def _inputs(device, dtype):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, T, D, generator=gen).to(dtype).to(device) for _ in range(3))
    keep = torch.rand(2, 1, T, T, generator=gen) > 0.5
    keep[0, :, 1] = False  # a query row masked entirely
    keep[:, :, :, 0] = True
    keep[0, :, 1, 0] = False
    return q, k, v, keep.to(device)


@pytest.mark.parametrize("fn", [f, g], ids=["masked_fill_finfo_min", "where_65504"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_finite_input_fill_fuses_for_inference(fn, dtype, device):
    inputs = _inputs(device, dtype)
    sites = fxopt.explain(fn, *inputs).attention
    assert [s.fused for s in sites] == [True], [str(s) for s in sites]
    with torch.no_grad():
        got = compile_fxopt(fn)(*inputs)
    want = fn(*[to64(x) for x in inputs])
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(got[0, :, 1].double(), want[0, :, 1], rtol=tol, atol=tol)  # the uniform average


def test_finite_input_fill_in_training_stays_unfused_and_exact(device):
    q, k, v, keep = _inputs(device, torch.float32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = [to64(t).requires_grad_() for t in (q, k, v)]
    weight = torch.linspace(-1, 1, D, device=device)
    (compile_fxopt(f)(*leaves, keep) * weight).sum().backward()
    (f(*ref, keep) * weight.double()).sum().backward()
    for a, b in zip(leaves, ref):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-5, atol=1e-5)
    rep = fxopt.explain(f, *leaves, keep)
    assert [s.fused for s in rep.attention] == [False] and "training" in rep.attention[0].reason


def test_a_causal_fill_and_an_input_fill_of_other_finite_values_stay_unfused(device):
    """-65504 for the future keys, fp32's finfo.min for the padding: a row the padding masks entirely
    averages the future keys in eager (the higher level); the kernel reads one dropped level."""
    def h(q, k, v, keep):
        s = (q @ k.mT) * 0.25
        s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool, device=q.device), 1), -65504.0)
        return s.masked_fill(~keep, torch.finfo(s.dtype).min).softmax(-1) @ v
    q, k, v, _ = _inputs(device, torch.float32)
    keep = torch.ones(2, 1, 1, T, dtype=torch.bool, device=device)
    keep[0, ..., :3] = False
    sites = fxopt.explain(h, q, k, v, keep).attention
    assert [s.fused for s in sites] == [False] and "different finite values" in sites[0].reason
    with torch.no_grad():
        got = compile_fxopt(h)(q, k, v, keep)
    torch.testing.assert_close(got.double(), h(*[to64(x) for x in (q, k, v)], keep), rtol=1e-5, atol=1e-5)


def test_an_additive_fp16_min_over_every_key_keeps_the_scores_near_zero(device):
    """fp16's finfo.min added in fp32 keeps the scores (a row masked everywhere is softmax(s)); a score under
    0.004 rounds into the mask value itself, and the kernels took that key for dropped: at their stand-in
    score it outweighed every other key of the row (the fuzzer: rows off by 2.9)."""
    def h(q, k, v, mask):
        return torch.softmax((q @ k.mT) * 0.25 + mask, -1) @ v
    q, k, v, _ = _inputs(device, torch.float32)
    k[..., 0, :] = 0.0  # key 0 scores exactly 0 in every row
    mask = torch.full((2, 1, 1, T), -65504.0, device=device)
    with torch.no_grad():
        got = compile_fxopt(h)(q, k, v, mask)
    torch.testing.assert_close(got.double(), h(*[to64(x) for x in (q, k, v, mask)]), rtol=2e-2, atol=2e-2)
