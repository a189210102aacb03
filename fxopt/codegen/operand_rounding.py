"""Which operands a fused op reads rounded to bf16/fp16 first, as eager holds them.

A kernel keeps bf16/fp16 values in fp32 between ops and rounds them where it stores, as Inductor does:
arithmetic on the unrounded values is at least as accurate as eager's. Some ops are not continuous in
their operands, and there one rounding step changes the answer by a whole unit, a sign or a boolean. Those
ops read their operands rounded, in two ways:
- comparisons, selections and remainders round to the common (for selections and remainders, the
  result's) dtype, as eager casts every operand to it first: with bf16/fp16 tensors a scalar is rounded
  (`h == 0.1` compares with fp16(0.1), `clamp(h, 0.1)` gives fp16(0.1), `h % 0.1` divides by fp16(0.1):
  ATen's remainder kernels take no opmath scalar), and so is a value the kernel holds in fp32;
- casts, rounding to integers (floor, ceil, trunc, round), sign, isinf/isnan, logical ops,
  maximum/minimum, and the comparisons, selections and remainders above read each bf16/fp16 operand
  rounded to its own dtype (also where the common dtype is fp32: `x * 3 == y` with x fp16, y
  fp32). `(x * 3).int()` of fp16 x = 1365 is 4096 in eager, since fp16(4095) = 4096; unrounded it was
  4095. `nan_to_num(x * 1000)` of x = 100 must see eager's inf, and `(x * 1e-6).sign()` eager's
  underflow to 0.
Arithmetic computes a scalar in fp32 (opmath), as eager's CUDA kernels do, so it needs neither. Eager's
CPU add/sub kernels round a Python-number operand and alpha to a 16-bit tensor's dtype (`x + 4095` of fp16
x = -4096 is 0 on the CPU, -1 on CUDA): the interpreter's kernels do the same (rounded_scalars). pow
rounds its scalar operand, exponent or base, to a bf16/fp16 result's dtype on both devices (the base here,
the exponent in pointwise_ops._exponent).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .dtypes import LOW_PRECISION
from .pointwise_ops import PROMOTED_OPERANDS, UNCAST_OPERANDS, promoted_dtypes

aten = torch.ops.aten

COMPARISONS = PROMOTED_OPERANDS - {aten.isnan.default, aten.isinf.default}
RESULT_DTYPE_OPERANDS = {aten.where.self, aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default,
                         aten.clamp_max.default, aten.hardtanh.default, aten.remainder.Scalar,
                         aten.remainder.Tensor, aten.fmod.Scalar, aten.fmod.Tensor}
OWN_DTYPE_OPERANDS = (UNCAST_OPERANDS - {aten.clone.default}) | COMPARISONS | RESULT_DTYPE_OPERANDS | {
    aten.floor.default, aten.ceil.default, aten.trunc.default, aten.round.default, aten.sign.default,
    aten.isnan.default, aten.isinf.default, aten.logical_and.default, aten.logical_or.default,
    aten.logical_xor.default, aten.logical_not.default, aten.maximum.default, aten.minimum.default}


def rounded_operands(node: fx.Node) -> torch.dtype | None:
    """The bf16/fp16 dtype a comparison's, selection's or remainder's operands are rounded to first, or None."""
    if node.target in COMPARISONS:
        common = promoted_dtypes(node)[1]
    elif node.target in RESULT_DTYPE_OPERANDS:
        common = node.meta["val"].dtype
    else:
        return None
    return common if common in LOW_PRECISION else None


CPU_ROUNDED_SCALARS = {aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Scalar}


def rounded_scalars(node: fx.Node, target: str) -> torch.dtype | None:
    """The 16-bit dtype a Python-number operand is rounded to first, as eager's kernel takes it: pow's
    base on both devices; add/sub's operand and alpha on the CPU (interpreter kernels; CUDA's take them in
    fp32). None elsewhere."""
    out = node.meta["val"].dtype
    if out in LOW_PRECISION and (node.target is aten.pow.Scalar
                                 or (target == "interpret" and node.target in CPU_ROUNDED_SCALARS)):
        return out
    return None


def reads_own_dtype(node: fx.Node) -> bool:
    """Whether the node reads each bf16/fp16 operand rounded to its own dtype (see the module docstring)."""
    return node.target in OWN_DTYPE_OPERANDS
