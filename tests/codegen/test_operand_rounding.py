"""Ops that are not continuous in their operands read a bf16/fp16 value the kernel holds in fp32 rounded to
its dtype, as eager holds it (codegen/operand_rounding.py; found by the sweep of 2026-12-07): casts, floor,
ceil, trunc, round, sign, isinf/isnan, logical ops, maximum/minimum, and comparisons and selections where
the fp16 value meets an fp32 one. Each is compared with eager bit for bit. The
values are chosen so that the unrounded fp32 value gives another answer: fp16(1365 * 3) is 4096, not 4095.

bf16 runs on the GPU only: the Triton interpreter truncates fp32 -> bf16 conversions instead of rounding
them (0.1 -> 0.099609375), so an exact bf16 comparison cannot pass there whatever the kernel does."""
from __future__ import annotations

import pytest
import torch

import fxopt
from helpers import compile_fxopt


def check(fn, *inputs):
    """fn compiled equals eager exactly, outputs and inputs (in-place ops) alike, and its ops are fused."""
    rep = fxopt.explain(fn, *[t.clone() for t in inputs])
    assert rep.kernels, "nothing was fused: the test would not reach a kernel"
    eager_in, fx_in = [t.clone() for t in inputs], [t.clone() for t in inputs]
    expected, got = fn(*eager_in), compile_fxopt(fn)(*fx_in)
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = got if isinstance(got, tuple) else (got,)
    for e, g in zip(expected + tuple(eager_in), got + tuple(fx_in)):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True)


def half(device, *values):
    return torch.tensor(values, dtype=torch.float16, device=device)


CASES = {  # name: (function, fp16 input values); each unrounded value differs from eager's
    "to int32": (lambda x: (x * 3).int(), [1365.0, -1365.0, 1.0]),
    "to float32 beside the fp16 value": (lambda x: ((x * 3).float(), x * 3), [1365.0]),
    "to bool (underflow)": (lambda x: (x * 1e-6).bool(), [1e-3, 1.0]),
    "sum, then to float32": (lambda x: x.sum().float(), [1024.0, 1024.0, 1.0]),
    "floor": (lambda x: (x * 1.1).floor(), [21.8125, -21.8125]),
    "ceil": (lambda x: (x * 1.1).ceil(), [-21.8125, 21.8125]),
    "trunc": (lambda x: (x * 1.1).trunc(), [21.8125, -21.8125]),
    "round": (lambda x: (x * 1.0001).round(), [2.5, -2.5]),
    "sign (underflow)": (lambda x: (x * 1e-6).sign(), [1e-3, -1e-3, 2.0]),
    "isinf (overflow)": (lambda x: (x * 1000, (x * 1000).isinf()), [100.0, 1.0]),
    "nan_to_num (overflow)": (lambda x: torch.nan_to_num(x * 1000), [100.0, -100.0, 1.0]),
    "logical_not (underflow)": (lambda x: (x * 1e-6).logical_not(), [1e-3, 1.0]),
    "int8 quantisation": (lambda x: (x / 0.037).round().clamp(-128, 127).to(torch.int8), None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp16_values_are_read_rounded(case, device):
    fn, values = CASES[case]
    if values is None:  # 256 values of a realistic range, of which several round differently
        x = (torch.randn(16, 16, generator=torch.Generator().manual_seed(0)) * 3).half().to(device)
    else:
        x = half(device, *values)
    check(fn, x)


def test_in_place_floor_of_a_scaled_input(device):
    """`x.mul_(1.1); x.floor_()` left the input 1 lower than eager's (23 for 24)."""
    def fn(x):
        x.mul_(1.1)
        x.floor_()
        return x
    check(fn, half(device, 21.8125, 31.8125))


MIXED = {  # name: (function, fp16 values, fp32 values): the fp16 intermediate meets an fp32 tensor
    "==": (lambda x, y: x * 3 == y, [1365.0], [4096.0]),
    ">": (lambda x, y: x * 3 > y, [1366.0], [4097.0]),
    "where": (lambda x, y: torch.where(y > 0, x * 3, y), [1365.0, 1366.0], [1.0, 1.0]),
    "clamp": (lambda x, y: torch.clamp(y, max=x * 3), [1365.0], [4096.0]),
    "maximum": (lambda x, y: torch.maximum(x * 3, y), [1366.0], [0.0]),
    "remainder": (lambda x, y: (x * 3) % y, [1365.0], [7.0]),
    "row sum ==": (lambda x, y: x.reshape(1, 2).sum(-1) == y, [2048.0, 2047.0], [4096.0]),
}


@pytest.mark.parametrize("case", sorted(MIXED))
def test_fp16_values_are_read_rounded_beside_fp32(case, device):
    """Promoted to fp32 for the op, the fp16 operand is still the value eager holds (4096, not 4095)."""
    fn, a, b = MIXED[case]
    check(fn, half(device, *a), torch.tensor(b, device=device))


ELEMENTWISE = [c for c in sorted(CASES) if CASES[c][1] is not None and "sum" not in c]
ELEMENTWISE_MIXED = [c for c in sorted(MIXED) if "sum" not in c]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ELEMENTWISE + [f"mixed {c}" for c in ELEMENTWISE_MIXED])
def test_read_rounded_with_several_elements_per_thread(case, dtype, device):
    """The element-wise cases above, tiled to thousands of elements, in fp16 and bf16: on the GPU a thread
    then holds several and packed 16-bit code runs (a bf16 sign was wrong only there, 2026-12-07). GPU
    only: the interpreter computes one element at a time (and truncates fp32 -> bf16)."""
    if device != "cuda":
        pytest.skip("packed 16-bit code exists on the GPU only")
    tile = lambda values, dt: torch.tensor(values, dtype=dt, device=device).repeat(2048)  # noqa: E731
    if case.startswith("mixed "):
        fn, a, b = MIXED[case.removeprefix("mixed ")]
        check(fn, tile(a, dtype), tile(b, torch.float32))
    else:
        fn, values = CASES[case]
        check(fn, tile(values, dtype))


def test_threshold_compares_as_the_devices_kernel_does(device):
    """F.threshold and its backward at a threshold fp16 cannot hold (4095 -> 4096): the CPU kernels compare
    in fp32 (x = 4096 keeps its value and gradient), the CUDA kernels round the threshold to fp16 first
    (x = 4096 is thresholded). torch's decompositions gave the CUDA answer on both devices
    (fxopt/decompositions.py)."""
    x = half(device, 4096.0, 4094.0, 2.0)

    def run(fn):
        t = x.clone().requires_grad_()
        out = fn(t)
        out.sum().backward()
        return out.detach(), t.grad
    for threshold in (4095.0, 1.9999, 4096):
        f = lambda t: torch.nn.functional.threshold(t * 1, threshold, 0.0) * 2  # noqa: E731
        torch.testing.assert_close(run(compile_fxopt(f)), run(f), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_hardtanh_backward_compares_with_the_unrounded_bounds(dtype, device):
    """x = 2 inside hardtanh(-2.0001, 2.0001) keeps its gradient (bounds 2.0 in 16 bits would drop it):
    eager's kernels compare in fp32 on both devices; torch 2.11's decomposition rounded the bounds."""
    x = torch.tensor([2.0, -2.0, 3.0, 0.5, 256.0], dtype=dtype, device=device)

    def grad(fn):
        t = x.clone().requires_grad_()
        fn(t).float().sum().backward()
        return t.grad
    for bound in (2.0001, 257.0):
        f = lambda t: torch.nn.functional.hardtanh(t * 1, -bound, bound)  # noqa: E731
        torch.testing.assert_close(grad(compile_fxopt(f)), grad(f), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pow_takes_its_scalar_in_the_tensors_dtype(dtype, device):
    """Both devices' pow kernels convert a scalar exponent (or base) to a 16-bit tensor's dtype: fp16
    x ** 4.095 is x ** 4.09375 in eager (2 ** 4.095 = 17.09 rounded differently from eager's 17.08)."""
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("the interpreter truncates a kernel's fp32 -> bf16 cast: checked on the GPU")
    x = torch.tensor([2.0, 6.0, 3.0, 0.5, 11.0, 1.5], dtype=dtype, device=device)
    for e in (4.095, 0.255, 1.0003):
        check = lambda fn: torch.testing.assert_close(compile_fxopt(fn)(x), fn(x), rtol=0, atol=0)  # noqa: E731
        check(lambda t: (t * 1) ** e)
        check(lambda t: (e / 4) ** (t * 1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sign_and_abs_backward_of_many_16bit_values(dtype, device):
    """On an H100, sign of a bf16 intermediate selected int constants and came out 1 for negative values
    wherever a thread held two or more elements (about half of 1M values; abs's backward, grad * sign,
    with it). Enough elements here to make the kernel hold several per thread."""
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("the interpreter truncates a kernel's fp32 -> bf16 cast: checked on the GPU")
    x = (torch.randn(8192, device=device) * 100).to(dtype)
    x[:3] = torch.tensor([0.0, -0.0, float("nan")])
    torch.testing.assert_close(compile_fxopt(lambda t: (t * 1).sign())(x), (x * 1).sign(), rtol=0, atol=0,
                               equal_nan=True)

    def grad(fn):
        t = x.clone().requires_grad_()
        fn(t).float().sum().backward()
        return t.grad
    f = lambda t: (t * 3).abs()  # noqa: E731
    torch.testing.assert_close(grad(compile_fxopt(f)), grad(f), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("case", ["to int64", "floor"])
def test_bf16_values_are_read_rounded(case, device):
    if device == "cpu":
        pytest.skip("the Triton interpreter truncates fp32 -> bf16 conversions (module docstring)")
    fn, values = {"to int64": (lambda x: (x * 0.01).long(), [4096.0]),  # 40.96 -> bf16 41
                  "floor": (lambda x: (x * 1.1).floor(), [31.8125])}[case]  # 34.99 -> bf16 35
    check(fn, torch.tensor(values, dtype=torch.bfloat16, device=device))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_stored_value_is_used_rounded_in_its_own_kernel(dtype, device):
    """RMSNorm over rows, then amax over columns, in 16 bits: the forward stores rsqrt (fp16) for the
    backward and used it unrounded for `x * rsqrt`; the backward recomputed `x * rsqrt` from the stored,
    rounded rsqrt, so amax's `x * rsqrt == max` found no element and the gradient was 0/0 = NaN (the fuzzer,
    --mixed). A value a kernel stores is read rounded by the kernel's own computations too."""
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("the interpreter truncates fp32 -> bf16 (exact bf16 results are checked on the GPU)")
    g = torch.Generator().manual_seed(26)
    w = torch.randn(4, 250, generator=g).to(dtype).to(device)
    fn = lambda w: (w * torch.rsqrt(w.pow(2).mean(-1, keepdim=True) + 1e-6)).amax(0, keepdim=True)  # noqa: E731
    a, b = w.clone().requires_grad_(), w.clone().requires_grad_()
    weights = torch.linspace(-1, 1, 250, device=device)
    (fn(a).float() * weights).sum().backward()
    (compile_fxopt(fn)(b).float() * weights).sum().backward()
    assert b.grad.isfinite().all()
    # eager rounds each backward op's result to 16 bits, the fused kernel keeps them in fp32: up to 2 ulps
    # apart (bf16 on an H100: 0.0078 at 0.9); a wrongly selected max is off by O(1)
    torch.testing.assert_close(b.grad, a.grad, rtol=2 * torch.finfo(dtype).eps, atol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_value_read_rounded_by_one_op_is_read_rounded_by_all(dtype, device):
    """`where(v > x, v, t) - v` is 0 where v was selected, as in eager: the selection reads v rounded (as
    eager holds it), so the subtraction must too (it read the unrounded fp32 value: 1939 of 4096 nonzero)."""
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("the interpreter truncates fp32 -> bf16 (exact bf16 results are checked on the GPU)")
    g = torch.Generator().manual_seed(0)
    s, x, t = (torch.randn(4096, generator=g).to(dtype).to(device) for _ in range(3))
    check(lambda s, x, t: torch.where(s * 3.3 > x, s * 3.3, t) - s * 3.3, s, x, t)
