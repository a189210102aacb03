"""Cross-entropy over large vocabularies as two Triton kernels, with no [N, V] intermediate.

Forward: one program per row walks the vocabulary BLOCK_V logits at a time and keeps an online
log-sum-exp in float32: the row's running max m (a scalar, one block max per step) and, per lane, the
running sum of exp(x - m), rescaled by exp(m_old - m_new) when a block raises the max. That is one
exp per logit and one read of the logits. The target's logit is one scalar load. It writes the row's
loss lse - x[target] and lse itself (float32), which is all the backward needs.

Backward: grad[i, j] = (softmax(x_i)_j - [j == t_i]) * scale_i, with softmax recomputed from the
saved lse in the same single pass that writes the gradient: one read of the logits, one write of the
gradient, in the logits' dtype. Eager PyTorch instead keeps log_softmax [N, V] for the backward and
materialises its gradient [N, V] as well.

Ignored rows (target == ignore_index) are not read at all: their loss is 0, their lse is stored as
-inf, and their gradient row is written as zeros. A target outside [0, V) that is not ignore_index
gives a NaN loss (eager raises; a kernel cannot, without a host sync).

Next step (not done): when the op owns its logits (a matmul output no one else reads), the backward
could write the gradient into the logits' own buffer, so the whole loss holds one [N, V] buffer.
Autograd may still need the logits elsewhere, so the gradient is a new tensor for now.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..codegen.interpreter_guard import launcher
from ..codegen.wrapper_runtime import next_power_of_2

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GPU_BLOCK_V = 4096  # logits per step on the GPU (see row_config)
CPU_BLOCK_V = 1024  # the interpreter: large enough to be quick, small enough that tests loop over blocks


def row_config(n_cols: int, device_type: str, block_v: int | None = None) -> dict:
    """BLOCK_V and num_warps for rows of n_cols logits. A block never exceeds the row (rounded up to
    a power of two). On the GPU, 4096 logits over 8 warps is 16 per thread (two 16-byte loads in
    bf16): a starting point, not yet tuned on the H200."""
    cap = block_v or (GPU_BLOCK_V if device_type == "cuda" else CPU_BLOCK_V)
    block = min(next_power_of_2(max(n_cols, 1)), next_power_of_2(cap))
    return dict(BLOCK_V=block, num_warps=8 if block >= 2048 else 4)


def cross_entropy_rows(logits: Tensor, target: Tensor, ignore_index: int,
                       block_v: int | None = None) -> tuple[Tensor, Tensor]:
    """Per-row (loss, lse), both float32 [N]. logits [N, V] fp32/bf16/fp16 with a contiguous last dim
    (any row stride); target int64 [N]."""
    _check(logits, target)
    logits = _rows_contiguous(logits)
    n_rows, n_cols = logits.shape
    loss = torch.empty(n_rows, device=logits.device, dtype=torch.float32)
    lse = torch.empty(n_rows, device=logits.device, dtype=torch.float32)
    if n_rows == 0:
        return loss, lse
    cfg = row_config(n_cols, logits.device.type, block_v)
    launcher(_forward_kernel, (n_rows,), logits.device, "fxopt cross_entropy")(
        logits, target, loss, lse, logits.stride(0), n_cols, ignore_index,
        BLOCK_V=cfg["BLOCK_V"], num_warps=cfg["num_warps"])
    return loss, lse


def cross_entropy_grad(logits: Tensor, target: Tensor, lse: Tensor, scale: Tensor, ignore_index: int,
                       block_v: int | None = None) -> Tensor:
    """grad_logits [N, V] (contiguous, logits' dtype) = (softmax - onehot(target)) * scale per row.
    `scale`: float32, 0-d (one factor for every row: "mean" and "sum") or [N] ("none")."""
    _check(logits, target)
    logits = _rows_contiguous(logits)
    n_rows, n_cols = logits.shape
    grad = torch.empty(n_rows, n_cols, device=logits.device, dtype=logits.dtype)
    if n_rows == 0:
        return grad
    scale = scale.to(torch.float32)
    scale_stride = 0 if scale.dim() == 0 else scale.stride(0)
    cfg = row_config(n_cols, logits.device.type, block_v)
    launcher(_backward_kernel, (n_rows,), logits.device, "fxopt cross_entropy")(
        logits, target, lse, scale, grad, logits.stride(0), grad.stride(0), scale_stride, n_cols, ignore_index,
        BLOCK_V=cfg["BLOCK_V"], EVEN_V=n_cols % cfg["BLOCK_V"] == 0, num_warps=cfg["num_warps"])
    return grad


def _rows_contiguous(logits: Tensor) -> Tensor:
    """Rows may be strided (a slice of a bigger buffer) but each row must be contiguous: the kernels
    address a row as base + column. Anything else (a transposed view) is copied once here."""
    if logits.stride(1) != 1 and logits.shape[1] > 1:
        return logits.contiguous()
    return logits


def _check(logits: Tensor, target: Tensor) -> None:
    """ValueError naming what is wrong, before anything launches."""
    if logits.dim() != 2 or logits.dtype not in DTYPES:
        raise ValueError(f"fxopt cross_entropy: logits must be a 2-D [N, V] tensor of {DTYPES}, got "
                         f"{logits.dtype} {list(logits.shape)}")
    if target.dtype != torch.int64 or tuple(target.shape) != (logits.shape[0],):
        raise ValueError(f"fxopt cross_entropy: target must be int64 [N={logits.shape[0]}], got "
                         f"{target.dtype} {list(target.shape)}")
    if target.device != logits.device or logits.device.type not in ("cpu", "cuda"):
        raise ValueError(f"fxopt cross_entropy: logits ({logits.device}) and target ({target.device}) must be "
                         "on one cuda device or the cpu (Triton interpreter)")


@triton.jit
def _forward_kernel(Logits, Target, Loss, Lse, stride_row, n_cols, ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * stride passes 2**31 at 16K x 128K
    logits = Logits + row * stride_row
    target = tl.load(Target + row)
    keep = target != ignore_index
    end = tl.where(keep, n_cols, 0)  # the load mask: ignored rows read nothing
    cols = tl.arange(0, BLOCK_V)
    row_max = float("-inf")
    sums = tl.zeros([BLOCK_V], dtype=tl.float32)  # per lane: sum of exp(x - shift)
    for start in range(0, n_cols, BLOCK_V):
        x = tl.load(logits + start + cols, mask=start + cols < end, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(row_max, tl.max(x, axis=0))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # all -inf so far: exp(-inf - 0) = 0, not NaN
        sums = sums * tl.exp(row_max - shift) + tl.exp(x - shift)
        row_max = new_max
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    total = tl.sum(sums, axis=0)
    lse = tl.where(keep, shift + tl.log(tl.where(keep, total, 1.0)), float("-inf"))  # no log(0) for ignored rows
    in_range = (target >= 0) & (target < n_cols)
    picked = tl.load(logits + target, mask=keep & in_range, other=0.0).to(tl.float32)
    loss = tl.where(in_range, lse - picked, float("nan"))
    tl.store(Loss + row, tl.where(keep, loss, 0.0))
    tl.store(Lse + row, lse)


@triton.jit
def _backward_kernel(Logits, Target, Lse, Scale, Grad, stride_row, stride_grad, scale_stride, n_cols,
                     ignore_index, BLOCK_V: tl.constexpr, EVEN_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    logits = Logits + row * stride_row
    grad = Grad + row * stride_grad
    target = tl.load(Target + row)
    keep = target != ignore_index
    lse = tl.where(keep, tl.load(Lse + row), 0.0)  # an ignored row's lse is -inf; its logits read as -inf
    scale = tl.where(keep, tl.load(Scale + row * scale_stride), 0.0)
    end = tl.where(keep, n_cols, 0)
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, n_cols, BLOCK_V):
        offs = start + cols
        x = tl.load(logits + offs, mask=offs < end, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - lse)
        g = tl.where(offs == target, p - 1.0, p) * scale
        if EVEN_V:
            tl.store(grad + offs, g.to(Grad.dtype.element_ty))
        else:
            tl.store(grad + offs, g.to(Grad.dtype.element_ty), mask=offs < n_cols)
