"""A float32 division by a per-row value, written the same way in every kernel.

A row kernel divides a row by a row scalar (softmax's exp / sum, a mean's x / n) as `x * (1.0 / s)`:
one correctly rounded division per row instead of one per element (a dozen instructions each), the
product within an ulp of the quotient. The same expression evaluated by another kernel (a copy of the
chain for a column reduction, a backward that recomputes the softmax) must round the same way, or values
equal in eager differ across kernels: amax's backward finds its element by equality, and
`softmax(x).amax(0)` had NaN gradients (0/0) where one kernel multiplied by the reciprocal and another
divided (the fuzzer of 2026-12-06). So every kernel, pointwise or reduction, writes a float32 division
by a value broadcast along the last dim (size 1 there, the result's larger) as the product with its
reciprocal.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..analysis.symbolic import sizes


def by_row_value(n: fx.Node) -> bool:
    """`a / b` with b the same for every element of a row (its last dim 1 where the result's is not)."""
    b = n.args[1] if len(n.args) > 1 else None
    vb, out = getattr(b, "meta", {}).get("val"), n.meta.get("val")
    if n.kwargs or not (isinstance(vb, torch.Tensor) and isinstance(out, torch.Tensor)) or vb.dim() == 0:
        return False
    return sizes(vb)[-1] == 1 and sizes(out)[-1] != 1


def lower_div(c, n: fx.Node, o: list[str]) -> str:
    """aten.div.Tensor in a kernel (pointwise_ops.LOWERINGS): see the module docstring."""
    if c.compute == torch.float32 and by_row_value(n):
        return f"({o[0]} * (1.0 / {o[1]}))"
    return f"({o[0]} / {o[1]})"
