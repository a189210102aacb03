"""A float32 division by a per-row value, written the same way in every kernel.

A row kernel divides a row by a row scalar (softmax's exp / sum, a mean's x / n) as `x * (1.0 / s)`:
one correctly rounded division per row (`true_divide`: Triton's own fp32 `/` is not correctly rounded on
the GPU) instead of one per element (a dozen instructions each), the product within an ulp of the
quotient. The same expression evaluated by another kernel (a copy of the
chain for a column reduction, a backward that recomputes the softmax) must round the same way, or values
equal in eager differ across kernels: amax's backward finds its element by equality, and
`softmax(x).amax(0)` had NaN gradients (0/0) where one kernel multiplied by the reciprocal and another
divided (the fuzzer of 2026-12-06). So every kernel, pointwise or reduction, writes a float32 division
by a value broadcast along the last dim (size 1 there, the result's larger) as the product with its
reciprocal.

A division by a Python number on the GPU is the product with its reciprocal, as eager's CUDA kernel
computes it (a CPU scalar divisor: `a * (1 / b)`, the reciprocal rounded to the compute dtype on the
host); on the CPU eager divides, and so do generated kernels there.

The C remainder (fmod) and ATen's remainder (the divisor's sign) are here too.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..analysis.symbolic import sizes
from .dtypes import literal


def by_row_value(n: fx.Node) -> bool:
    """`a / b` with b the same for every element of a row (its last dim 1 where the result's is not)."""
    b = n.args[1] if len(n.args) > 1 else None
    vb, out = getattr(b, "meta", {}).get("val"), n.meta.get("val")
    if n.kwargs or not (isinstance(vb, torch.Tensor) and isinstance(out, torch.Tensor)) or vb.dim() == 0:
        return False
    return sizes(vb)[-1] == 1 and sizes(out)[-1] != 1


def lower_div(c, n: fx.Node, o: list[str]) -> str:
    """aten.div.Tensor and div.Scalar in a kernel (pointwise_ops.LOWERINGS): see the module docstring."""
    b = n.args[1]
    if c.target == "cuda" and c.compute.is_floating_point and isinstance(b, (int, float)):
        return f"({o[0]} * {literal(reciprocal_as_eager(b, c.compute), c.compute)})"
    if c.compute == torch.float32 and by_row_value(n):
        return f"({o[0]} * {true_divide(c, '1.0', o[1])})"
    return true_divide(c, o[0], o[1])


def reciprocal_as_eager(b: float, compute: torch.dtype) -> float:
    """1 / b as eager's CUDA division computes it for a scalar divisor: b and the quotient in the compute
    dtype (a * (1/3) is not a / 3 in a third of float32 cases; eager's is the product)."""
    one = torch.tensor(1.0, dtype=compute)
    return (one / torch.tensor(b, dtype=compute)).item()


def true_divide(c, a: str, b: str) -> str:
    """a / b correctly rounded, as eager's IEEE division: Triton's float32 `/` compiles to the approximate
    div.full.f32 on NVIDIA GPUs (up to 2 ulp off, so an exact quotient can come out an ulp low and a floor
    of it one less), hence tl.math.div_rn (the interpreter's is numpy's division, as its `/`). float64's
    `/` is already IEEE."""
    return f"tl.math.div_rn({a}, {b})" if c.compute == torch.float32 else f"({a} / {b})"


def remainder(c, a, b):
    """Python-style remainder (sign of the divisor), as ATen computes it: the C remainder (fmod for
    floats, exact; srem for integers) corrected by b where the signs differ. a - b * floor(a / b) is
    not exact: it loses integers from 2^24 on (the division runs in fp32) and whole periods for floats.
    Floats on the GPU use libdevice.fmod: Triton's float `%` there is not exact for |a| >> |b|
    (remainder(-1e30, 7) came out 2.8e22); the interpreter's `%` is numpy's exact fmod."""
    exact_fmod = c.target == "cuda" and c.compute.is_floating_point
    r = f"libdevice.fmod({a}, {b})" if exact_fmod else f"({a} % {b})"
    return f"tl.where(({r} != 0) & (({r} < 0) != ({b} < 0)), {r} + {b}, {r})"


def fmod(c, a: str, b: str) -> str:
    """C's remainder: libdevice.fmod for floats, Triton's `%` (srem, the same sign rule) for integers,
    which libdevice.fmod does not take (an int fmod did not compile on the GPU)."""
    return f"libdevice.fmod({a}, {b})" if c.compute.is_floating_point else f"({a} % {b})"
