"""A causal mask with a finite fill beside an input-dependent padding mask (found by
benchmarks/attention_fuzz.py): in a left-padded query row every visible key is masked, and eager averages
the future keys, which hold the fill. Beside an additive -inf padding mask the fused site was NaN there;
beside a bool one, with a fill the kernel's sum keeps the score of (fp16's -65504), it weighted those keys
by exp(s). Both rows now equal eager (float64)."""
from __future__ import annotations

import pytest
import torch

import fxopt
from tests.helpers import compile_fxopt, to64

T, D = 6, 16


def _qkv(device, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 2, T, D, generator=g).to(dtype).to(device) for _ in range(3)]


def _causal(s, fill, spelling):
    tril = torch.tril(torch.ones(T, T, dtype=torch.bool, device=s.device))
    return torch.where(tril, s, fill) if spelling == "where" else s.masked_fill(~tril, fill)


def _left_padding(device, additive):
    keep = torch.ones(2, 1, 1, T, dtype=torch.bool, device=device)
    keep[0, ..., :2] = False  # batch 0: query rows 0 and 1 see no unmasked key
    if not additive:
        return keep
    return torch.zeros(keep.shape, device=device).masked_fill(~keep, float("-inf"))


def _check(fn, *inputs, tol=1e-5):
    sites = fxopt.explain(fn, *inputs).attention
    assert [s.fused for s in sites] == [True], [str(s) for s in sites]
    got = compile_fxopt(fn)(*inputs)
    want = fn(*[to64(x) for x in inputs])
    assert got.isfinite().all()
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("fill", [-65504.0, -1e9, float(torch.finfo(torch.float32).min)])
@pytest.mark.parametrize("spelling", ["where", "masked_fill"])
@pytest.mark.parametrize("causal_first", [True, False])
def test_finite_causal_fill_beside_additive_inf_padding(fill, spelling, causal_first, device):
    def f(q, k, v, mask):
        s = (q @ k.mT) * 0.25
        s = (_causal(s, fill, spelling) + mask) if causal_first else _causal(s + mask, fill, spelling)
        return s.softmax(-1) @ v
    _check(f, *_qkv(device), _left_padding(device, additive=True))


@pytest.mark.parametrize("fill", [-65504.0, -1e9])
@pytest.mark.parametrize("causal_first", [True, False])
def test_finite_causal_fill_beside_bool_padding(fill, causal_first, device):
    def f(q, k, v, keep):
        s = (q @ k.mT) * 0.25
        if causal_first:
            return _causal(s, fill, "where").masked_fill(~keep, float("-inf")).softmax(-1) @ v
        return _causal(s.masked_fill(~keep, float("-inf")), fill, "where").softmax(-1) @ v
    _check(f, *_qkv(device), _left_padding(device, additive=False))


def test_fp16_finfo_min_fill_beside_bool_padding(device):
    """The fuzzer's case: fp16 scores, `finfo(float16).min` as the causal fill, a bool padding mask."""
    def f(q, k, v, keep):
        s = (q @ k.mT) * 0.25
        s = s.masked_fill(~keep, float("-inf"))
        return _causal(s, torch.finfo(s.dtype).min, "masked_fill").softmax(-1) @ v
    _check(f, *_qkv(device, torch.float16), _left_padding(device, additive=False), tol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_additive_padding_folds_without_overflow(dtype, device):
    """The fold writes fp32's finfo.min beside a 16-bit additive mask: the mask is read in fp32 (writing
    the value into an fp16/bf16 mask raised an overflow error on CUDA, found by the GPU fuzzer; the CPU
    wrote -inf)."""
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("the interpreter computes tl.dot on bf16 wrongly: checked on the GPU")

    def f(q, k, v, mask):
        s = (q @ k.mT) * 0.25 + mask
        tq, tk = s.shape[-2:]
        future = torch.triu(torch.ones(tq, tk, dtype=torch.bool, device=q.device), diagonal=tk - tq + 1)
        return torch.softmax(s.masked_fill(future, torch.finfo(s.dtype).min).float(), -1).type_as(v) @ v
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, t, D, generator=g).to(dtype).to(device) for t in (3, 22, 22))
    mask = torch.zeros(1, 1, 3, 22, dtype=dtype, device=device)
    mask[..., :8] = torch.finfo(dtype).min  # every query row keeps unpadded keys
    _check(f, q, k, v, mask, tol=1e-2)
