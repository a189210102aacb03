"""The mixed-precision policy: which ops compute in the low dtype (bf16/fp16), which in fp32.

One table, POLICY, says it per op category; every op not in a category follows its inputs (PyTorch's
type promotion: a bf16 matmul result plus an fp32 residual is fp32). Users override entries with
`fxopt.backend(precision="bf16", precision_policy={"softmax": "low"})`; `category_of(node)` says which
category a node of the torch-level (dynamo) graph belongs to, whatever spelling the model used.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..attention.op import flash_attention

LOW, FP32, FOLLOW = "low", "fp32", "follow"  # compute in bf16/fp16 | in fp32 | in what the inputs are

# category       computes in   why
POLICY: dict[str, str] = {
    "matmul":      LOW,   # matmul, @, mm, bmm, addmm, baddbmm, einsum: tensor cores accumulate in fp32
    "linear":      LOW,   # F.linear, nn.Linear
    "conv":        LOW,   # conv1d/2d/3d, conv_transpose1d/2d/3d
    "attention":   LOW,   # fxopt's fused op (its softmax runs in fp32 inside the kernel), SDPA
    "softmax":     FP32,  # exp of large scores overflows fp16; a bf16 row sum drops small terms
    "log_softmax": FP32,
    "norm":        FP32,  # layer_norm, rms_norm, group_norm, batch_norm: a row's mean and variance
    "reduction":   FP32,  # sum, mean, var, std, logsumexp, cumsum, norm: long sums lose low bits
    "exp_log_pow": FP32,  # exp, log, pow, square ... only where they feed a reduction (sum of squares)
    "loss":        FP32,  # cross_entropy, nll_loss, mse_loss, ...: a reduction over the batch
    "linalg":      FP32,  # cdist, torch.linalg.*, torch.fft.*: autocast's fp32 list; many lack bf16 kernels
}
CHOICES = (LOW, FP32, FOLLOW)
REDUCING = {"softmax", "log_softmax", "norm", "reduction", "loss"}  # what makes exp/log/pow sensitive

_FUNCTIONS = {
    **dict.fromkeys([torch.matmul, operator.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
                     torch.einsum], "matmul"),
    F.linear: "linear",
    **dict.fromkeys([torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d, torch.conv_transpose2d,
                     torch.conv_transpose3d], "conv"),
    flash_attention._opoverload: "attention", F.scaled_dot_product_attention: "attention",
    **dict.fromkeys([torch.softmax, F.softmax], "softmax"),
    **dict.fromkeys([torch.log_softmax, F.log_softmax], "log_softmax"),
    **dict.fromkeys([F.layer_norm, torch.layer_norm, F.rms_norm, torch.rms_norm, F.group_norm, torch.group_norm,
                     F.batch_norm, torch.batch_norm, F.local_response_norm, F.instance_norm], "norm"),
    **dict.fromkeys([torch.sum, torch.mean, torch.var, torch.std, torch.var_mean, torch.std_mean,
                     torch.logsumexp, torch.cumsum, torch.norm, torch.linalg.vector_norm], "reduction"),
    **dict.fromkeys([torch.exp, torch.exp2, torch.expm1, torch.log, torch.log2, torch.log10, torch.log1p,
                     torch.pow, operator.pow, torch.square], "exp_log_pow"),
    **dict.fromkeys([F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss,
                     F.binary_cross_entropy, F.binary_cross_entropy_with_logits, F.kl_div], "loss"),
    **dict.fromkeys([torch.cdist, torch.pdist, torch.dist, torch.det, torch.inverse, torch.svd, torch.pinverse,
                     torch.cholesky, torch.trace, F.pdist]
                    + [f for name, f in vars(torch.linalg).items() if callable(f) and not name.startswith("_")
                       and f is not torch.linalg.vector_norm]
                    + [f for name, f in vars(torch.fft).items() if callable(f) and not name.startswith("_")], "linalg"),
}
_METHODS = {
    **dict.fromkeys(["matmul", "mm", "bmm", "addmm", "baddbmm"], "matmul"),
    "softmax": "softmax", "log_softmax": "log_softmax",
    **dict.fromkeys(["sum", "mean", "var", "std", "logsumexp", "cumsum", "norm"], "reduction"),
    **dict.fromkeys(["exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "pow", "square"], "exp_log_pow"),
    **dict.fromkeys(["det", "inverse", "svd", "pinverse", "cholesky", "trace", "dist"], "linalg"),
}


def category_of(node: fx.Node) -> str | None:
    """The POLICY category of a torch-level node, or None (the op follows its inputs)."""
    if node.op == "call_function":
        return _FUNCTIONS.get(node.target)
    if node.op == "call_method":
        return _METHODS.get(node.target)
    return None


def feeds_reduction(node: fx.Node) -> bool:
    """exp/log/pow whose value is summed right away (x.pow(2).mean(), exp(x).sum()): fp32 pays there."""
    return any(category_of(user) in REDUCING for user in node.users)


def check_overrides(overrides, precision) -> None:
    """ValueError naming the bad key or value of `precision_policy`, with the valid ones."""
    if not isinstance(overrides, dict):
        raise ValueError(f"fxopt: precision_policy must be a dict {{category: choice}}, got {type(overrides).__name__}")
    if precision not in ("bf16", "fp16"):
        raise ValueError(f"fxopt: precision_policy needs precision='bf16' or 'fp16' (got precision={precision!r}); "
                         "without a low precision there is nothing to decide")
    for key, choice in overrides.items():
        if key not in POLICY:
            raise ValueError(f"fxopt: precision_policy has an unknown category {key!r}; categories are "
                             f"{sorted(POLICY)} (see fxopt/analysis/precision_policy.py)")
        if choice not in CHOICES:
            raise ValueError(f"fxopt: precision_policy[{key!r}] = {choice!r}; choose one of {CHOICES}")


def policy_with(overrides: dict | None) -> dict[str, str]:
    """POLICY with the user's entries replaced."""
    return {**POLICY, **(overrides or {})}
