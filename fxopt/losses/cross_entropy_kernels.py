"""Cross-entropy over large vocabularies as Triton kernels, with no [N, V] intermediate.

Forward: one program per row walks the vocabulary BLOCK_V logits at a time and keeps an online
log-sum-exp in float32: the row's running max m (a scalar, one block max per step) and, per lane, the
running sum of exp(x - m), rescaled by exp(m_old - m_new) when a block raises the max. That is one
exp per logit and one read of the logits. It writes the row's lse (and, for reduction="none", the
row's loss lse - x[target], the op's output). Then one small program finishes the call: it counts the
rows that are not ignored and, for "mean" and "sum", adds up lse - x[target] over them (one scalar
load of a logit per row) into the 0-d loss.

Backward: grad[i, j] = (softmax(x_i)_j - [j == t_i]) * scale_i, with softmax recomputed from the
saved lse in the same single pass that writes the gradient: one read of the logits, one write of the
gradient, in the logits' dtype. scale_i is the upstream gradient (divided by the kept-row count for
"mean"), read and divided inside the kernel. Eager PyTorch instead keeps log_softmax [N, V] for the
backward and materialises its gradient [N, V] as well.

Allocations: the forward makes two tensors (the loss, and `stats` = [lse of each row, kept-row count],
float32 [N + 1], saved for the backward), the backward one (the gradient): the count, the division
and the scale cast are not tensors of their own (issue 5: fewer allocator requests than eager).

Ignored rows (target == ignore_index) are not read at all: their loss is 0, their lse is stored as
-inf, and their gradient row is written as zeros. A target outside [0, V) that is not ignore_index
gives a NaN loss (eager raises; a kernel cannot, without a host sync). The count is a float32: exact
up to 2**24 kept rows.

In place: where the backward graph is the logits' last reader and aot_autograd lets it consume them (an
LM head's matmul output, saved for this backward only), the gradient is written over the logits
(`out=logits`; passes/grad_over_logits.py), so the whole loss holds one [N, V] buffer.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..codegen.interpreter_guard import launcher
from ..codegen.jit_keys import settle as settle_cache_keys
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


REDUCTION_MODES = {"mean": 0, "sum": 1, "none": 2}  # the kernels' REDUCTION constexpr
FINAL_BLOCK_R = 1024  # rows per step of the program that finishes the forward


def cross_entropy_forward(logits: Tensor, target: Tensor, ignore_index: int, reduction: str,
                          block_v: int | None = None,
                          loss_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """(loss, stats): loss in loss_dtype (computed in float32), 0-d for "mean"/"sum" or [N] for "none";
    stats float32 [N + 1], each row's lse (-inf when ignored) then the number of rows not ignored.
    logits [N, V] fp32/bf16/fp16 with a contiguous last dim (any row stride); target int64 [N]."""
    _check(logits, target)
    logits, target = _rows_contiguous(logits), target.contiguous()  # the kernels read target[row] at stride 1
    n_rows, n_cols = logits.shape
    loss = torch.empty((n_rows,) if reduction == "none" else (), device=logits.device, dtype=loss_dtype)
    stats = torch.empty(n_rows + 1, device=logits.device, dtype=torch.float32)
    if n_rows:
        cfg = row_config(n_cols, logits.device.type, block_v)
        launcher(_forward_kernel, (n_rows,), logits.device, "fxopt cross_entropy")(
            logits, target, loss, stats, logits.stride(0), n_cols, ignore_index,
            WRITE_ROWS=reduction == "none", BLOCK_V=cfg["BLOCK_V"], num_warps=cfg["num_warps"])
    block_r = min(FINAL_BLOCK_R, next_power_of_2(max(n_rows, 1)))
    launcher(_finish_kernel, (1,), logits.device, "fxopt cross_entropy")(
        logits, target, stats, loss, logits.stride(0), n_rows, n_cols, ignore_index,
        REDUCTION=REDUCTION_MODES[reduction], BLOCK_R=block_r, num_warps=4)
    return loss, stats


def cross_entropy_grad(logits: Tensor, target: Tensor, stats: Tensor, grad_loss: Tensor, ignore_index: int,
                       reduction: str, block_v: int | None = None, out: Tensor | None = None) -> Tensor:
    """grad_logits [N, V] (contiguous, logits' dtype) = (softmax - onehot(target)) * scale per row, from
    the forward's `stats` and the loss's gradient `grad_loss` (0-d for "mean"/"sum", [N] with any
    stride for "none"; any float dtype: read as float32). out: where to write it, the logits themselves
    included (contiguous, the logits' shape and dtype): a program reads each block of its row before it
    writes that block, and no program reads another's row."""
    _check(logits, target)
    logits, target = _rows_contiguous(logits), target.contiguous()  # the kernels read target[row] at stride 1
    n_rows, n_cols = logits.shape
    if out is not None and not (out.is_contiguous() and out.shape == logits.shape and out.dtype == logits.dtype):
        raise ValueError(f"fxopt cross_entropy: out= must be contiguous {logits.dtype} {list(logits.shape)}, got "
                         f"{out.dtype} {list(out.shape)} with strides {out.stride()}")
    grad = torch.empty(n_rows, n_cols, device=logits.device, dtype=logits.dtype) if out is None else out
    if n_rows == 0:
        return grad
    grad_stride = grad_loss.stride(0) if reduction == "none" else 0
    cfg = row_config(n_cols, logits.device.type, block_v)
    launcher(_backward_kernel, (n_rows,), logits.device, "fxopt cross_entropy")(
        logits, target, stats, grad_loss, grad, logits.stride(0), grad.stride(0), grad_stride, n_rows, n_cols,
        ignore_index, REDUCTION=REDUCTION_MODES[reduction], BLOCK_V=cfg["BLOCK_V"],
        EVEN_V=n_cols % cfg["BLOCK_V"] == 0, num_warps=cfg["num_warps"])
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
def _forward_kernel(Logits, Target, Loss, Stats, stride_row, n_cols, ignore_index, WRITE_ROWS: tl.constexpr,
                    BLOCK_V: tl.constexpr):
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
    tl.store(Stats + row, lse)
    if WRITE_ROWS:
        tl.store(Loss + row, _row_loss(logits, target, keep, lse, n_cols).to(Loss.dtype.element_ty))


@triton.jit
def _row_loss(logits, target, keep, lse, n_cols):
    """lse - x[target] where the row counts, 0 where ignored, NaN for a target outside [0, V)."""
    in_range = (target >= 0) & (target < n_cols)
    picked = tl.load(logits + target, mask=keep & in_range, other=0.0).to(tl.float32)
    return tl.where(keep, tl.where(in_range, lse - picked, float("nan")), 0.0)


@triton.jit
def _finish_kernel(Logits, Target, Stats, Loss, stride_row, n_rows, n_cols, ignore_index,
                   REDUCTION: tl.constexpr, BLOCK_R: tl.constexpr):
    """One program: Stats[n_rows] = the kept-row count; for "mean" (0) and "sum" (1) the 0-d loss."""
    offs = tl.arange(0, BLOCK_R)
    count = tl.zeros([BLOCK_R], tl.float32)
    total = tl.zeros([BLOCK_R], tl.float32)
    for start in range(0, n_rows, BLOCK_R):
        rows = start + offs
        inside = rows < n_rows
        target = tl.load(Target + rows, mask=inside, other=ignore_index)
        keep = inside & (target != ignore_index)
        count += keep.to(tl.float32)
        if REDUCTION != 2:
            lse = tl.load(Stats + rows, mask=keep, other=0.0)
            total += _row_loss(Logits + rows.to(tl.int64) * stride_row, target, keep, lse, n_cols)
    kept = tl.sum(count, axis=0)
    tl.store(Stats + n_rows, kept)
    if REDUCTION == 0:
        tl.store(Loss, (tl.sum(total, axis=0) / kept).to(Loss.dtype.element_ty))  # no rows kept: 0 / 0 = NaN
    elif REDUCTION == 1:
        tl.store(Loss, tl.sum(total, axis=0).to(Loss.dtype.element_ty))


@triton.jit
def _backward_kernel(Logits, Target, Stats, GradLoss, Grad, stride_row, stride_grad, grad_loss_stride, n_rows,
                     n_cols, ignore_index, REDUCTION: tl.constexpr, BLOCK_V: tl.constexpr, EVEN_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    logits = Logits + row * stride_row
    grad = Grad + row * stride_grad
    target = tl.load(Target + row)
    keep = target != ignore_index
    lse = tl.where(keep, tl.load(Stats + row), 0.0)  # an ignored row's lse is -inf; its logits read as -inf
    scale = tl.load(GradLoss + row * grad_loss_stride).to(tl.float32)  # stride 0 unless "none"
    if REDUCTION == 0:
        scale = scale / tl.load(Stats + n_rows)
    scale = tl.where(keep, scale, 0.0)
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


settle_cache_keys(globals())  # each kernel's Triton key the same in every process (codegen/jit_keys.py)
