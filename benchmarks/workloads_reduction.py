"""Reduction workloads (softmax, LayerNorm, RMSNorm, their backwards), registered into workloads.WORKLOADS.

Sizes follow the reduction-fusion issue: softmax 8192x8192, residual+LayerNorm+GELU and RMSNorm
16384x4096, softmax over rows of 131072, and LayerNorm/RMSNorm backward at 16384x4096 (bf16).
The backward workloads call the backward math directly, so the compiled graph is the backward graph.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .workloads import randn, workload


def _rows(quick: bool, rows: int, width: int) -> tuple[int, int]:
    return (64, max(64, width // 64)) if quick else (rows, width)


def _softmax(x):
    return torch.softmax(x, -1)


@workload("softmax", "softmax(x, -1); x [8192, 8192]", kind="reduction")
def make_softmax(device, dtype, quick):
    n, m = _rows(quick, 8192, 8192)
    return _softmax, (randn(n, m, device=device, dtype=dtype),)


@workload("softmax_long", "softmax(x, -1); x [512, 131072]: rows too long for registers", kind="reduction")
def make_softmax_long(device, dtype, quick):
    n, m = _rows(quick, 512, 131072)
    return _softmax, (randn(n, m, device=device, dtype=dtype),)


def _ln_gelu(x, r, w, b):
    return F.gelu(F.layer_norm(x + r, (x.shape[-1],), w, b))


@workload("ln_gelu", "gelu(layer_norm(x + residual)); x, residual [16384, 4096]", kind="reduction")
def make_ln_gelu(device, dtype, quick):
    n, m = _rows(quick, 16384, 4096)
    return _ln_gelu, (randn(n, m, device=device, dtype=dtype), randn(n, m, device=device, dtype=dtype),
                      randn(m, device=device, dtype=dtype), randn(m, device=device, dtype=dtype))


def _rmsnorm(x, w):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return h.to(x.dtype) * w


@workload("rmsnorm", "RMSNorm written by hand (pow, mean, rsqrt, casts); x [16384, 4096]", kind="reduction")
def make_rmsnorm(device, dtype, quick):
    n, m = _rows(quick, 16384, 4096)
    return _rmsnorm, (randn(n, m, device=device, dtype=dtype), randn(m, device=device, dtype=dtype))


def _ln_backward(dy, x, mean, rstd, w, b):
    return torch.ops.aten.native_layer_norm_backward(dy, x, [x.shape[-1]], mean, rstd, w, b, [True, True, True])


@workload("ln_bwd", "LayerNorm backward (dx, dw, db) at [16384, 4096]", kind="reduction",
          rtol=5e-2, atol=5e-2)
def make_ln_backward(device, dtype, quick):
    n, m = _rows(quick, 16384, 4096)
    x, w, b = randn(n, m, device=device, dtype=dtype), randn(m, device=device, dtype=dtype), \
        randn(m, device=device, dtype=dtype)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [m], w, b, 1e-5)
    return _ln_backward, (randn(n, m, device=device, dtype=dtype), x, mean, rstd, w, b)


def _rms_backward(dy, x, w):
    """The gradient of _rmsnorm w.r.t. x and w, as autograd derives it, written out."""
    h = x.float()
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    g = dy.float() * w.float()
    dx = rstd * g - h * rstd.pow(3) * (g * h).mean(-1, keepdim=True)
    dw = (dy.float() * (h * rstd).to(x.dtype).float()).sum(0)
    return dx.to(x.dtype), dw.to(w.dtype)


@workload("rms_bwd", "RMSNorm backward (dx, dw) at [16384, 4096]", kind="reduction", rtol=5e-2, atol=5e-2)
def make_rms_backward(device, dtype, quick):
    n, m = _rows(quick, 16384, 4096)
    return _rms_backward, (randn(n, m, device=device, dtype=dtype), randn(n, m, device=device, dtype=dtype),
                           randn(m, device=device, dtype=dtype))
