"""An LM head and its loss as one op: F.cross_entropy(hidden @ weight.T, target) without the [N, V] logits.

The logits of a large-vocabulary head (16K tokens x 128K classes: 4 GiB in bf16) are an intermediate
nobody but the loss reads. `torch.ops.fxopt.linear_cross_entropy` computes them a chunk of rows at a
time and, in the same pass, what the backward needs from them: for each chunk,
    logits = hidden[rows] @ weight.T                      (cuBLAS)
    lse, the chunk's summed loss                           (losses/cross_entropy_kernels.py)
    g = (softmax(logits) - onehot(target)) * scale         (the same kernels, written over the logits)
    grad_hidden[rows] = g @ weight;  grad_weight += g.T @ hidden[rows]
so the op holds one chunk of logits at a time (on the GPU at most 2 GiB: 8192 rows of a 128K bf16
vocabulary), and the matmuls are the three an unfused head and its backward do (none is recomputed).
The backward multiplies the two saved gradients by the loss's gradient, which is why only "mean" and
"sum" qualify: with reduction "none" each row's upstream gradient is only known in the backward (the
pass leaves those to the plain fused loss).

grad_weight sums the chunks in float32 (the weight's dtype when that is float32) and is rounded to the
weight's dtype once, so a bf16 head's gradient is rounded as often as eager's single matmul rounds it.
The gradients are made in the forward only for the inputs that need them (`grads`, decided by the
pass from the graph); with none (evaluation under grad mode off) the op is a chunked loss.

Implementations, picked when the op runs: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1, run
fxopt's cross-entropy kernels on each chunk; other CPU tensors the same contract in torch ops.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import torch_references
from .cross_entropy_op import _on_triton, reference_forward, reference_grad, run_cross_entropy

REDUCTIONS = ("mean", "sum")
# Not float16: the gradients are made in the forward at a unit loss gradient, where fp16's range loses
# them (a mean over 16K rows puts d loss / d logits near 1e-9, below fp16's smallest subnormal); eager
# fp16 training scales the loss first (GradScaler), which only the backward sees.
DTYPES = (torch.float32, torch.bfloat16)
GRAD_HIDDEN, GRAD_WEIGHT = 1, 2  # the `grads` bits
# Chunks on the GPU: up to GPU_CHUNK_ROWS rows, and at most CHUNK_BYTES of logits. Rows decide the speed:
# each chunk adds its product into the float32 grad_weight (cuBLAS reads and writes all of it: 1 GiB at
# 128K x 1024), and a chunk's GEMMs have rows x V work, so fewer, larger chunks cost less; measured on an
# H100 at 16K x 1024 x 128K bf16, 2048 / 4096 / 8192 rows took 24.1 / 23.7 / 22.2 ms with peaks of
# 1.0 / 1.5 / 2.5 GiB (benchmarks/results/2026-12-06-h100-e.md). On the CPU chunks are small, so tests
# run several.
CHUNK_BYTES = {"cuda": 2 << 30, "cpu": 64 << 10}
GPU_CHUNK_ROWS = 8192
CUDA_ROW_MULTIPLE = 256  # chunk rows on the GPU: a multiple of the matmul tiles


def chunk_rows(n_rows: int, n_classes: int, itemsize: int, device_type: str) -> int:
    """Rows per chunk: as many as CHUNK_BYTES of logits hold (on CUDA at most GPU_CHUNK_ROWS, a multiple
    of CUDA_ROW_MULTIPLE, at least one such multiple), at least one row, at most all."""
    rows = max(1, CHUNK_BYTES.get(device_type, CHUNK_BYTES["cpu"]) // max(1, n_classes * itemsize))
    if device_type == "cuda":
        rows = max(CUDA_ROW_MULTIPLE, min(rows, GPU_CHUNK_ROWS) // CUDA_ROW_MULTIPLE * CUDA_ROW_MULTIPLE)
    return max(1, min(rows, n_rows))


def check_inputs(hidden: Tensor, weight: Tensor, target: Tensor, reduction: str, grads: int) -> None:
    """ValueError naming what the op does not take, before anything runs."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"fxopt linear_cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r} "
                         "(reduction='none' runs as a matmul and fxopt::cross_entropy)")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"fxopt linear_cross_entropy: hidden must be [N, D] and weight [V, D], got "
                         f"{list(hidden.shape)} and {list(weight.shape)}")
    if hidden.dtype != weight.dtype or hidden.dtype not in DTYPES:
        raise ValueError(f"fxopt linear_cross_entropy: hidden and weight must share one dtype of {DTYPES}, got "
                         f"{hidden.dtype} and {weight.dtype}")
    if target.dtype != torch.int64 or tuple(target.shape) != (hidden.shape[0],):
        raise ValueError(f"fxopt linear_cross_entropy: target must be int64 [N={hidden.shape[0]}], got "
                         f"{target.dtype} {list(target.shape)}")
    if not (hidden.device == weight.device == target.device):
        raise ValueError(f"fxopt linear_cross_entropy: hidden ({hidden.device}), weight ({weight.device}) and "
                         f"target ({target.device}) must be on one device")
    if grads not in range(4):
        raise ValueError(f"fxopt linear_cross_entropy: grads is a bit mask of 1 (hidden) and 2 (weight), got {grads}")


def _chunk_grad(logits: Tensor, target: Tensor, stats: Tensor, scale: Tensor, ignore_index: int) -> Tensor:
    """The chunk's d loss / d logits, written over the logits where the kernels run."""
    if _on_triton(logits):
        from .cross_entropy_kernels import cross_entropy_grad
        return cross_entropy_grad(logits, target, stats, scale, ignore_index, "sum", out=logits)
    return reference_grad(logits, target, stats, scale, ignore_index, "sum")


def _chunk_loss(logits: Tensor, target: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """(summed float32 loss of the chunk's rows, stats): fxopt::cross_entropy's contract."""
    if _on_triton(logits):
        return run_cross_entropy(logits, target, ignore_index, "sum")
    return reference_forward(logits, target, ignore_index, "sum")


def _add_product(acc: Optional[Tensor], a: Tensor, b: Tensor) -> Tensor:
    """acc + a @ b in acc's dtype (float32 for a bf16 weight); the first chunk's product is acc.
    On CUDA cuBLAS reads bf16 operands and adds into the float32 sum in its epilogue (`out_dtype`;
    a torch without that for addmm writes the product, then adds it); elsewhere (small CPU tests) the
    operands are widened first."""
    if a.dtype != torch.bfloat16:
        return torch.mm(a, b) if acc is None else acc.addmm_(a, b)
    if not a.is_cuda or torch_references.active():  # (dual tensors: out_dtype has no forward-AD formula)
        product = torch.mm(a.float(), b.float())
        return product if acc is None else acc.add_(product)
    if acc is None:
        return torch.mm(a, b, out_dtype=torch.float32)
    if _addmm_adds_into_float32(a.device):
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    return acc.add_(torch.mm(a, b, out_dtype=torch.float32))


_ADDMM_OUT_DTYPE: dict = {}


def _addmm_adds_into_float32(device: torch.device) -> bool:
    """Whether this torch's addmm takes bf16 operands with a float32 `out` (torch 2.11 does on CUDA):
    asked once per device on 16 x 16 tensors."""
    if device not in _ADDMM_OUT_DTYPE:
        a = torch.zeros(16, 16, device=device, dtype=torch.bfloat16)
        acc = torch.zeros(16, 16, device=device)
        try:
            torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
            _ADDMM_OUT_DTYPE[device] = True
        except (TypeError, RuntimeError, NotImplementedError):
            _ADDMM_OUT_DTYPE[device] = False
    return _ADDMM_OUT_DTYPE[device]


def run_linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int, reduction: str,
                             loss_dtype: Optional[torch.dtype] = None, grads: int = 0,
                             rows_per_chunk: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, d loss / d hidden, d loss / d weight) of F.cross_entropy(hidden @ weight.T, target, ...) for
    a unit upstream gradient; a gradient not asked for in `grads` is an empty tensor. rows_per_chunk:
    0 picks `chunk_rows`."""
    check_inputs(hidden, weight, target, reduction, grads)
    n, d = hidden.shape
    v = weight.shape[0]
    rows = rows_per_chunk or chunk_rows(n, v, hidden.element_size(), hidden.device.type)
    target = target.contiguous()
    kept = (target != ignore_index).sum(dtype=torch.float32)  # a device scalar: no host sync
    scale = 1.0 / kept if reduction == "mean" else torch.ones((), device=hidden.device)
    grad_hidden = torch.empty_like(hidden, memory_format=torch.contiguous_format) if grads & GRAD_HIDDEN \
        else hidden.new_empty(0)
    acc = None
    total = torch.zeros((), device=hidden.device, dtype=torch.float32)
    weight_t = weight.t()
    for start in range(0, n, rows):
        h, t = hidden[start:start + rows], target[start:start + rows]
        logits = torch.mm(h, weight_t)
        loss, stats = _chunk_loss(logits, t, ignore_index)
        total += loss
        if not grads:
            continue
        g = _chunk_grad(logits, t, stats, scale, ignore_index)
        if grads & GRAD_HIDDEN:
            torch.mm(g, weight, out=grad_hidden[start:start + rows])
        if grads & GRAD_WEIGHT:
            acc = _add_product(acc, g.t(), h)
        del logits, g
    if grads & GRAD_WEIGHT:
        grad_weight = weight.new_zeros(weight.shape) if acc is None else acc.to(weight.dtype)
    else:
        grad_weight = weight.new_empty(0)
    loss = total / kept if reduction == "mean" else total  # all rows ignored: 0 / 0 = NaN, as torch gives
    return loss.to(loss_dtype or torch.float32), grad_hidden, grad_weight


def _op_impl(hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int, reduction: str,
             loss_dtype: Optional[torch.dtype] = None, grads: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    return run_linear_cross_entropy(hidden, weight, target, ignore_index, reduction, loss_dtype, grads)


linear_cross_entropy_op = torch.library.custom_op("fxopt::linear_cross_entropy", mutates_args=())(_op_impl)


@linear_cross_entropy_op.register_fake
def _(hidden, weight, target, ignore_index, reduction, loss_dtype=None, grads=0):
    check_inputs(hidden, weight, target, reduction, grads)
    loss = hidden.new_empty((), dtype=loss_dtype or torch.float32)
    grad_hidden = hidden.new_empty(hidden.shape) if grads & GRAD_HIDDEN else hidden.new_empty(0)
    grad_weight = weight.new_empty(weight.shape) if grads & GRAD_WEIGHT else weight.new_empty(0)
    return loss, grad_hidden, grad_weight


def _setup_context(ctx, inputs, output):
    _, grad_hidden, grad_weight = output
    ctx.grads = inputs[6]
    ctx.save_for_backward(grad_hidden, grad_weight)
    ctx.mark_non_differentiable(grad_hidden, grad_weight)


def _scaled(grad: Tensor, grad_loss: Tensor) -> Tensor:
    """grad * grad_loss computed in float32, rounded once to grad's dtype (one fused kernel in the
    backward graph)."""
    return (grad.float() * grad_loss.float()).to(grad.dtype)


def _backward(ctx, grad_loss, _grad_hidden, _grad_weight):
    grad_hidden, grad_weight = ctx.saved_tensors
    for bit, name, index in ((GRAD_HIDDEN, "hidden", 0), (GRAD_WEIGHT, "weight", 1)):
        if ctx.needs_input_grad[index] and not ctx.grads & bit:
            raise RuntimeError(f"fxopt linear_cross_entropy: the gradient of {name} was not made in the forward "
                               f"(grads={ctx.grads}); compile the graph with {name} requiring grad")
    dh = _scaled(grad_hidden, grad_loss) if ctx.grads & GRAD_HIDDEN else None
    dw = _scaled(grad_weight, grad_loss) if ctx.grads & GRAD_WEIGHT else None
    return dh, dw, None, None, None, None, None


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, *, ignore_index: int = -100,
                         reduction: str = "mean") -> Tensor:
    """F.cross_entropy(hidden @ weight.T, target) through the fused op, for eager use: the gradients of
    whichever of hidden and weight require grad are made with the loss; the loss in hidden's dtype."""
    grads = (GRAD_HIDDEN if hidden.requires_grad else 0) | (GRAD_WEIGHT if weight.requires_grad else 0)
    grads = grads if torch.is_grad_enabled() else 0
    return linear_cross_entropy_op(hidden, weight, target, ignore_index, reduction, hidden.dtype, grads)[0]
