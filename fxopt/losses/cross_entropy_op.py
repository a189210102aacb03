"""The fused cross-entropy aot_autograd sees: torch.ops.fxopt.cross_entropy and its backward.

A `torch.library` custom op with a fake (shape) implementation and an autograd formula, so the
forward graph holds one `cross_entropy` node (saving the logits, the targets and the row lse) and the
backward graph one `cross_entropy_backward` node; no log_softmax [N, V] exists in either. The op picks
its implementation when it runs:
  - CUDA tensors, or CPU tensors under TRITON_INTERPRET=1: fxopt's Triton kernels
    (losses/cross_entropy_kernels.py);
  - other CPU tensors: the same contract in torch ops (`reference_forward`, `reference_grad`).

Contract (the pass builds calls that meet it): logits [N, V] fp32/bf16/fp16 with a contiguous last
dim, target int64 [N], reduction "mean" (over rows whose target is not ignore_index, as torch does:
all rows ignored gives NaN), "sum" or "none", and the loss's dtype (None: float32; F.cross_entropy's
is the logits' dtype, computed in float32 and rounded once, so no cast follows the op in either
graph). Returns (loss: 0-d, or [N] for "none"; stats float32 [N + 1]: each row's log-sum-exp, -inf
for ignored rows, then the number of rows not ignored, all the backward needs besides the logits and
targets).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import torch_references
from ..codegen.wrapper_runtime import batched

REDUCTIONS = ("mean", "sum", "none")


_on_triton = torch_references.kernels_serve  # CUDA, or CPU under the interpreter; not for torch_ops_only()


def _check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"fxopt cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}")


def reference_rows(logits: Tensor, target: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """Per-row (loss, lse) in float32 torch ops: the kernels' contract, for CPU without the interpreter."""
    x = logits.float()
    keep = target != ignore_index
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(1, torch.where(keep, target, 0)[:, None]).squeeze(1)
    rows = torch.where(keep, lse - picked, 0.0)
    return rows, torch.where(keep, lse, float("-inf"))


def reference_forward(logits: Tensor, target: Tensor, ignore_index: int, reduction: str) -> tuple[Tensor, Tensor]:
    """The op's (loss, stats) in torch ops: the kernels' contract, for CPU without the interpreter."""
    rows, lse = reference_rows(logits, target, ignore_index)
    kept = (target != ignore_index).sum().to(torch.float32)
    stats = torch.cat([lse, kept[None]])
    if reduction == "none":
        return rows, stats
    return (rows.sum() / kept if reduction == "mean" else rows.sum()), stats


def reference_grad(logits: Tensor, target: Tensor, stats: Tensor, grad_loss: Tensor, ignore_index: int,
                   reduction: str) -> Tensor:
    """(softmax - onehot(target)) * scale per row, in float32 torch ops, cast to the logits' dtype;
    scale is grad_loss (per row for "none"), divided by the kept-row count for "mean"."""
    n = target.shape[0]
    lse, kept = stats[:n], stats[n]
    scale = grad_loss.to(torch.float32)
    scale = scale / kept if reduction == "mean" else scale
    keep = target != ignore_index
    probs = torch.exp(logits.float() - torch.where(keep, lse, 0.0)[:, None])
    onehot = torch.zeros_like(probs).scatter_(1, torch.where(keep, target, 0)[:, None], 1.0)
    row_scale = torch.where(keep, scale.expand(target.shape), 0.0)
    return ((probs - onehot) * row_scale[:, None]).to(logits.dtype).contiguous()


def run_cross_entropy(logits: Tensor, target: Tensor, ignore_index: int, reduction: str,
                      loss_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    """The op's implementation; wrappers call it directly (codegen/direct_calls.py)."""
    _check_reduction(reduction)
    if not _on_triton(logits):
        loss, stats = reference_forward(logits, target, ignore_index, reduction)
        return loss.to(loss_dtype or torch.float32), stats
    from .cross_entropy_kernels import cross_entropy_forward
    return cross_entropy_forward(logits, target, ignore_index, reduction, loss_dtype=loss_dtype or torch.float32)


cross_entropy_op = torch.library.custom_op("fxopt::cross_entropy", mutates_args=())(run_cross_entropy)


@cross_entropy_op.register_fake
def _(logits, target, ignore_index, reduction, loss_dtype=None):
    _check_reduction(reduction)
    n = logits.shape[0]
    loss = logits.new_empty((n,) if reduction == "none" else (), dtype=loss_dtype or torch.float32)
    return loss, logits.new_empty((n + 1,), dtype=torch.float32)


def run_cross_entropy_backward(grad_loss: Tensor, logits: Tensor, target: Tensor, stats: Tensor,
                               ignore_index: int, reduction: str) -> Tensor:
    _check_reduction(reduction)
    if not _on_triton(logits):
        return reference_grad(logits, target, stats, grad_loss, ignore_index, reduction)
    from .cross_entropy_kernels import cross_entropy_grad
    return cross_entropy_grad(logits, target, stats, grad_loss, ignore_index, reduction)


cross_entropy_backward_op = torch.library.custom_op("fxopt::cross_entropy_backward",
                                                    mutates_args=())(run_cross_entropy_backward)


@cross_entropy_backward_op.register_fake
def _(grad_loss, logits, target, stats, ignore_index, reduction):
    return logits.new_empty(logits.shape)  # contiguous, as the kernel writes it


def cross_entropy_backward_over_logits(grad_loss: Tensor, logits: Tensor, target: Tensor, stats: Tensor,
                                      ignore_index: int, reduction: str) -> Tensor:
    """cross_entropy_backward for a backward graph whose last reader of `logits` this is and which
    aot_autograd may consume them in (passes/grad_over_logits.py): the gradient is written over the
    logits, so the loss never holds two [N, V] buffers, where `overwrite_allowed` says this call may;
    otherwise it is the op's own result, a new tensor."""
    if overwrite_allowed(logits, grad_loss):
        from .cross_entropy_kernels import cross_entropy_grad
        return cross_entropy_grad(logits, target, stats, grad_loss, ignore_index, reduction, out=logits)
    return cross_entropy_backward_op(grad_loss, logits, target, stats, ignore_index, reduction)


# the argument whose memory the result may take: liveness counts no new buffer for it, and the wrapper
# calls the function directly (codegen/direct_calls.py), as it calls fxopt's ops
cross_entropy_backward_over_logits.writes_over = 1
_task_id = getattr(torch._C, "_current_graph_task_id", None)
_keeps_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", None)


def overwrite_allowed(logits: Tensor, grad_loss: Tensor) -> bool:
    """Whether this call may write over the logits: the autograd engine is running a backward that
    frees its saved tensors when done (not `retain_graph=True` or `create_graph=True`, where the
    same saved logits are read again), no functorch transform wraps the call and neither tensor is
    batched (`is_grads_batched=True` hands a batched gradient; the op's own batching rule serves it),
    the logits are a plain contiguous tensor the kernels run on; anything else (a graph run by verify or
    explain's checks outside a backward, a torch without these queries) gets a new tensor."""
    if _task_id is None or _keeps_graph is None or _transforms_active is None:
        return False
    return (_plain(logits) and _plain(grad_loss) and _on_triton(logits) and logits.is_contiguous()
            and _task_id() != -1 and not _keeps_graph() and not _transforms_active())


def _plain(t: Tensor) -> bool:
    """Not a subclass and not a batched tensor."""
    return type(t) is Tensor and not batched(t)


def _setup_context(ctx, inputs, output):
    logits, target, ignore_index, reduction, _loss_dtype = inputs
    _, stats = output
    ctx.save_for_backward(logits, target, stats)
    ctx.ignore_index, ctx.reduction = ignore_index, reduction
    ctx.mark_non_differentiable(stats)


def _backward(ctx, grad_loss, _grad_stats):
    logits, target, stats = ctx.saved_tensors
    grad = cross_entropy_backward_op(grad_loss, logits, target, stats, ctx.ignore_index, ctx.reduction)
    return grad, None, None, None, None


cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def cross_entropy(logits: Tensor, target: Tensor, *, ignore_index: int = -100, reduction: str = "mean") -> Tensor:
    """F.cross_entropy(logits [N, V], target [N]) through the fused op, in the logits' dtype as torch
    returns it (the loss is computed in float32 and rounded once)."""
    return cross_entropy_op(logits, target, ignore_index, reduction, logits.dtype)[0]
