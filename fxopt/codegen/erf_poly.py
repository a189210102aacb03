"""A branch-free fp32 erf for results eager rounds to bf16 or fp16 (GELU in 16-bit models).

libdevice's erf branches per element on |x|, so a warp whose lanes straddle the branch runs both
sides: ~40 instructions per element, which made residual + LayerNorm + GELU compute-bound on an H200
(the same kernel without the GELU ran at 95% of copy bandwidth, with it at 72%). This one evaluates
both pieces for every lane and selects, ~20 instructions and one exp2:

- |x| < 0.875: erf(x) = x * A(x^2), A a degree-5 polynomial (relative error 9e-9 in float64);
- otherwise:   erf(x) = sign(x) * (1 - 2^B(min(|x|, 4) - 2.4)), B a degree-8 polynomial fitting
  log2(erfc(t)) on [0.875, 4] (absolute error 2e-8 in float64); erfc(4) = 1.5e-8 is below half an
  ulp of 1, so clamping at 4 gives exactly +-1 beyond.

The coefficients are weighted least-squares fits to mpmath's erf on Chebyshev nodes (relative error
for A, absolute error of the log for B), rounded to float32. Evaluated in fp32 the result is within
4 ulp of the true erf (tests/codegen/test_erf_poly.py checks it against float64 on a dense grid in the
interpreter); a bf16 result has 16 ulp of fp32 per half-ulp of its own, so the rounded GELU is
eager's except where eager's own fp32 value sits within a few ulp of a bf16 rounding boundary.
NaN gives NaN, +-inf gives +-1.

GELU itself (x * Phi(x)) takes a cheaper path than 0.5 * x * (1 + erf(x / sqrt 2)), ~13 instructions
where that is ~27: with h = Phi(-|x|) = erfc(|x| / sqrt 2) / 2, GELU(x) = x * (1 - h) for x >= 0 and
x * h below, and h = 2^G(|x| - GELU_CENTER) with G a degree-7 polynomial fitting log2(h) on
[0, GELU_CLAMP] (absolute error 5e-6 evaluated in fp32: h, hence GELU, within 4e-6 relative where
|x| < 3, which a 16-bit result cannot see); past the clamp h is 0 (below 1e-9). One polynomial and one
exp2 for every lane, no cancellation in 1 + erf for negative x (so it is closer to float64 than eager's
own fp32 GELU there). On an H200 residual + LayerNorm + GELU was still compute-bound with the erf
above (84% of copy bandwidth against 95% without the GELU). GELU(NaN) and GELU(-inf) are NaN, as eager.
"""
from __future__ import annotations

SPLIT = 0.875  # |x| below: the odd polynomial; above: 1 - exp2(B)
CLAMP = 4.0
CENTER = 2.4  # B is a polynomial in (t - CENTER): well conditioned in fp32 over [SPLIT, CLAMP]
A = (1.1283791065216064, -0.3761254847049713, 0.11282432079315186, -0.026790691539645195,
     0.005031096749007702, -0.0006197828915901482)
B = (-10.504226684570312, -7.450418472290039, -1.3568572998046875, -0.016977842897176743,
     0.003444097936153412, -0.000677366741001606, 0.0001258138072444126, -2.1044226741651073e-05,
     2.3119989691622322e-06)

GELU_CLAMP = 6.0
GELU_CENTER = 3.0
G = (-9.53293514251709, -4.7365193367004395, -0.6704442501068115, -0.007554398849606514,
     0.0011327347019687295, -0.00016774206596892327, 2.2999249267741106e-05, -1.8896262190537527e-06)


def _horner(coeffs, v: str) -> str:
    expr = repr(coeffs[-1])
    for c in reversed(coeffs[:-1]):
        expr = f"({expr} * {v} + {c!r})"
    return expr


HELPER, GELU_HELPER = "_fx_erf", "_fx_gelu"


def erf_call(x: str) -> str:
    return f"{HELPER}({x})"


def gelu_call(x: str) -> str:
    return f"{GELU_HELPER}({x})"


def with_erf_helper(source: str, target: str) -> str:
    """The kernel source with the helpers' definitions in front for those the kernel calls: a
    @triton.jit function on the GPU (inlined by the compiler), a plain Python function in the
    interpreter (where calling a @triton.jit helper leaves triton.language patched for the process)."""
    for name, helper in _HELPERS.items():
        if f"{name}(" in source and f"def {name}(" not in source:
            source = ("@triton.jit\n" if target == "cuda" else "") + helper + "\n\n" + source
    return source


_ERF_SOURCE = f'''def {HELPER}(x):
    """erf(x) for fp32 x without branches (fxopt/codegen/erf_poly.py); NaN stays NaN."""
    t = tl.abs(x)
    small = x * {_horner(A, "(x * x)")}
    clamped = tl.minimum(t, {CLAMP}, propagate_nan=tl.PropagateNan.ALL)
    tail = 1.0 - tl.exp2({_horner(B, f"(clamped - {CENTER})")})
    return tl.where(t < {SPLIT}, small, tl.where(x < 0.0, -tail, tail))
'''

_GELU_SOURCE = f'''def {GELU_HELPER}(x):
    """GELU(x) for fp32 x: x * (1 - h) or x * h, h = Phi(-|x|) (fxopt/codegen/erf_poly.py)."""
    t = tl.abs(x)
    h = tl.where(t < {GELU_CLAMP}, tl.exp2({_horner(G, f"(t - {GELU_CENTER})")}), 0.0)
    return x * tl.where(x >= 0.0, 1.0 - h, h)
'''
_HELPERS = {HELPER: _ERF_SOURCE, GELU_HELPER: _GELU_SOURCE}
