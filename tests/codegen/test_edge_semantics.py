"""Eager's semantics at the edges, where a fused kernel can silently differ: NaN bounds of clamp, scalars
that eager rounds to bf16/fp16 before comparing or selecting, integer max above 2^24, and a +inf entry
in a row long enough for the looped (online) softmax. Each case asserts the ops ran in a Triton kernel
(so the check is of fxopt's code, not of an eager fallback) and compares with eager, which matches
float64 here (checked in the float cases)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxopt
from helpers import compile_fxopt, to64

NAN, INF = float("nan"), float("inf")


def fused(fn, *inputs) -> set[str]:
    """The ATen ops that ran inside fxopt's generated kernels (forward or inference graph)."""
    rep = fxopt.explain(fn, *inputs)
    return {op for k in rep.kernels if k.graph in ("forward", "inference") for op in k.ops}


def assert_matches_eager(fn, *inputs):
    expected = fn(*inputs)
    got = compile_fxopt(fn)(*inputs)
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, equal_nan=True, rtol=1e-5, atol=1e-6)
    return got


@pytest.mark.parametrize("case", ["scalar_min", "scalar_max", "tensor_min", "tensor_max", "hardtanh_nan"])
def test_clamp_with_a_nan_bound_matches_eager(case, device):
    x = torch.tensor([1.0, -2.0, NAN, 5.0, 0.25], device=device)
    b = torch.tensor([NAN, 0.0, 0.0, 9.0, NAN], device=device)
    fn = {"scalar_min": lambda a, b: (a * 1).clamp(min=NAN) + 0,
          "scalar_max": lambda a, b: (a * 1).clamp(min=0.0, max=NAN) + 0,
          "tensor_min": lambda a, b: torch.clamp(a * 1, min=b) + 0,
          "tensor_max": lambda a, b: torch.clamp(a * 1, max=b) + 0,
          "hardtanh_nan": lambda a, b: F.hardtanh(a * 1, NAN, 1.0) + 0}[case]
    rep = fxopt.explain(fn, x, b)
    clamped = any("clamp" in op or "hardtanh" in op for k in rep.kernels for op in k.ops)
    if case.startswith("tensor"):
        assert clamped
        got = assert_matches_eager(fn, x, b)
        torch.testing.assert_close(got.double(), fn(to64(x), to64(b)), equal_nan=True)
    else:
        # eager gives NaN on the CPU and ignores a NaN scalar bound on CUDA (fmax): the node runs as eager
        assert not clamped and "NaN clamp bound" in str(rep)
        assert_matches_eager(fn, x, b)


def test_clamp_with_number_bounds_keeps_its_values(device):
    x = torch.tensor([1.0, -2.0, NAN, 5.0, 0.25], device=device)
    assert_matches_eager(lambda a: (a * 1).clamp(-1.0, 2.0) + 0, x)
    assert_matches_eager(lambda a: (a * 1).clamp(2.0, 1.0) + 0, x)  # min > max: max wins, as in eager


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["eq", "ge", "lt", "zero_dim", "where", "clamp", "clamp_eq"])
def test_scalars_rounded_like_eager_in_comparisons_and_selections(case, dtype, device):
    """`h == 0.1` on fp16 compares with fp16(0.1) in eager (the common dtype), not with fp32's 0.1."""
    h = torch.tensor([0.1, 0.2, 1 / 3, 0.3, 0.15, 0.05], device=device).to(dtype)
    t = torch.tensor(0.1, device=device)  # a 0-d fp32 tensor: fp16 is still the common dtype
    fn = {"eq": lambda a, t: (a * 1) == 0.1,
          "ge": lambda a, t: (a * 1) >= 1 / 3,
          "lt": lambda a, t: (a * 1) < 0.3,
          "zero_dim": lambda a, t: (a * 1) >= t,
          "where": lambda a, t: torch.where(a > 0.15, a * 1, 0.1) == 0.1,
          "clamp": lambda a, t: (a * 1).clamp(min=0.15) * 1,
          "clamp_eq": lambda a, t: (a * 1).clamp(min=0.15) == 0.15}[case]
    assert fused(fn, h, t), "the comparison ran in eager, not in a kernel"
    got = assert_matches_eager(fn, h, t)
    if got.dtype == torch.bool:
        assert got.any() and not got.all(), "the case must be able to fail"


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("kind", ["amax", "amin"])
def test_integer_max_beyond_float32_precision(kind, dtype, device):
    """Values above 2^24 are not representable in fp32: an integer max must stay integer."""
    x = torch.tensor([[16777216, 5, -3], [123456788, 7, -123456789]], dtype=dtype, device=device)
    fn = (lambda a: (a + 1).amax(-1) * 1) if kind == "amax" else (lambda a: (a + 1).amin(-1) * 1)
    assert fused(fn, x)
    expected = fn(x)
    got = compile_fxopt(fn)(x)
    assert got.dtype == dtype and torch.equal(got, expected), (got, expected)


@pytest.mark.parametrize("fn", [lambda a: F.softmax(a * 1, -1), lambda a: F.log_softmax(a * 1, -1)],
                         ids=["softmax", "log_softmax"])
def test_looped_softmax_with_infinities(fn, device):
    """Rows of 20000 take the looped (online) kernel: a +inf entry makes eager's whole row NaN; a row of
    -inf is NaN too; -inf entries among finite ones are zeros of the softmax."""
    torch.manual_seed(0)
    x = torch.randn(4, 20000, device=device)
    x[0, 5] = INF
    x[1, :] = -INF
    x[2, 7:19000] = -INF
    rep = fxopt.explain(fn, x)
    assert any((k.schedule or "").startswith("looped") for k in rep.kernels), [k.schedule for k in rep.kernels]
    got = assert_matches_eager(fn, x)
    assert got[0].isnan().all() and got[1].isnan().all() and not got[2:].isnan().any()
    torch.testing.assert_close(got[2:].double(), fn(to64(x[2:])), equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float64_to_half_casts_go_through_float32_like_eager(dtype, device):
    """Eager converts float64 to bf16/fp16 through float32 (c10's Half and BFloat16 take a float); the
    interpreter turned a direct float64 -> bf16 cast into garbage (0 and NaN for 1.0 and -2.5)."""
    x = torch.tensor([0.5, -1.25, 3.0, 100.0, 1 / 3, 1e-3, -7e4], dtype=torch.float64, device=device)
    fn = lambda a: (a * 2).to(dtype)  # noqa: E731
    assert fused(fn, x)
    expected, got = fn(x), compile_fxopt(fn)(x)
    assert got.dtype == dtype
    if dtype == torch.bfloat16 and device == "cpu":  # the interpreter truncates fp32 -> bf16: one ulp at most
        torch.testing.assert_close(got.float(), expected.float(), rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(got, expected), (got, expected)


@pytest.mark.parametrize("op", [torch.tanh, torch.expm1, torch.log1p], ids=["tanh", "expm1", "log1p"])
def test_functions_near_zero_keep_relative_precision(op, device):
    """tanh, expm1 and log1p of tiny arguments: `exp(x) - 1` and `log(1 + x)` (the interpreter's spelling
    before) lose every digit there ((x * 1e-6).tanh() * 1e6 was 0.477 for 0.5). Relative error against
    float64, plus the values at the ends (0, -0, +-inf, NaN, -1 for log1p)."""
    torch.manual_seed(0)
    x = torch.cat([torch.randn(40) * 1e-7, torch.randn(40) * 1e-3, torch.rand(40) * 4 - 0.9]).to(device)
    fn = lambda a: op(a * 1)  # noqa: E731
    assert fused(fn, x)
    got, ref = compile_fxopt(fn)(x).double(), op(x.double())
    assert ((got - ref).abs() / ref.abs()).max() < 2e-6
    ends = torch.tensor([0.0, -0.0, 30.0, -30.0, INF, -INF, NAN, -1.0], device=device)
    torch.testing.assert_close(compile_fxopt(fn)(ends), fn(ends), equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("op", [torch.expm1, torch.log1p], ids=["expm1", "log1p"])
def test_large_arguments_do_not_overflow_the_precision_trick(op, dtype, device):
    """expm1(85) is 8.2e36, finite, but the near-zero formula's (u - 1) * x overflowed first (inf from x = 84.4
    in fp32, a sweep found); log1p(1e37)'s log(u) * x the same way."""
    big = [84.0, 85.0, 88.0, 88.7] if op is torch.expm1 else [1e16, 1e37, 3e38]
    x = torch.tensor(big + [40.5, 1e-6, -1e-6], dtype=dtype, device=device)
    fn = lambda a: op(a * 1)  # noqa: E731
    assert fused(fn, x)
    got, ref = compile_fxopt(fn)(x), op(x.double())
    assert torch.isfinite(got).all(), got
    torch.testing.assert_close(got.double(), ref, rtol=2e-6, atol=0)


def test_round_to_zero_keeps_the_sign_like_eager(device):
    """torch.round(-0.3) is -0.0 in eager (1 / it is -inf); the kernel's floor-based rounding gave +0.0."""
    x = torch.tensor([-0.5, -0.3, -1e-30, -0.0, 0.0, 0.3, 0.5, -1.5, 2.5, -INF, NAN], device=device)
    fn = lambda a: torch.round(a * 1)  # noqa: E731
    assert "aten.round.default" in fused(fn, x)
    got, expected = compile_fxopt(fn)(x), fn(x)
    torch.testing.assert_close(got, expected, equal_nan=True)
    assert torch.equal(got.signbit(), expected.signbit()), (got, expected)


def test_clamp_by_a_zero_dim_tensor_bound_and_cosine_similarity(device):
    """A 0-d tensor bound is a scalar load in the kernel; the interpreter could not `|` it with a block
    (F.cosine_similarity, whose decomposition clamps the norms by scalar_tensor(1e-8), crashed on the CPU)."""
    torch.manual_seed(0)
    x, y = torch.randn(6, 8, device=device), torch.randn(6, 8, device=device)
    x[0] = 0.0  # a zero norm: the clamp's bound is taken
    s = torch.tensor(0.1, device=device)
    cases = [(lambda a, b: F.cosine_similarity(a, b, dim=-1), (x, y)),
             (lambda a, b: a.clamp(min=b) * 1, (x, s)), (lambda a, b: torch.clamp(a, -b, b) + 1, (x, s)),
             (lambda a, b: a.clamp(max=b) * 1, (x, torch.tensor(NAN, device=device)))]
    for fn, args in cases:
        assert fused(fn, *args)
        got = compile_fxopt(fn)(*args)
        torch.testing.assert_close(got.double(), fn(*(to64(a) for a in args)), equal_nan=True, rtol=1e-5, atol=1e-6)


def test_boolean_logic_on_a_zero_dim_operand(device):
    """xlogy's backward ands two tests of a 0-d input: on the CPU the interpreter's comparison of a 0-d value
    gave floats that `&` refused (a crash); its scalar loads are now blocks there."""
    x = torch.randn(5, 7, device=device, requires_grad=True)
    s = torch.tensor(0.3, device=device, requires_grad=True)
    fn = lambda a, b: torch.xlogy(b, a.abs())  # noqa: E731
    compile_fxopt(fn)(x, s).sum().backward()
    x64, s64 = (t.detach().double().requires_grad_() for t in (x, s))
    fn(x64, s64).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-6)  # fp32 against float64
    torch.testing.assert_close(s.grad.double(), s64.grad, rtol=1e-5, atol=1e-6)
