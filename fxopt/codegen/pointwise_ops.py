"""Triton lowerings of ATen pointwise ops: each takes operand expressions and returns one expression.

Operands arrive already cast to the op's compute dtype (see triton_pointwise.operand_dtype).
Math is chosen per target and per result dtype:
- target "interpret" (CPU, TRITON_INTERPRET=1) may only use tl/tl.math, so libdevice functions are
  spelled with exp/log there (accurate to fp32 tolerances, checked in tests against float64);
- on "cuda", fp32 results use exact libdevice math; a result eager rounds to bf16 may use `tanh.approx.f32`
  (relative error 2^-10.99, PTX ISA) for tanh and ex2.approx with approximate division for sigmoid, below
  bf16's rounding error (2^-9 relative), so the stored bf16 is as accurate as eager's. fp16 keeps exact math.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from .division import fmod, lower_div, remainder, true_divide
from .dtypes import LOW_PRECISION, TL_DTYPE, compute_dtype, float64_operand
from .erf_poly import erf_call, gelu_call

aten = torch.ops.aten
prims = torch.ops.prims


@dataclass(frozen=True)
class LowerCtx:
    target: str  # "cuda" | "interpret"
    out_dtype: torch.dtype  # the dtype eager gives this node's result
    compute: torch.dtype  # the dtype operands were cast to
    # bf16 or fp16 when every output of the kernel has that dtype: an fp32 intermediate there (the
    # upcast inside a 16-bit softmax or GELU) is rounded to 16 bits before anyone sees it
    rounds_to: torch.dtype | None = None

    @property
    def _fp32_into_16bit(self) -> bool:
        return self.out_dtype == torch.float32 and self.rounds_to in (torch.bfloat16, torch.float16)

    @property
    def approx_ok(self) -> bool:
        """Hardware approximations allowed (tanh.approx: 2^-11 relative error): on the GPU, for results
        eager rounds to bf16 (not for fp32 values on their way there: eager keeps those exact)."""
        return self.target == "cuda" and self.out_dtype == torch.bfloat16

    @property
    def exact(self) -> bool:
        """libdevice (correctly rounded-ish) math: on the GPU for fp32/fp64 results, except fp32 values
        that only reach 16-bit outputs (Triton's exp/rsqrt, a few fp32 ulp, are far inside half a
        16-bit ulp)."""
        return self.exact_trig and not self._fp32_into_16bit

    @property
    def exact_trig(self) -> bool:
        return self.target == "cuda" and self.out_dtype in (torch.float32, torch.float64)


def ptx_unary(instr: str, x: str) -> str:
    """One fp32 PTX instruction over x's elements (GPU only: the interpreter cannot run inline asm)."""
    return (f'tl.inline_asm_elementwise("{instr} $0, $1;", "=r,r", [{x}], dtype=tl.float32, '
            f"is_pure=True, pack=1)")


def _tanh_approx(x: str) -> str:
    return ptx_unary("tanh.approx.f32", x)


def _libdevice_or(name: str, fallback):
    """libdevice.<name> on the GPU for exact results; `fallback(x)` (tl-only math) otherwise."""
    def lower(c: LowerCtx, x: str) -> str:
        return f"libdevice.{name}({x})" if c.target == "cuda" else fallback(x)
    return lower


def _exp(c, x):
    return f"libdevice.exp({x})" if c.exact else f"tl.exp({x})"


def _log(c, x):
    return f"libdevice.log({x})" if c.exact else f"tl.log({x})"


def _sigmoid(c, x):
    # Not 0.5*tanh(x/2)+0.5: near sigmoid's zero that cancels, and the relative error is unbounded.
    # For bf16 results: 1 / (1 + 2^(-x*log2 e)) with ex2.approx and rcp.approx (each ~2^-22 relative,
    # plus |x|*2^-24 from rounding the exponent: < 1e-5 for |x| < 87, far below bf16's 2^-9).
    # Below x = -87 the result (< 2^-126) flushes to 0.
    if c.approx_ok:
        e = ptx_unary("ex2.approx.ftz.f32", f"{x} * -1.4426950408889634")
        return ptx_unary("rcp.approx.ftz.f32", f"1.0 + {e}")
    return true_divide(c, "1.0", f"(1.0 + {_exp(c, f'-{x}')})")


def _tanh(c, x):
    if c.approx_ok:
        return _tanh_approx(x)
    if c.target == "cuda":
        return f"libdevice.tanh({x})"
    e = _expm1_tl(f"(2.0 * {x})")  # expm1(2x) / (expm1(2x) + 2): no cancellation near 0; saturates past 20
    return f"tl.where({x} > 20.0, 1.0, tl.where({x} < -20.0, -1.0, {e} / ({e} + 2.0)))"


def _expm1_tl(x: str) -> str:
    """expm1 from tl.exp alone (the interpreter has no libdevice), accurate near 0: with u = exp(x) rounded,
    (u - 1) * x / log(u) cancels the rounding of u (Kahan's trick); exp(x) - 1 loses every digit there.
    Past x = 40, u - 1 is u in fp32 and fp64 alike, and (u - 1) * x would overflow before the division
    (fp32 from x = 84.4, where expm1 is still finite)."""
    u = f"tl.exp({x})"
    return (f"tl.where(({u} == 1.0) | ({x} > 40.0), tl.where({u} == 1.0, {x}, {u}), "
            f"tl.where({u} - 1.0 == -1.0, -1.0, ({u} - 1.0) * {x} / tl.log({u})))")


def _log1p_tl(x: str) -> str:
    """log1p from tl.log alone, accurate near 0: with u = 1 + x rounded, log(u) * x / (u - 1) (Kahan).
    Past x = 1e15 the correction is below rounding and log(u) * x would overflow from x ~ 4e36 (fp32)."""
    u = f"(1.0 + {x})"
    return f"tl.where({u} == 1.0, {x}, tl.where({x} > 1e15, tl.log({u}), tl.log({u}) * {x} / ({u} - 1.0)))"


def _poly_ok(c) -> bool:
    """fp32 values whose results are rounded to 16 bits: erf_poly's branch-free erf and GELU serve."""
    return c.compute == torch.float32 and (c.out_dtype in (torch.bfloat16, torch.float16) or c._fp32_into_16bit)


def _erf(c, x):
    if _poly_ok(c):
        return erf_call(x)  # branch-free (erf_poly.py): a 16-bit result hides its 4 ulp of fp32
    return f"libdevice.erf({x})" if c.target == "cuda" else f"tl.math.erf({x})"


def _sqrt(c, x):
    return f"tl.sqrt_rn({x})" if c.out_dtype == torch.float32 else f"tl.sqrt({x})"  # sqrt_rn is fp32-only; fp64 sqrt is IEEE


def _rsqrt(c, x):
    return f"libdevice.rsqrt({x})" if c.exact else f"tl.math.rsqrt({x})"


def _gelu(c, x, approximate="none"):
    if approximate == "tanh":
        inner = f"0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x})"
        return f"(0.5 * {x} * (1.0 + {_tanh(c, inner)}))"
    if _poly_ok(c):
        return gelu_call(x)
    return f"(0.5 * {x} * (1.0 + {_erf(c, f'{x} * 0.7071067811865476')}))"


def _round_half_even(x: str) -> str:
    """torch.round: to nearest, ties to even. Built on x - floor(x), which is exact; x + 0.5 is not
    (it rounds up odd integers from 2^23 on in fp32, and 0.49999997 to 1)."""
    f = f"tl.floor({x})"
    frac = f"({x} - {f})"
    odd = f"({f} - 2.0 * tl.floor({f} * 0.5))"  # 1.0 when f is odd, else 0.0
    r = f"tl.where({frac} > 0.5, {f} + 1.0, tl.where({frac} == 0.5, {f} + {odd}, {f}))"
    return f"tl.where({r} == 0.0, {x} * 0.0, {r})"  # zero keeps x's sign: round(-0.3) is -0.0, as in eager


def _exponent(n: fx.Node):
    """pow's scalar exponent as eager's kernels take it on both devices: rounded to a bf16/fp16 result's
    dtype (x ** 4.095 in fp16 is x ** 4.09375); a scalar base is rounded by operand_rounding.rounded_scalars."""
    e, out = n.args[1], n.meta["val"].dtype
    return torch.tensor(e, dtype=out).item() if isinstance(e, float) and out in LOW_PRECISION else e


def _pow_scalar(c, x, e):
    """x ** e for a Python scalar e: small integer exponents multiply, others use exp2/log2 or libdevice."""
    e = float(e)
    if e == 0.0:  # 1 everywhere, NaN and inf included (x * 0 + 1 would give NaN there)
        if c.compute.is_floating_point:
            return f"tl.where({x} != {x}, 1.0, 1.0).to({x}.dtype)"
        return f"({x} * 0 + 1)"
    if e == 1.0:
        return f"({x})"
    if e == 2.0:
        return f"({x} * {x})"
    if e == 3.0:
        return f"({x} * {x} * {x})"
    if not c.compute.is_floating_point and e.is_integer() and e > 0:
        # integer base: exact repeated products (exp2/log2 and libdevice.pow take floats only);
        # (a negative integer exponent stays ATen, which raises: op_classes.pointwise_unsupported_reason)
        return "(" + " * ".join([x] * int(e)) + ")"
    if e == 0.5:
        return _sqrt(c, x)
    if e == -0.5:
        return _rsqrt(c, x)
    if e == -1.0:
        return true_divide(c, "1.0", x)
    if e == -2.0:
        return true_divide(c, "1.0", f"({x} * {x})")
    if c.target == "cuda":  # (a float64 base takes a float64 exponent: dtypes.float64_operand)
        return f"libdevice.pow({x}, {float64_operand(repr(e)) if c.compute == torch.float64 else repr(e)})"
    # the interpreter: |x| ** e through float64 exp2/log2 (in fp32, 1e10 ** -1.5 was 17 ulp off)
    mag = f"tl.exp2({e!r} * tl.log2(tl.abs({x}).to(tl.float64))).to({x}.dtype)"
    if e.is_integer():  # odd integer exponents keep the sign; negative bases are fine
        return f"tl.where({x} < 0, -{mag}, {mag})" if int(e) % 2 else mag
    # a finite negative base is NaN, as pow's; -inf ** e is |x| ** e (0 or inf), as C's pow
    return f'tl.where(({x} < 0) & ({x} != float("-inf")), float("nan"), {mag})'


def _clamp(x, lo, hi):
    """torch.clamp: NaN in x passes through (comparisons with NaN are false); a NaN bound makes the result
    NaN, so a bound that is not a plain number literal is also tested for NaN (a tensor bound: a NaN scalar
    bound is not fused, op_classes.pointwise_unsupported_reason)."""
    out = x
    if lo is not None:
        out = _past(out, "<", lo)
    if hi is not None:
        out = _past(out, ">", hi)
    return out


def _past(x: str, cmp: str, bound: str) -> str:
    """x moved to the bound where `x cmp bound`; the bound itself where it is NaN, if it may be (a tensor
    operand, or the NaN literal). Nested selections, not `(x cmp b) | (b != b)`: the interpreter cannot
    `|` a block with a 0-d tensor bound's scalar (F.cosine_similarity's clamp crashed on the CPU)."""
    clamped = f"tl.where({x} {cmp} {bound}, {bound}, {x})"
    try:
        float(bound)  # a number literal ("0.0", "-1", "6"): never NaN
        return clamped
    except ValueError:
        return f"tl.where({bound} != {bound}, {bound}, {clamped})"


def _cast(c, x):
    return f"{x}.to({TL_DTYPE[c.out_dtype]})"


def _bitwise_not(c, x: str) -> str:
    """~x; on uint8 as x ^ 0xFF in uint8 (Triton 3.6's interpreter inverts through numpy with -1, which
    numpy 2 refuses for unsigned arrays; the xor is the same bits everywhere)."""
    if c.compute == torch.bool:
        return f"({x} == 0)"
    if c.compute == torch.uint8:
        return f"({x} ^ tl.full([], 255, tl.uint8))"
    return f"(~{x})"


def _sign(c, x):
    """Floats select float constants: on an H100, `where(y > 0, 1, where(y < 0, -1, 0)).to(float32)` of a
    y rounded through bf16 was compiled to packed bf16x2 code that returned 1 for negative values
    whenever a thread held two or more elements (half of a 1M-element sign, and abs's backward, wrong)."""
    if c.compute.is_floating_point:
        return f"tl.where({x} > 0, 1.0, tl.where({x} < 0, -1.0, 0.0)).to({x}.dtype)"
    return f"tl.where({x} > 0, 1, tl.where({x} < 0, -1, 0)).to({x}.dtype)"


def _add(c, o):
    if c.compute == torch.bool:  # torch: True + True is True (logical or); Triton's int1 + int1 wraps to 0
        return f"({o[0]} | {o[1]})" if len(o) < 3 else f"({o[0]} | ({o[2]} & {o[1]}))"
    return f"({o[0]} + {o[1]})" if len(o) < 3 else _plus_scaled(c, o[0], o[2], o[1])


def _sub(c, a: str, b: str, alpha: list[str]) -> str:
    """a - alpha * b (alpha: [] or [its expression])."""
    return f"({a} - {b})" if not alpha else _plus_scaled(c, a, f"-({alpha[0]})", b)


def _plus_scaled(c, a: str, alpha: str, b: str) -> str:
    """a + alpha * b as eager's add/sub kernels compute it: one fma in the compute dtype (their compilers
    contract it: CUDA's kernels, and the CPU's vectorised ones, which handle all but tensors under 32
    elements), so alpha * b never overflows on its own (bf16 x - 2.0001 * x near bf16's max: eager -3.0e38,
    a separate product gave -inf; generated kernels are compiled without contraction, kernel.NO_FP_FUSION)."""
    if c.compute.is_floating_point:
        return f"tl.fma({b}, {alpha}, {a})"
    return f"({a} + {alpha} * {b})"


# Each entry: (LowerCtx, node, operand expressions) -> expression. Operands follow node.args order.
LOWERINGS = {
    aten.abs.default: lambda c, n, o: f"tl.abs({o[0]})",  # (int8/int16 on the GPU: ATen, op_classes)
    # Triton spells float negation 0 - x, which turns -0.0 into +0.0 (so 1/-x would flip sign at 0)
    aten.neg.default: lambda c, n, o: f"({o[0]} * -1.0)" if c.compute.is_floating_point else f"(-{o[0]})",
    aten.exp.default: lambda c, n, o: _exp(c, o[0]),
    aten.exp2.default: lambda c, n, o: f"libdevice.exp2({o[0]})" if c.exact else f"tl.exp2({o[0]})",
    aten.expm1.default: lambda c, n, o: _libdevice_or("expm1", _expm1_tl)(c, o[0]),
    aten.log.default: lambda c, n, o: _log(c, o[0]),
    aten.log2.default: lambda c, n, o: f"libdevice.log2({o[0]})" if c.exact else f"tl.log2({o[0]})",
    aten.log10.default: lambda c, n, o: f"libdevice.log10({o[0]})" if c.exact else f"(tl.log2({o[0]}) * 0.30102999566398120)",
    aten.log1p.default: lambda c, n, o: _libdevice_or("log1p", _log1p_tl)(c, o[0]),
    aten.sqrt.default: lambda c, n, o: _sqrt(c, o[0]),
    aten.rsqrt.default: lambda c, n, o: _rsqrt(c, o[0]),
    # sin/cos keep libdevice for every fp32 value: the hardware approximations lose accuracy on large
    # arguments (rotary embeddings' angles reach thousands of radians)
    aten.sin.default: lambda c, n, o: f"libdevice.sin({o[0]})" if c.exact_trig else f"tl.sin({o[0]})",
    aten.cos.default: lambda c, n, o: f"libdevice.cos({o[0]})" if c.exact_trig else f"tl.cos({o[0]})",
    aten.tan.default: lambda c, n, o: f"libdevice.tan({o[0]})",
    aten.asin.default: lambda c, n, o: f"libdevice.asin({o[0]})",
    aten.acos.default: lambda c, n, o: f"libdevice.acos({o[0]})",
    aten.atan.default: lambda c, n, o: f"libdevice.atan({o[0]})",
    aten.sinh.default: lambda c, n, o: f"libdevice.sinh({o[0]})",
    aten.cosh.default: lambda c, n, o: f"libdevice.cosh({o[0]})",
    aten.asinh.default: lambda c, n, o: f"libdevice.asinh({o[0]})",
    aten.acosh.default: lambda c, n, o: f"libdevice.acosh({o[0]})",
    aten.atanh.default: lambda c, n, o: f"libdevice.atanh({o[0]})",
    aten.tanh.default: lambda c, n, o: _tanh(c, o[0]),
    aten.sigmoid.default: lambda c, n, o: _sigmoid(c, o[0]),
    aten.erf.default: lambda c, n, o: _erf(c, o[0]),
    aten.erfc.default: lambda c, n, o: f"libdevice.erfc({o[0]})",
    aten.reciprocal.default: lambda c, n, o: true_divide(c, "1.0", o[0]),
    aten.floor.default: lambda c, n, o: f"tl.floor({o[0]})" if c.compute.is_floating_point else o[0],
    aten.ceil.default: lambda c, n, o: f"tl.ceil({o[0]})" if c.compute.is_floating_point else o[0],
    aten.trunc.default: lambda c, n, o: (f"tl.where({o[0]} < 0, tl.ceil({o[0]}), tl.floor({o[0]}))"
                                         if c.compute.is_floating_point else o[0]),
    aten.round.default: lambda c, n, o: _round_half_even(o[0]) if c.compute.is_floating_point else o[0],
    aten.sign.default: lambda c, n, o: _sign(c, o[0]),
    aten.relu.default: lambda c, n, o: f"tl.where({o[0]} < 0, 0, {o[0]})",
    aten.isnan.default: lambda c, n, o: f"({o[0]} != {o[0]})",
    aten.isinf.default: lambda c, n, o: f"(tl.abs({o[0]}) == float(\"inf\"))",
    aten.logical_not.default: lambda c, n, o: f"({o[0]} == 0)",
    aten.bitwise_not.default: lambda c, n, o: _bitwise_not(c, o[0]),
    aten.gelu.default: lambda c, n, o: _gelu(c, o[0], n.kwargs.get("approximate", "none")),
    aten.silu.default: lambda c, n, o: f"({o[0]} * {_sigmoid(c, o[0])})",
    aten.clone.default: lambda c, n, o: o[0],
    aten.leaky_relu.default: lambda c, n, o: f"tl.where({o[0]} > 0, {o[0]}, {o[0]} * {o[1] if len(o) > 1 else 0.01})",
    aten.clamp_min.default: lambda c, n, o: _clamp(o[0], o[1], None),
    aten.clamp_max.default: lambda c, n, o: _clamp(o[0], None, o[1]),
    aten.clamp.default: lambda c, n, o: _clamp(o[0], o[1] if len(o) > 1 else None, o[2] if len(o) > 2 else None),
    aten.clamp.Tensor: lambda c, n, o: _clamp(o[0], o[1] if len(o) > 1 else None, o[2] if len(o) > 2 else None),
    aten.hardtanh.default: lambda c, n, o: _clamp(o[0], o[1] if len(o) > 1 else -1.0, o[2] if len(o) > 2 else 1.0),
    aten.add.Tensor: lambda c, n, o: _add(c, o),
    aten.add.Scalar: lambda c, n, o: _add(c, o),
    aten.sub.Tensor: lambda c, n, o: _sub(c, o[0], o[1], o[2:]),
    aten.sub.Scalar: lambda c, n, o: _sub(c, o[0], o[1], o[2:]),
    aten.rsub.Scalar: lambda c, n, o: _sub(c, o[1], o[0], o[2:]),
    aten.mul.Tensor: lambda c, n, o: f"({o[0]} * {o[1]})",
    aten.mul.Scalar: lambda c, n, o: f"({o[0]} * {o[1]})",
    aten.div.Tensor: lower_div,
    aten.div.Scalar: lower_div,
    aten.eq.Tensor: lambda c, n, o: f"({o[0]} == {o[1]})",
    aten.eq.Scalar: lambda c, n, o: f"({o[0]} == {o[1]})",
    aten.ne.Tensor: lambda c, n, o: f"({o[0]} != {o[1]})",
    aten.ne.Scalar: lambda c, n, o: f"({o[0]} != {o[1]})",
    aten.lt.Tensor: lambda c, n, o: f"({o[0]} < {o[1]})",
    aten.lt.Scalar: lambda c, n, o: f"({o[0]} < {o[1]})",
    aten.le.Tensor: lambda c, n, o: f"({o[0]} <= {o[1]})",
    aten.le.Scalar: lambda c, n, o: f"({o[0]} <= {o[1]})",
    aten.gt.Tensor: lambda c, n, o: f"({o[0]} > {o[1]})",
    aten.gt.Scalar: lambda c, n, o: f"({o[0]} > {o[1]})",
    aten.ge.Tensor: lambda c, n, o: f"({o[0]} >= {o[1]})",
    aten.ge.Scalar: lambda c, n, o: f"({o[0]} >= {o[1]})",
    aten.fmod.Tensor: lambda c, n, o: fmod(c, o[0], o[1]),
    aten.fmod.Scalar: lambda c, n, o: fmod(c, o[0], o[1]),
    aten.remainder.Tensor: lambda c, n, o: remainder(c, o[0], o[1]),
    aten.remainder.Scalar: lambda c, n, o: remainder(c, o[0], o[1]),
    aten.bitwise_and.Tensor: lambda c, n, o: f"({o[0]} & {o[1]})",
    aten.bitwise_and.Scalar: lambda c, n, o: f"({o[0]} & {o[1]})",
    aten.bitwise_or.Tensor: lambda c, n, o: f"({o[0]} | {o[1]})",
    aten.bitwise_or.Scalar: lambda c, n, o: f"({o[0]} | {o[1]})",
    aten.bitwise_xor.Tensor: lambda c, n, o: f"({o[0]} ^ {o[1]})",
    aten.bitwise_xor.Scalar: lambda c, n, o: f"({o[0]} ^ {o[1]})",
    aten.maximum.default: lambda c, n, o: f"tl.maximum({o[0]}, {o[1]}, propagate_nan=tl.PropagateNan.ALL)",
    aten.minimum.default: lambda c, n, o: f"tl.minimum({o[0]}, {o[1]}, propagate_nan=tl.PropagateNan.ALL)",
    aten.atan2.default: lambda c, n, o: f"libdevice.atan2({o[0]}, {o[1]})",
    aten.hypot.default: lambda c, n, o: f"libdevice.hypot({o[0]}, {o[1]})",
    aten.logical_and.default: lambda c, n, o: f"(({o[0]} != 0) & ({o[1]} != 0))",
    aten.logical_or.default: lambda c, n, o: f"(({o[0]} != 0) | ({o[1]} != 0))",
    aten.logical_xor.default: lambda c, n, o: f"(({o[0]} != 0) ^ ({o[1]} != 0))",
    aten.pow.Tensor_Scalar: lambda c, n, o: _pow_scalar(c, o[0], _exponent(n)),
    aten.pow.Tensor_Tensor: lambda c, n, o: f"libdevice.pow({o[0]}, {o[1]})",
    aten.pow.Scalar: lambda c, n, o: f"libdevice.pow({o[0]}, {o[1]})",  # (base: operand_rounding)
    aten.where.self: lambda c, n, o: f"tl.where({o[0]}, {o[1]}, {o[2]})",
    aten._to_copy.default: lambda c, n, o: _cast(c, o[0]),
    prims.convert_element_type.default: lambda c, n, o: _cast(c, o[0]),
    aten.threshold_backward.default: lambda c, n, o: f"tl.where({o[1]} <= {o[2]}, 0.0, {o[0]})",
    aten.sigmoid_backward.default: lambda c, n, o: f"({o[0]} * {o[1]} * (1.0 - {o[1]}))",
    aten.tanh_backward.default: lambda c, n, o: f"({o[0]} * (1.0 - {o[1]} * {o[1]}))",
    aten.gelu_backward.default: lambda c, n, o: (
        f"({o[0]} * (0.5 * (1.0 + {_erf(c, f'{o[1]} * 0.7071067811865476')}) + "
        f"{o[1]} * 0.3989422804014327 * {_exp(c, f'-0.5 * {o[1]} * {o[1]}')}))"),
    aten.silu_backward.default: lambda c, n, o: (
        f"({o[0]} * {_sigmoid(c, o[1])} * (1.0 + {o[1]} * (1.0 - {_sigmoid(c, o[1])})))"),
}

# Ops whose operands are not simply cast to the result's compute dtype.
BOOL_OPERANDS = {aten.logical_and.default, aten.logical_or.default, aten.logical_xor.default,
                 aten.logical_not.default}
PROMOTED_OPERANDS = {aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.lt.Tensor,
                     aten.lt.Scalar, aten.le.Tensor, aten.le.Scalar, aten.gt.Tensor, aten.gt.Scalar,
                     aten.ge.Tensor, aten.ge.Scalar, aten.isnan.default, aten.isinf.default}
UNCAST_OPERANDS = {aten._to_copy.default, prims.convert_element_type.default, aten.clone.default}

def promoted_dtypes(node: fx.Node) -> tuple[torch.dtype, torch.dtype]:
    """(computation dtype, common dtype) of the node's operands under torch's default type promotion."""
    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in node.args if a is not None]
    return elementwise_dtypes(*vals, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)


def operand_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype the node's tensor operands are cast to before the op (None: leave as loaded)."""
    out = node.meta["val"].dtype
    if node.target in UNCAST_OPERANDS:
        return None
    if node.target in BOOL_OPERANDS:
        return torch.bool
    if node.target in PROMOTED_OPERANDS:
        return compute_dtype(promoted_dtypes(node)[0])
    return compute_dtype(out)
