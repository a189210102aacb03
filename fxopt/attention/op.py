"""The fused attention op aot_autograd sees: torch.ops.fxopt.flash_attention and its backward.

A `torch.library` custom op with a fake (shape) implementation and an autograd formula, so the
forward graph holds one `flash_attention` node and the backward graph one `flash_attention_backward`
node. The op picks its implementation when it runs:
  - CUDA tensors: fxopt's Triton kernels (split-KV decode for short queries over long keys, else the
    flash forward); the backward is fxopt's flash backward.
  - CPU tensors under TRITON_INTERPRET=1: the same Triton kernels in the interpreter (how tests check
    them), except bfloat16 ones: the interpreter (triton 3.6-3.9) multiplies bf16 `tl.dot` operands as
    their raw 16-bit patterns, so its bf16 attention is garbage; those take the reference, logged once.
  - other CPU tensors: `reference.attention` in plain torch ops.

Contract (the matcher builds calls that meet it): q [B, H, Tq, D], k and v [B, Hkv, Tk, D] with H a
multiple of Hkv (grouped-query attention), any strides; `mask` None, an additive float mask or a
bool one (True keeps the score, False makes it -inf, as a -inf fill does) broadcastable to [B, H, Tq, Tk];
causal is aligned bottom-right; `scale` None means 1/sqrt(D) of the tensors of each call (SDPA's
default: what a graph with a symbolic head dim computes); `scale_by`, a 0-d tensor, multiplies the
scale by its value to `scale_power` (a float attribute dynamo made an input). A head dim outside the kernels'
range (possible only when it is symbolic: the matcher checks static ones) runs the reference, logged once.
`key_slopes`, None or float32 [H]: a linear position bias (ALiBi) the
kernels compute, slopes[h] * (j - i - (Tk - Tq)) added to head h's scaled scores before the mask (the
decode kernel and the reference read it as an added mask instead). Returns (out [B, H, Tq, D] in q's
dtype, lse [B, H, Tq] float32: the natural-log log-sum-exp of each row, saved for the backward).
A query row that sees no key (its mask is -inf everywhere) gives NaN and lse -inf, as hand-written
attention does in eager; with `safe_softmax` (what SDPA calls become: SDPA's softmax is "safe") it gives
0, lse +inf, and 0 gradients. Its gradients follow eager's spelling of the mask: NaN everywhere for an
added -inf mask; for a -inf fill (`mask_is_fill`: masked_fill, where) 0 in dq and dk, NaN in dv.

Layouts: out and each gradient are laid out like their input (`torch.empty_like`: q = x.view(B, T, H,
D).transpose(1, 2) gives [B, T, H, D] memory), so the reshapes model code does around attention
(`y.transpose(1, 2).contiguous().view(B, T, C)`, and their backward) copy nothing. Every
implementation returns that layout, because the fake one promises it and the compiled wrapper indexes
the results with the promised strides: the kernels allocate it directly; the decode kernel and the
CPU reference copy into it (`_laid_out_like`).
"""
from __future__ import annotations

import logging
import math
from typing import Optional

import torch
from torch import Tensor

from .. import torch_references
from . import reference


_log = logging.getLogger("fxopt.attention")
_BF16_NOTED: list[bool] = []
_HEAD_DIM_NOTED: set[int] = set()


def _on_triton(t: Tensor) -> bool:
    """CUDA tensors, or CPU tensors when the Triton interpreter is on, unless bfloat16 (see the module
    docstring: the interpreter's bf16 matrix products are wrong); never inside
    torch_references.torch_ops_only() (forward AD, functorch: the torch-op reference)."""
    if not torch_references.kernels_serve(t):
        return False
    if t.is_cuda:
        return True
    if t.dtype == torch.bfloat16:
        if not _BF16_NOTED:
            _BF16_NOTED.append(True)
            _log.warning("fxopt attention: bfloat16 CPU tensors run the torch reference, not the Triton "
                         "interpreter, whose bf16 tl.dot is wrong; use float16/float32 to run the kernels on CPU")
        return False
    return True


def _kernels_take(q: Tensor) -> bool:
    """The Triton kernels run this call: a device they run on and a head dim in their range."""
    if not _on_triton(q):
        return False
    from .flash_common import HEAD_DIMS
    head_dim = q.shape[-1]
    if HEAD_DIMS[0] <= head_dim <= HEAD_DIMS[1]:
        return True
    if head_dim not in _HEAD_DIM_NOTED:
        _HEAD_DIM_NOTED.add(head_dim)
        _log.warning("fxopt attention: head dim %d is outside the kernels' range %d..%d; this call runs the "
                     "torch reference", head_dim, *HEAD_DIMS)
    return False


def _scale_of(q: Tensor, scale: Optional[float], scale_by: Optional[Tensor], scale_power: int) -> float:
    """The call's scale: `scale` (None: 1/sqrt(head dim)), times a runtime scalar to a power when given
    (a module's float attribute that dynamo passes as a 0-d tensor under dynamic shapes)."""
    value = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return value if scale_by is None else value * float(scale_by) ** scale_power


def _triton_call(t: Tensor, fn, *args, **kwargs):
    if t.is_cuda:
        return fn(*args, **kwargs)
    from ..codegen.interpreter_guard import restoring_triton_language
    with restoring_triton_language():
        return fn(*args, **kwargs)


def _laid_out_like(t: Tensor, like: Tensor) -> Tensor:
    """`t` with `torch.empty_like(like)`'s strides (a copy only where they differ)."""
    target = torch.empty_like(like, dtype=t.dtype)
    if t.stride() == target.stride():
        return t
    return target.copy_(t)


def _full_mask(mask: Optional[Tensor], q: Tensor, k: Tensor) -> Optional[Tensor]:
    """The additive mask as a [B, H, Tq, Tk] view (stride 0 where it broadcasts); no copy."""
    if mask is None:
        return None
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def run_flash_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: Optional[float],
                        causal: bool, scale_by: Optional[Tensor] = None, scale_power: int = 1,
                        key_slopes: Optional[Tensor] = None, safe_softmax: bool = False,
                        mask_is_fill: bool = False, causal_fold: Optional[str] = None,
                        causal_fill: float = 0.0) -> tuple[Tensor, Tensor]:
    """The op's implementation; wrappers call it directly (codegen/direct_calls.py). `safe_softmax`
    (SDPA's): a query row its mask removes entirely gives 0 (and 0 gradients), not NaN as in eager.
    `mask_is_fill`: the mask came from a -inf fill, for the backward (flash_backward's zero_empty_rows).
    `causal_fold`, `causal_fill` (causal=False, an additive mask): a causal step with a finite fill beside
    the mask (attention_masks.fold_finite_causal; flash_forward's arguments of those names): the forward
    kernels skip the key blocks above the diagonal wherever that is exact."""
    return flash_attention_impl(q, k, v, mask, scale, causal, scale_by, scale_power, key_slopes, safe_softmax,
                                causal_fold=causal_fold, causal_fill=causal_fill)


def flash_attention_impl(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: Optional[float],
                         causal: bool, scale_by: Optional[Tensor] = None, scale_power: int = 1,
                         key_slopes: Optional[Tensor] = None, safe_softmax: bool = False,
                         mask_is_fill: bool = False, causal_fold: Optional[str] = None, causal_fill: float = 0.0,
                         need_lse: bool = True) -> tuple[Tensor, Optional[Tensor]]:
    """run_flash_attention (mask_is_fill concerns only the backward); need_lse=False (a wrapper whose graph
    never reads the statistics: inference) returns (out, None) without allocating or storing them."""
    scale = _scale_of(q, scale, scale_by, scale_power)
    seq_q, seq_k = q.shape[2], k.shape[2]
    if not _kernels_take(q) or not 0 < scale < math.inf:  # (a runtime scale may be anything)
        mask = reference.with_causal_fold(mask, causal_fold, causal_fill, seq_q, seq_k)
        mask = reference.with_key_slopes(mask, key_slopes, seq_q, seq_k)
        out, lse = reference.attention(q, k, v, scale=scale, causal=causal, mask=mask, safe=safe_softmax)
        return _laid_out_like(out, q), lse.contiguous() if need_lse else None
    from .flash_decode import decode_applies, flash_decode
    from .flash_forward import flash_forward
    if not decode_applies(seq_q, seq_k):  # out already laid out like q
        return _triton_call(q, flash_forward, q, k, v, scale=scale, causal=causal, mask=_full_mask(mask, q, k),
                            lse=need_lse, key_slopes=key_slopes, safe_softmax=safe_softmax, causal_fold=causal_fold,
                            causal_fill=causal_fill)
    mask = reference.with_causal_fold(mask, causal_fold, causal_fill, seq_q, seq_k)  # (<= 16 rows: built here)
    mask = _full_mask(reference.with_key_slopes(mask, key_slopes, seq_q, seq_k), q, k)
    out, lse = _triton_call(q, flash_decode, q, k, v, scale=scale, causal=causal, mask=mask, lse=need_lse,
                            safe_softmax=safe_softmax)
    return _laid_out_like(out, q), lse


flash_attention = torch.library.custom_op("fxopt::flash_attention", mutates_args=())(run_flash_attention)


@flash_attention.register_fake
def _(q, k, v, mask, scale, causal, scale_by=None, scale_power=1, key_slopes=None, safe_softmax=False,
      mask_is_fill=False, causal_fold=None, causal_fill=0.0):
    b, h, tq, _ = q.shape
    return torch.empty_like(q), q.new_empty(b, h, tq, dtype=torch.float32)


def run_flash_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                 mask: Optional[Tensor], scale: Optional[float], causal: bool,
                                 scale_by: Optional[Tensor] = None, scale_power: int = 1,
                                 key_slopes: Optional[Tensor] = None,
                                 safe_softmax: bool = False, mask_is_fill: bool = False,
                                 causal_fold: Optional[str] = None,
                                 causal_fill: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """The backward's implementation. The kernels need no `safe_softmax`: the forward stored lse = +inf
    for a row with no visible key, so P = exp(s - lse) is 0 there (flash_common.log_sum_exp). A causal
    fold is applied by the kernels as in the forward, but every key block is visited."""
    scale = _scale_of(q, scale, scale_by, scale_power)
    if not _kernels_take(q) or not 0 < scale < math.inf:
        mask = reference.with_causal_fold(mask, causal_fold, causal_fill, q.shape[2], k.shape[2])
        mask = reference.with_key_slopes(mask, key_slopes, q.shape[2], k.shape[2])
        dq, dk, dv = reference.attention_backward(dout, q, k, v, scale=scale, causal=causal, mask=mask,
                                                  safe=safe_softmax, zero_empty_rows=mask_is_fill)
        return _laid_out_like(dq, q), _laid_out_like(dk, k), _laid_out_like(dv, v)
    from .flash_backward import flash_backward
    return _triton_call(q, flash_backward, dout, q, k, v, out, lse, scale=scale, causal=causal,
                        mask=_full_mask(mask, q, k), key_slopes=key_slopes, zero_empty_rows=mask_is_fill,
                        causal_fold=causal_fold, causal_fill=causal_fill)


flash_attention_backward = torch.library.custom_op("fxopt::flash_attention_backward",
                                                   mutates_args=())(run_flash_attention_backward)


@flash_attention_backward.register_fake
def _(dout, q, k, v, out, lse, mask, scale, causal, scale_by=None, scale_power=1, key_slopes=None,
      safe_softmax=False, mask_is_fill=False, causal_fold=None, causal_fill=0.0):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # as the kernels write them


def _setup_context(ctx, inputs, output):
    q, k, v, mask, scale, causal, scale_by, scale_power, key_slopes, safe_softmax, mask_is_fill, *fold = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask, scale_by, key_slopes)
    ctx.scale, ctx.causal, ctx.scale_power = scale, causal, scale_power
    ctx.safe_softmax, ctx.mask_is_fill, ctx.fold = safe_softmax, mask_is_fill, fold
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, mask, scale_by, key_slopes = ctx.saved_tensors
    dq, dk, dv = flash_attention_backward(dout, q, k, v, out, lse, mask, ctx.scale, ctx.causal, scale_by,
                                          ctx.scale_power, key_slopes, ctx.safe_softmax, ctx.mask_is_fill, *ctx.fold)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


flash_attention.register_autograd(_backward, setup_context=_setup_context)


def attention(q: Tensor, k: Tensor, v: Tensor, *, scale: Optional[float], causal: bool = False,
              mask: Optional[Tensor] = None, key_slopes: Optional[Tensor] = None, safe_softmax: bool = False) -> Tensor:
    """The fused op's output alone: what the matcher's replacement computes."""
    return flash_attention(q, k, v, mask, scale, causal, key_slopes=key_slopes, safe_softmax=safe_softmax)[0]
