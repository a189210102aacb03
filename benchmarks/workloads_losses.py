"""Loss workloads: cross-entropy over a large vocabulary, forward and backward (issue 7).

An LM's token loss at 16384 tokens x 131072 vocabulary (bf16 logits, 4 GiB): the forward reduces
each row to a loss, the backward writes a gradient as large as the logits. A perfect implementation
reads the logits twice (the forward's log-sum-exp, the backward's softmax) and writes the gradient
once; eager PyTorch also writes and reads log_softmax [N, V] and its gradient. Every target is a
real class (no ignore_index rows), so the minimum bytes are exact.

Two spellings: `cross_entropy` (F.cross_entropy on the bf16 logits) and `cross_entropy_fp32`
(`logits.float()` first, as many Hugging Face models do: eager then holds float32 copies of the
logits, of log_softmax and of both gradients). In both the logits are a leaf the caller holds, so
their gradient is a second [N, V] tensor whatever the compiler does. `lm_head_loss` makes the logits
inside the graph (hidden states times the output embedding, as an LM's head does): there they are an
intermediate nobody else holds, so a compiler may write their gradient over them or, as fxopt does
(passes/linear_cross_entropy.py), never make all of them at once. Its peak is the issue's "peak <= 1/4
of eager" case; with leaf logits the gradient alone is a third of eager's peak.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .workloads import nbytes, randn, workload


def _token_loss(logits, target):
    return F.cross_entropy(logits, target)


def _token_loss_fp32(logits, target):
    return F.cross_entropy(logits.float(), target)


@torch.compiler.disable
def _gradients(loss, inputs):
    """torch.autograd.grad kept outside dynamo, as a training loop's backward is (see
    workloads_attention._gradients): the compiler sees the forward and, through aot_autograd, the backward."""
    return torch.autograd.grad(loss, inputs)


def _cross_entropy_fwd_bwd(logits, target):
    """(loss, d loss / d logits)."""
    loss = _token_loss(logits, target)
    return (loss, *_gradients(loss, (logits,)))


def _cross_entropy_fp32_fwd_bwd(logits, target):
    loss = _token_loss_fp32(logits, target)
    return (loss, *_gradients(loss, (logits,)))


def _logits_and_targets(device, dtype, quick):
    n, v = (32, 1000) if quick else (16384, 131072)
    logits = randn(n, v, device=device, dtype=dtype).requires_grad_(True)
    target = torch.randint(0, v, (n,), device=device)
    return logits, target


def _min_bytes(inputs, outputs) -> int:
    """Logits read twice (forward, backward), the gradient written once, the targets read once."""
    logits, target = inputs
    return 2 * nbytes(logits) + nbytes(logits) + nbytes(target)


@workload("cross_entropy", "F.cross_entropy fwd+bwd (loss, dlogits) via autograd; 16384 tokens x 131072 vocab; "
          "min bytes = logits read twice + grad written once", kind="reduction", training=True, min_bytes=_min_bytes)
def make_cross_entropy(device, dtype, quick):
    return _cross_entropy_fwd_bwd, _logits_and_targets(device, dtype, quick)


@workload("cross_entropy_fp32", "F.cross_entropy(logits.float()) fwd+bwd (HF-style up-cast); 16384 x 131072; "
          "min bytes as cross_entropy", kind="reduction", training=True, min_bytes=_min_bytes)
def make_cross_entropy_fp32(device, dtype, quick):
    return _cross_entropy_fp32_fwd_bwd, _logits_and_targets(device, dtype, quick)


def _lm_head_loss_fwd_bwd(hidden, weight, target):
    """(loss, d loss / d hidden, d loss / d weight) of cross_entropy(hidden @ weight.T, target)."""
    loss = _token_loss(hidden @ weight.t(), target)
    return (loss, *_gradients(loss, (hidden, weight)))


def _lm_head_flops(inputs) -> int:
    hidden, weight, _ = inputs
    return 3 * 2 * hidden.shape[0] * hidden.shape[1] * weight.shape[0]  # the head's matmul, fwd and two bwd


@workload("lm_head_loss", "LM head + cross-entropy fwd+bwd: F.cross_entropy(h @ W.T) for h [16384, 1024], "
          "W [131072, 1024] (the logits, 4 GiB, made inside the graph); grads of h and W",
          kind="model", training=True, flops=_lm_head_flops)
def make_lm_head_loss(device, dtype, quick):
    n, d, v = (32, 16, 1000) if quick else (16384, 1024, 131072)
    hidden = (randn(n, d, device=device, dtype=dtype) / d ** 0.5).requires_grad_(True)
    weight = randn(v, d, device=device, dtype=dtype).requires_grad_(True)
    return _lm_head_loss_fwd_bwd, (hidden, weight, torch.randint(0, v, (n,), device=device))
