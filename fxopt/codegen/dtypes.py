"""torch dtypes as Triton spells them, and the dtype a value is computed in inside a kernel."""
from __future__ import annotations

import math
import re

import torch

TL_DTYPE = {
    torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
    torch.float64: "tl.float64", torch.int64: "tl.int64", torch.int32: "tl.int32", torch.int16: "tl.int16",
    torch.int8: "tl.int8", torch.uint8: "tl.uint8", torch.bool: "tl.int1",
}
LOW_PRECISION = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """bf16/fp16 values are computed in fp32 inside kernels; everything else in its own dtype."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


def literal(value, dtype: torch.dtype) -> str:
    """A Python scalar written as a literal of `dtype` in Triton source."""
    if dtype == torch.bool:
        return "True" if value else "False"
    if dtype.is_floating_point:
        v = float(value)
        if math.isnan(v):
            return 'float("nan")'
        if math.isinf(v):
            return 'float("inf")' if v > 0 else 'float("-inf")'
        return repr(v)
    return str(int(value))


_FLOAT_LITERAL = re.compile(r'-?(\d+\.\d*(e[-+]?\d+)?|\d+e[-+]?\d+|float\("-?(inf|nan)"\))')


def is_float_literal(expr: str) -> bool:
    """Whether `expr` is a float `literal` wrote (not a tensor's name or an expression)."""
    return _FLOAT_LITERAL.fullmatch(expr) is not None


def float64_operand(expr: str) -> str:
    """`expr` as an operand of a float64 computation: a float literal made float64 explicitly. Triton
    before 3.9 turned a Python float given to tl.fma into float32 (2.0001 -> 2.000099897) and one given
    to a libdevice function beside a float64 tensor failed to compile (fmod(x, 0.6) on the H100)."""
    return f"tl.full([], {expr}, tl.float64)" if is_float_literal(expr) else expr


def cast_via(source: torch.dtype | None, out: torch.dtype) -> str | None:
    """The Triton dtype a cast from `source` to `out` must pass through to round or wrap as eager's
    does, or None. Eager converts float64 and integers to bf16/fp16 through float32 (two roundings;
    the GPU's one-step cvt rounds 2^24 + 2^16 + 1 differently), floats to uint8 through int64 (wrapping:
    -1.5 -> 255; the GPU's cvt to a narrow integer saturates negatives to 0) and to int8/int16 through
    int32, which saturates, as eager's CUDA kernels do (1e10 -> int16 -1, not int64's wrapped -7168;
    the CPU's 0x80000000 for it truncates to 0 there, as eager on the CPU)."""
    if source is None or source == torch.bool:
        return None
    if out in LOW_PRECISION and (source == torch.float64 or not source.is_floating_point):
        return "tl.float32"
    if out == torch.uint8 and source.is_floating_point:
        return "tl.int64"
    if out in (torch.int8, torch.int16) and source.is_floating_point:
        return "tl.int32"
    return None


# PTX conversions of wide integers to float32 (the operand type and its register constraint)
_INT_TO_F32 = {torch.int32: ("s32", "r"), torch.int64: ("s64", "l")}


def cast_operand(x: str, source: torch.dtype | None, out: torch.dtype, target: str) -> str:
    """Triton source for `x` (of dtype `source`) on its way to a cast to `out`, through what cast_via
    names. On the GPU a wide integer's step to float32 is one PTX instruction the compiler cannot see
    through: LLVM folds `int -> float32 -> bf16/fp16` into a single cvt.rn.bf16.s32 (one rounding:
    2^24 + 2^16 + 1 became 16908288 where eager's two give 16777216; found on an H100, 2026-12-06)."""
    via = cast_via(source, out)
    if via is None:
        return x
    if via == "tl.float32" and target == "cuda" and source in _INT_TO_F32:
        kind, register = _INT_TO_F32[source]
        return (f'tl.inline_asm_elementwise("cvt.rn.f32.{kind} $0, $1;", "=r,{register}", [{x}], '
                "dtype=tl.float32, is_pure=True, pack=1)")
    return f"{x}.to({via})"

