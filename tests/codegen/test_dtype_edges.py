"""Dtypes at the edges (found by the dtype sweep of 2026-12-05): a kernel written into a dying buffer of
another dtype, casts that eager makes in two steps (int -> float32 -> bf16; float -> int64 -> uint8),
scalars eager rounds to the tensor's dtype (remainder, fmod; symbolic ints in comparisons), reductions to
bool and integer negative powers. Each compares with eager, bit-exact where the result is exact."""
from __future__ import annotations

import pytest
import torch

import fxopt
from helpers import compile_fxopt


def fused_ops(fn, *inputs) -> set[str]:
    rep = fxopt.explain(fn, *inputs)
    return {op for k in rep.kernels for op in k.ops}


def assert_same(fn, *inputs, **options):
    expected = fn(*inputs)
    got = compile_fxopt(fn, **options)(*inputs)
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


CROSS_DTYPE = {  # an ATen result of one dtype dies at a kernel whose output has another of the same size
    "argmax -> float64": (lambda x: x.argmax(-1).double() + 0.5, lambda d: torch.randn(4, 9, device=d)),
    "int32 cumsum -> float32": (lambda x: torch.cumsum(x, 1, dtype=torch.int32).float() * 0.5,
                                lambda d: torch.arange(12, dtype=torch.int32, device=d).view(3, 4)),
    "float32 cumsum -> int32": (lambda x: torch.cumsum(x, 1).to(torch.int32) + 1,
                                lambda d: torch.arange(12.0, device=d).view(3, 4)),
}


@pytest.mark.parametrize("case", sorted(CROSS_DTYPE))
@pytest.mark.parametrize("memory_plan", [True, False, "apply"])
def test_a_kernel_written_into_a_dying_buffer_of_another_dtype(case, memory_plan, device):
    """Written in place without an applied plan, the output came back in the dying input's dtype
    (argmax().double() + 0.5 was int64 [1, 0]; the int32 cumsum's halves were truncated)."""
    fn, make = CROSS_DTYPE[case]
    assert_same(fn, make(device), memory_plan=memory_plan)


def test_float_to_narrow_integers_wraps_like_eager(device):
    """Eager converts through int64 (-1.5 -> uint8 255); the GPU's direct conversion saturates at 0."""
    x = torch.tensor([-1.5, -100.0, 3.7, 250.0, -128.0, 127.9, 300.0], device=device)
    for dtype in (torch.uint8, torch.int8, torch.int16):
        fn = lambda t: (t * 1).to(dtype) + 0  # noqa: E731
        assert "aten._to_copy.default" in fused_ops(fn, x)
        assert_same(fn, x)


def test_float_out_of_int32_range_to_int8_int16_saturates_through_int32(device):
    """Eager's CUDA kernels convert a float to int8/int16 through a saturating int32 (1e10 -> -1), the
    CPU's through x86's 0x80000000 (-> 0); through int64 fxopt wrapped 1e10 to int16 -7168 on both."""
    x = torch.tensor([1e10, -1e10, 3e9, -3e9, 40000.0, -40000.0, 200.5], device=device)
    for dtype in (torch.int8, torch.int16):
        assert_same(lambda t: (t * 1).to(dtype), x)


def test_integer_abs_and_fmod(device):
    """abs(INT16_MIN) wraps to itself in eager (LLVM folded Triton's int16 abs of it into 32768: the H100
    gave abs(x) % 40 = 8 where eager has 32, so int8/int16 abs stays ATen on the GPU); an integer fmod by
    a tensor did not compile on the GPU (libdevice.fmod takes floats)."""
    a = torch.tensor([-32768, 5, -7, 7, 32767, -1], dtype=torch.int16, device=device)
    b = torch.tensor([3, -3, 2, -2, 40, 7], dtype=torch.int16, device=device)
    assert_same(lambda s, t: (s * 1).abs() % 40 + t, a, b)
    for dtype in (torch.int16, torch.int32, torch.int64):
        assert_same(lambda s, t: torch.fmod(s * 1, t) + torch.remainder(s, t), a.to(dtype), b.to(dtype))


def test_integers_to_bf16_round_through_float32(device):
    """2^24 + 2^16 + 1 -> bf16: eager rounds to float32 first (16777216); one rounding gives 16908288."""
    v = torch.tensor([2 ** 24 + 2 ** 16 + 1, -(2 ** 24 + 2 ** 16 + 1), 7, 2 ** 30 + 2 ** 22 + 1], device=device)
    for src in (torch.int32, torch.int64):
        for dtype in (torch.bfloat16, torch.float16):
            assert_same(lambda t: (t * 1).to(dtype), v.to(src))


@pytest.mark.parametrize("op", [torch.remainder, torch.fmod])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_remainder_by_a_scalar_takes_the_scalar_in_the_tensors_dtype(op, dtype, device):
    """ATen's remainder/fmod kernels take the divisor as the tensor's dtype: fp16(0.1) = 0.0999755...
    (fxopt divided by the fp32 0.1: 499 of 506 elements differed)."""
    x = (torch.randn(506, device=device) * 50).to(dtype)
    assert_same(lambda t: op(t * 1, 0.1), x)
    if dtype == torch.float16 or device == "cuda":  # (the interpreter truncates a kernel's fp32 -> bf16 cast)
        assert_same(lambda t, s: op(t * 1, s), x, torch.tensor(0.1, device=device))


def test_comparisons_with_a_symbolic_int_round_it(device):
    """Under dynamic shapes an int argument or a size is a SymInt node: comparing or clamping a 16-bit
    tensor with it crashed codegen (no .dtype); eager rounds it to fp16 (2049 -> 2048)."""
    x = torch.tensor([2047.0, 2048.0, 2050.0, -3.0], dtype=torch.float16, device=device)
    fns = [lambda t, n: t < n, lambda t, n: t == n, lambda t, n: t.clamp(max=n),
           lambda t, n: t.clamp(max=t.shape[0] - 5)]
    for fn in fns:
        torch._dynamo.reset()
        got = torch.compile(fn, backend="fxopt", dynamic=True)(x, 2049)
        torch.testing.assert_close(got, fn(x, 2049), rtol=0, atol=0)


def test_a_sum_to_bool_is_left_to_aten(device):
    x = torch.tensor([[True, False, False], [False, False, False]], device=device)
    assert_same(lambda t: t.sum(1, dtype=torch.bool), x)
    assert_same(lambda t: (t.float() * 2).sum(1, dtype=torch.bool), x)


@pytest.mark.parametrize("exponent", [-1, -2, -3])
def test_an_integer_to_a_negative_power_raises_as_in_eager(exponent, device):
    x = torch.tensor([-3, -1, 0, 1, 2, 7], dtype=torch.int32, device=device)
    with pytest.raises(Exception, match="Integers to negative integer powers are not allowed"):
        compile_fxopt(lambda t: (t + 1) ** exponent)(x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_16bit_max_of_a_computed_value_has_eagers_gradient(dtype, device):
    """amax's backward compares the recomputed input with the saved (rounded) max: the kernel held the
    recomputed sigmoid in fp32, nothing matched, and every gradient of the row was NaN (grad / 0)."""
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("the interpreter truncates fp32 -> bf16 where eager rounds")
    x = torch.randn(4, 33, device=device, dtype=dtype)
    for fn in (lambda t: t.sigmoid().amax(-1), lambda t: t.exp().amax(), lambda t: torch.nn.functional.gelu(t).amin(0)):
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        fn(a).float().sum().backward()
        compile_fxopt(fn)(b).float().sum().backward()
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-2, atol=1e-3)  # (gelu's derivative in fp32)
        torch._dynamo.reset()


def test_a_comparison_rounds_a_16bit_intermediate_first(device):
    """exp(0.40625) is 1.5 in bf16/fp16 as eager rounds it: `exp(x) > 1.5` is False there."""
    for dtype in (torch.float16,) + ((torch.bfloat16,) if device == "cuda" else ()):
        x = torch.tensor([0.40625, 0.0966, 1.0], device=device, dtype=dtype)
        assert_same(lambda t: torch.where(t.exp() > 1.5, 100.0, 0.0), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pow_of_edge_values_by_a_fractional_scalar(dtype, device):
    """C's pow: (-inf) ** -1.5 is 0 and (-inf) ** 1.5 is inf, a finite negative base gives NaN, -0.0 ** -1.5
    is inf. The interpreter's pow (exp2/log2, libdevice being GPU-only) gave NaN for -inf and, in fp32,
    1e10 ** -1.5 17 ulp from eager's; it now works in float64 (the GPU uses libdevice.pow)."""
    x = torch.tensor([float("-inf"), float("inf"), -0.0, 0.0, -2.5, 2.5, 1e10, 3e-5, 300.7], device=device)
    for e in (-1.5, 1.5, 0.25):
        fn = lambda t: (t.to(dtype) * 1) ** e  # noqa: E731
        torch.testing.assert_close(compile_fxopt(fn)(x), fn(x), rtol=2 ** -22, atol=0, equal_nan=True)


def test_add_and_sub_take_a_scalar_as_the_devices_kernel_does(device):
    """Eager's CPU add/sub round a Python-number operand and alpha to fp16 (`x + 4095` of -4096 is 0: fp16(4095)
    is 4096); its CUDA kernels take them in fp32 (-1). Each device's kernels follow its eager."""
    x = torch.tensor([1000.0, -4096.0, 100.0, -256.0, 3.0, 4094.0], dtype=torch.float16, device=device)
    for fn in (lambda t: t * 1 + 4095, lambda t: t * 1 - 4095, lambda t: 4095 - t * 1, lambda t: (t * 1).add(4097),
               lambda t: torch.add(t * 1, t, alpha=1.0003), lambda t: torch.sub(t * 1, t, alpha=2.0001)):
        assert_same(fn, x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_integer_to_half_cast_converts_values(dtype, device):
    """int64 -> bf16/fp16 must convert (the interpreter reinterprets bits, so on CPU the cast stays ATen)."""
    def f(t, x):
        return (t.to(dtype) * x).float()

    t = torch.tensor([32, 1, 7, -3], device=device)
    x = torch.ones(4, dtype=dtype, device=device)
    torch.testing.assert_close(compile_fxopt(f)(t, x), f(t, x))
