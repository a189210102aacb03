"""The decomposition table aot_autograd uses: core ATen, plus the normalisations and softmaxes taken
apart into reductions and pointwise ops, so the reduction fuser sees their structure.

var/var_mean are written here as mean -> centred squares -> sum (two reductions, aten ops only), so a
persistent kernel computes them from registers and a looped one in two passes; torch's own
decomposition goes through prims ops the kernels do not read.
"""
from __future__ import annotations

import functools

import torch
from torch._decomp import core_aten_decompositions, get_decompositions

aten = torch.ops.aten


def _reduced_count(x: torch.Tensor, dims) -> int:
    if dims is None or len(dims) == 0:
        return x.numel()
    n = 1
    for d in dims:
        n *= x.shape[d]
    return n


def _var_mean(x, dim=None, *, correction=None, keepdim=False):
    correction = 1 if correction is None else correction
    # (a 0-d tensor takes dim 0 or -1, as eager does: everything is reduced)
    dims = list(range(x.dim())) if dim is None or len(dim) == 0 or x.dim() == 0 else [d % x.dim() for d in dim]
    mean = aten.mean.dim(x, dims, True)
    centred = x - mean
    # (sym_max: a data-dependent count, boolean-mask indexing, must not be guarded on)
    count = torch.sym_max(_reduced_count(x, dims) - correction, 0)
    var = aten.sum.dim_IntList(centred * centred, dims, keepdim) / count
    if not keepdim:
        mean = aten.squeeze.dims(mean, dims)
    return var, mean


def _var(x, dim=None, *, correction=None, keepdim=False):
    return _var_mean(x, dim, correction=correction, keepdim=keepdim)[0]


_HALF = (torch.float16, torch.bfloat16)


def _compares_in_fp32(self) -> bool:
    """Whether eager's threshold kernels compare self in fp32: the CPU kernels do for a 16-bit input
    (threshold 4095 stays 4095); the CUDA kernels convert the threshold to self's dtype first (fp16
    4095 -> 4096), which is what `self <= threshold` in self's dtype gives."""
    return self.dtype in _HALF and self.device.type == "cpu"


def _threshold_backward(grad_output, self, threshold):
    """relu's (and F.threshold's) backward. torch's decomposition compares in self's dtype: CUDA's
    answer, but on the CPU x = 4096 lost the gradient eager keeps."""
    if _compares_in_fp32(self):
        self = self.float()
    return torch.where(self <= threshold, 0, grad_output)


def _hardtanh_backward(grad_output, self, min_val, max_val):
    """Both devices' eager kernels compare a 16-bit input with the bounds in fp32; torch before 2.12
    decomposed it in self's dtype, which rounds the bounds (fp16 2.0001 -> 2, so x = 2 lost its
    gradient on the H100's torch 2.11)."""
    if self.dtype in _HALF:
        self = self.float()
    return torch.where((self <= min_val) | (self >= max_val), 0, grad_output)


def _threshold(table: dict):
    """F.threshold's forward: torch's reference compares in fp32 (the CPU kernel's answer); on other
    devices the comparison is in self's dtype, as the CUDA kernel's."""
    reference = table[aten.threshold.default]

    def threshold_forward(self, threshold, value):
        if self.dtype in _HALF and not _compares_in_fp32(self):
            return torch.where(self <= threshold, value, self)
        return reference(self, threshold, value)
    return threshold_forward


def _core_aten() -> dict:
    """Core ATen's decompositions. `core_aten_decompositions()` is torch.export's table: it also lists
    every CompositeImplicitAutograd op of every namespace (508 more entries, 0.07 s of a first call on
    the CPU machine), which aot_autograd's trace decomposes by itself, as the op's own kernel does."""
    post_autograd = getattr(torch._decomp, "_core_aten_decompositions_post_autograd", None)
    return dict(post_autograd() if post_autograd is not None else core_aten_decompositions())


@functools.lru_cache(maxsize=1)
def decomposition_table() -> dict:
    table = _core_aten()
    table.update(get_decompositions([aten.native_layer_norm, aten._softmax, aten._log_softmax,
                                     aten.native_group_norm]))
    table[aten.var_mean.correction] = _var_mean
    table[aten.var.correction] = _var
    table[aten.threshold_backward.default] = _threshold_backward
    table[aten.threshold.default] = _threshold(table)
    table[aten.hardtanh_backward.default] = _hardtanh_backward
    # torch's decomposition of the CPU flash attention returns the attention probabilities where the
    # op returns the log-sum-exp; its backward (still the fused op's) then reads probabilities as lse
    # and the gradients come out wrong. SDPA that fxopt does not fuse stays one ATen call instead.
    table.pop(aten._scaled_dot_product_flash_attention_for_cpu.default, None)
    return table
