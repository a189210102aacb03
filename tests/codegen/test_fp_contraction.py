"""A product subtracted from its own rounded value (a row max, itself): eager rounds the product before
the subtraction, so the difference is exactly 0. A fused kernel compiled with fma contraction computed
fma(x, w, -round(x * w)), the product's rounding error, and exp of that was inf or 0 once |x * w| was large:
log_softmax and logsumexp of fp32 rows near 1e15 came out +-inf on the H100 (benchmarks/edge_sweep.py
--family rows, 2026-12-07), softmax's gradient NaN. The CPU interpreter never contracts; the CUDA cases are
the ones that failed before generated kernels were compiled with enable_fp_fusion=False."""
from __future__ import annotations

import pytest
import torch

from helpers import compile_fxopt

ROW_OPS = {
    "log_softmax": lambda t: torch.log_softmax(t, -1),
    "logsumexp": lambda t: torch.logsumexp(t, -1),
    "softmax": lambda t: torch.softmax(t, -1),
    "minus_max": lambda t: t - t.amax(-1, keepdim=True),
}


def _large_rows(cols: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, cols, generator=g, dtype=torch.float64) * 1e15).float().to(device)
    w = torch.linspace(-1, 2, cols, dtype=torch.float32, device=device)
    return x, w


@pytest.mark.parametrize("cols", [37, 3000, 40000])  # persistent rows, wide rows, a looped online softmax
@pytest.mark.parametrize("name", sorted(ROW_OPS))
def test_a_product_minus_its_row_max_is_rounded_first(name, cols, device):
    op = ROW_OPS[name]
    fn = lambda x, w: op(x * w)  # noqa: E731
    x, w = _large_rows(cols, device)
    expected = fn(x, w)
    got = compile_fxopt(fn)(x, w)
    assert bool(got.isfinite().all()) == bool(expected.isfinite().all())
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0, equal_nan=True)


def test_softmax_gradient_of_large_products_is_not_nan(device):
    x, w = _large_rows(37, device)
    w.requires_grad_(True)
    weights = torch.randn(64, 37, generator=torch.Generator().manual_seed(1)).to(device)

    def fn(x, w):
        return (torch.softmax(x * w, -1) * weights).sum()

    fn(x, w).backward()
    expected, w.grad = w.grad, None
    compile_fxopt(fn)(x, w).backward()
    assert not bool(w.grad.isnan().any())
    torch.testing.assert_close(w.grad, expected, equal_nan=True)


def test_a_product_minus_itself_is_exactly_zero(device):
    """`a * b - a * b`: one product after CSE, contracted to fma(a, b, -(a * b)) without the fix."""
    g = torch.Generator().manual_seed(2)
    a, b = (torch.randn(4096, generator=g).to(device) * 1e3 for _ in range(2))
    got = compile_fxopt(lambda a, b: a * b - a * b)(a, b)
    assert torch.equal(got, torch.zeros_like(got))


ALPHA_OPS = {
    "sub": lambda x, y: torch.sub(x * 1, x, alpha=2.0001),
    "add": lambda x, y: torch.add(x * 1, y, alpha=-3.5),
    "rsub": lambda x, y: torch.rsub(x * 1, y, alpha=2.0001),
    "add_scalar": lambda x, y: torch.add(x * 1, 3e4, alpha=2.5),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(ALPHA_OPS))
def test_add_and_sub_with_alpha_round_as_eager_kernels_do(name, dtype, device):
    """Eager's CUDA add computes a + alpha * b as one fma (compiled with contraction), so x - 2.0001 * x near
    the dtype's max is finite; a separate product overflowed to -inf (bf16 on the H100). The CPU's fp32/fp64
    kernels use fma too (their 16-bit ones only for tensors of 32 elements or more)."""
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("the interpreter truncates fp32 -> bf16 (exact bf16 results are checked on the GPU)")
    big = torch.finfo(dtype).max
    x = torch.tensor([big * 0.9, 1.5, -2.25, 3.0] * 64, dtype=dtype, device=device)
    y = torch.tensor([0.1, 1e-3, 7.0, -3.0] * 64, dtype=dtype, device=device)
    fn = ALPHA_OPS[name]
    torch.testing.assert_close(compile_fxopt(fn)(x, y), fn(x, y), rtol=0, atol=0, equal_nan=True)


def test_every_generated_launch_turns_contraction_off():
    """The CUDA tests above fail with contraction on, but CI has no GPU: this keeps the option in every
    launch of a wrapper (pointwise, persistent and looped reductions) where the CPU can see it."""
    import fxopt
    x = torch.randn(4, 40000)
    rep = fxopt.explain(lambda x: torch.softmax(x * 2, -1) + torch.softmax(x[:, :64], -1).sum(), x)
    launches = [line for line in rep.wrapper_source.splitlines() if "num_warps=" in line]
    assert len(launches) >= 2
    assert all("enable_fp_fusion=False" in line for line in launches), launches


def test_float64_literal_operands_are_explicitly_float64():
    """Triton before 3.9 (the GPU's 3.6) turned a Python float given to tl.fma into float32 (2.0001 ->
    2.000099897: every float64 sub with that alpha off in the 8th digit on the H100) and failed to compile
    libdevice.fmod(x, 0.6) for float64 x; CI's 3.9 does neither, so the CPU checks the kernel text: each
    literal operand of a float64 computation is an explicit float64."""
    import fxopt
    x = torch.randn(64, dtype=torch.float64)
    rep = fxopt.explain(lambda x: torch.rsub(x * 1, 2.5, alpha=2.0001), x)
    lines = [line for k in rep.kernels for line in k.source.splitlines() if "tl.fma(" in line]
    assert len(lines) == 1, lines
    assert "tl.full([], 2.0001, tl.float64)" in lines[0] and "tl.full([], 2.5, tl.float64)" in lines[0], lines


def test_float64_with_python_float_operands(device):
    """The GPU side of the test above (fmod's kernel is the GPU's only: the CPU runs float64 fmod eagerly)."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4096, generator=g, dtype=torch.float64) * 10).to(device)
    def fn(x):
        y = x * 1
        return (torch.fmod(y, 0.6), torch.remainder(y, 0.7), torch.rsub(y, 0.1, alpha=2.0001),
                torch.atan2(y, torch.full_like(x, 0.3)), torch.clamp(y, -0.1, 0.3), y ** 0.3)

    for got, want in zip(compile_fxopt(fn)(x), fn(x)):
        torch.testing.assert_close(got, want, rtol=1e-15, atol=0, equal_nan=True)
