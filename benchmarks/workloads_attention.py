"""Attention workloads (causal and full forward, causal backward, decode, a GPT-2 block), registered
into workloads.WORKLOADS, each with an SDPA anchor.

The attention is written by hand the way model code writes it: `q @ k.transpose(-2, -1) * scale`, a
causal mask applied with `masked_fill` (a `torch.triu` mask built in the function, or GPT-2's
registered `tril` buffer), softmax in fp32 and cast back, `@ v`. That is what fxopt's matcher has to
recognise; the anchor (`Workload.anchor`) computes the same thing with
`F.scaled_dot_product_attention`, so every table has PyTorch's own fused kernel next to it.

Sizes follow the attention issue (bf16): q [B, H, Tq, D], k and v [B, H, Tk, D].

FLOPs are counted as FlashAttention's benchmarks count them, so TFLOP/s can be compared with published
numbers and with the SDPA row (which is given the same count):
  forward   4 * B * H * Tq * Tk * D          (two matmuls, q @ k^T and p @ v; halved when causal)
  backward  2.5 * forward                    (five matmuls: s recomputed, dv, dp, dq, dk)
  training  3.5 * forward                    (attn_causal_bwd times forward + backward together)
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .workloads import nbytes, randn, tensors, workload

BACKWARD_FLOPS_PER_FORWARD = 2.5  # FlashAttention's convention: backward = 5 matmuls vs forward's 2


# ---------------------------------------------------------------- hand-written attention (what gets matched)
# Module-level, so that dynamo sees the same code object on every run.

def _causal_attention(q, k, v):
    """Causal attention as a model writes it: the mask is built from torch.triu inside the function."""
    T = q.size(-2)
    scale = 1.0 / math.sqrt(q.size(-1))
    att = q @ k.transpose(-2, -1) * scale
    future = torch.triu(torch.ones(T, T, dtype=torch.bool, device=q.device), diagonal=1)
    att = att.masked_fill(future, float("-inf"))
    att = torch.softmax(att.float(), dim=-1).to(q.dtype)
    return att @ v


def _full_attention(q, k, v):
    """Attention with no mask (encoder attention, and decode: one query against the whole cache)."""
    scale = 1.0 / math.sqrt(q.size(-1))
    att = q @ k.transpose(-2, -1) * scale
    att = torch.softmax(att.float(), dim=-1).to(q.dtype)
    return att @ v


@torch.compiler.disable
def _gradients(out, inputs, dout):
    """torch.autograd.grad kept outside dynamo, as a training loop's backward is. A compiler sees the
    forward graph and, through aot_autograd, its backward graph; without this, dynamo would try to
    trace into the compiled backward where autograd runs it on the calling thread (CPU)."""
    return torch.autograd.grad(out, inputs, dout)


def _masked_fwd_bwd(attention):
    """attention(q, k, v, mask) and its gradients (dq, dk, dv) for dout: a masked workload's training step."""
    def fwd_bwd(q, k, v, mask, dout):
        return _gradients(attention(q, k, v, mask), (q, k, v), dout)
    fwd_bwd.__name__ = fwd_bwd.__qualname__ = f"{attention.__name__}_fwd_bwd"
    return fwd_bwd


def _masked_training_inputs(device, dtype, B, H, T, D, mask) -> tuple:
    """(q, k, v, mask, dout) for a _masked_fwd_bwd workload, q, k and v leaves that require grad."""
    q, k, v = _qkv(device, dtype, B, H, T, T, D, requires_grad=True)
    return q, k, v, mask, randn(B, H, T, D, device=device, dtype=dtype)


def _alibi_slopes(heads: int, device) -> torch.Tensor:
    """ALiBi's per-head slopes 2^(-8 h / H), h = 1..H (Press et al.; BLOOM and MPT use these)."""
    return torch.pow(2.0, -8.0 * torch.arange(1, heads + 1, device=device) / heads)


def _alibi_bias(q) -> torch.Tensor:
    """[1, H, T, T] fp32: slope_h * (j - i), a causal ALiBi bias as model code builds it."""
    T = q.size(-2)
    pos = torch.arange(T, device=q.device)
    return _alibi_slopes(q.size(1), q.device)[None, :, None, None] * (pos[None, :] - pos[:, None]).float()


def _alibi_attention(q, k, v):
    """Causal attention with ALiBi written by hand: a bias built in the function, then a causal fill."""
    T = q.size(-2)
    att = (q @ k.transpose(-2, -1)).float() * (1.0 / math.sqrt(q.size(-1))) + _alibi_bias(q)
    future = torch.triu(torch.ones(T, T, dtype=torch.bool, device=q.device), diagonal=1)
    att = torch.softmax(att.masked_fill(future, float("-inf")), dim=-1).to(q.dtype)
    return att @ v


def _causal_attention_fwd_bwd(q, k, v, dout):
    """Forward and backward of _causal_attention: (dq, dk, dv)."""
    return _gradients(_causal_attention(q, k, v), (q, k, v), dout)


# ---------------------------------------------------------------- SDPA anchors (same inputs, same result)

def _sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(q.size(-1)))


def _sdpa_full(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(q.size(-1)))


def _sdpa_alibi(q, k, v):
    """The same bias and causal mask as one float mask, which SDPA reads (no flash kernel takes it)."""
    T = q.size(-2)
    future = torch.triu(torch.ones(T, T, dtype=torch.bool, device=q.device), diagonal=1)
    mask = _alibi_bias(q).masked_fill(future, float("-inf")).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(q.size(-1)))


def _sdpa_causal_fwd_bwd(q, k, v, dout):
    return _gradients(_sdpa_causal(q, k, v), (q, k, v), dout)


# ---------------------------------------------------------------- sizes and costs

def _qkv(device, dtype, B, H, Tq, Tk, D, requires_grad=False):
    q = randn(B, H, Tq, D, device=device, dtype=dtype)
    k = randn(B, H, Tk, D, device=device, dtype=dtype)
    v = randn(B, H, Tk, D, device=device, dtype=dtype)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def attention_flops(q, k, causal: bool) -> int:
    """Forward FLOPs of attention: 4 * B * H * Tq * Tk * D, half of it when causal."""
    B, H, Tq, D = q.shape
    flops = 4 * B * H * Tq * k.shape[-2] * D
    return flops // 2 if causal else flops


def _causal_flops(inputs) -> int:
    return attention_flops(inputs[0], inputs[1], causal=True)


def _full_flops(inputs) -> int:
    return attention_flops(inputs[0], inputs[1], causal=False)


def _causal_fwd_bwd_flops(inputs) -> int:
    return int((1 + BACKWARD_FLOPS_PER_FORWARD) * _causal_flops(inputs))


# ---------------------------------------------------------------- the attention workloads

@workload("attn_causal", "causal attention fwd, hand-written (triu mask, fp32 softmax); B8 H16 T2048 D128",
          kind="attention", flops=_causal_flops, anchor=_sdpa_causal)
def make_attn_causal(device, dtype, quick):
    B, H, T, D = (1, 2, 64, 32) if quick else (8, 16, 2048, 128)
    return _causal_attention, _qkv(device, dtype, B, H, T, T, D)


@workload("attn_full", "attention fwd, no mask, hand-written; B4 H16 T4096 D128",
          kind="attention", flops=_full_flops, anchor=_sdpa_full)
def make_attn_full(device, dtype, quick):
    B, H, T, D = (1, 2, 64, 64) if quick else (4, 16, 4096, 128)
    return _full_attention, _qkv(device, dtype, B, H, T, T, D)


@workload("attn_alibi", "causal attention fwd with an ALiBi bias built in the function (computed by fxopt's "
          "kernel from per-head slopes); B8 H16 T2048 D128; SDPA anchor takes bias and mask as one float mask",
          kind="attention", flops=_causal_flops, anchor=_sdpa_alibi, rtol=5e-2, atol=5e-2)
def make_attn_alibi(device, dtype, quick):
    B, H, T, D = (1, 2, 64, 32) if quick else (8, 16, 2048, 128)
    return _alibi_attention, _qkv(device, dtype, B, H, T, T, D)


@workload("attn_causal_bwd", "causal attention fwd+bwd (dq, dk, dv) via autograd; B8 H16 T2048 D128; "
          "FLOPs = 3.5x fwd", kind="attention", training=True, flops=_causal_fwd_bwd_flops,
          anchor=_sdpa_causal_fwd_bwd, rtol=5e-2, atol=5e-2)
def make_attn_causal_bwd(device, dtype, quick):
    B, H, T, D = (1, 2, 64, 32) if quick else (8, 16, 2048, 128)
    q, k, v = _qkv(device, dtype, B, H, T, T, D, requires_grad=True)
    return _causal_attention_fwd_bwd, (q, k, v, randn(B, H, T, D, device=device, dtype=dtype))


@workload("attn_decode", "decode: one query vs a KV cache, no mask; B8 H32 Tq1 Tk8192 D128 (memory-bound: "
          "min bytes = q + K + V + out)", kind="attention", anchor=_sdpa_full)
def make_attn_decode(device, dtype, quick):
    B, H, Tk, D = (2, 2, 256, 32) if quick else (8, 32, 8192, 128)
    return _full_attention, _qkv(device, dtype, B, H, 1, Tk, D)


def _padding_keep(B: int, T: int, device) -> torch.Tensor:
    """A key padding mask [B, 1, 1, T]: sequence b keeps its first T - 128 * b keys (True = attend)."""
    lengths = torch.tensor([max(T - 128 * b, 1) for b in range(B)], device=device)
    return (torch.arange(T, device=device)[None, :] < lengths[:, None])[:, None, None, :]


def _sdpa_padded(q, k, v, keep):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


@workload("attn_sdpa_padded", "F.scaled_dot_product_attention with a bool key padding mask [B, 1, 1, T] (fused "
          "by fxopt with SDPA's safe softmax; eager and Inductor run SDPA's masked kernel); B8 H16 T2048 D128",
          kind="attention", flops=_full_flops, anchor=_sdpa_padded)
def make_attn_sdpa_padded(device, dtype, quick):
    B, H, T, D = (2, 2, 64, 32) if quick else (8, 16, 2048, 128)
    return _sdpa_padded, (*_qkv(device, dtype, B, H, T, T, D), _padding_keep(B, T, device))


_sdpa_padded_fwd_bwd = _masked_fwd_bwd(_sdpa_padded)


def _padded_fwd_bwd_flops(inputs) -> int:
    return int((1 + BACKWARD_FLOPS_PER_FORWARD) * _full_flops(inputs))


@workload("attn_sdpa_padded_bwd", "attn_sdpa_padded fwd+bwd (dq, dk, dv) via autograd (the mask read by the TMA "
          "backward too); B8 H16 T2048 D128; FLOPs = 3.5x fwd", kind="attention", training=True,
          flops=_padded_fwd_bwd_flops, anchor=_sdpa_padded_fwd_bwd, rtol=5e-2, atol=5e-2)
def make_attn_sdpa_padded_bwd(device, dtype, quick):
    B, H, T, D = (2, 2, 64, 32) if quick else (8, 16, 2048, 128)
    return _sdpa_padded_fwd_bwd, _masked_training_inputs(device, dtype, B, H, T, D, _padding_keep(B, T, device))


def _llama_4d_mask(keep: torch.Tensor, dtype) -> torch.Tensor:
    """transformers' Llama 4-D additive mask [B, 1, T, T] from a key padding mask: finfo.min above the
    diagonal and at padded keys, built before the attention (a runtime tensor to a compiler)."""
    T = keep.shape[-1]
    visible = torch.ones(T, T, dtype=torch.bool, device=keep.device).tril() & keep
    return torch.zeros(visible.shape, dtype=dtype, device=keep.device).masked_fill(~visible, torch.finfo(dtype).min)


def _hf_llama_masked(q, k, v, causal_mask):
    """HF Llama's eager attention: scores times the scaling, + the 4-D mask, softmax in fp32, cast back."""
    att = torch.matmul(q, k.transpose(2, 3)) * q.size(-1) ** -0.5 + causal_mask
    return torch.matmul(F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _sdpa_llama_masked(q, k, v, causal_mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask)  # (HF's sdpa attention does this)


@workload("attn_llama_mask", "HF Llama eager attention with its 4-D additive causal + padding mask [B, 1, T, T] "
          "built outside (fxopt: the mask's visible key range per query block, mask_blocks.py); B8 H16 T2048 D128; "
          "causal FLOPs; SDPA anchor takes the same mask", kind="attention", flops=_causal_flops,
          anchor=_sdpa_llama_masked, rtol=5e-2, atol=5e-2)
def make_attn_llama_mask(device, dtype, quick):
    B, H, T, D = (2, 2, 64, 32) if quick else (8, 16, 2048, 128)
    mask = _llama_4d_mask(_padding_keep(B, T, device), dtype)
    return _hf_llama_masked, (*_qkv(device, dtype, B, H, T, T, D), mask)


_hf_llama_masked_fwd_bwd = _masked_fwd_bwd(_hf_llama_masked)


_sdpa_llama_masked_fwd_bwd = _masked_fwd_bwd(_sdpa_llama_masked)


@workload("attn_llama_mask_bwd", "attn_llama_mask fwd+bwd (dq, dk, dv) via autograd (fxopt's backward kernels walk "
          "the mask's visible ranges too); B8 H16 T2048 D128; FLOPs = 3.5x causal fwd", kind="attention",
          training=True, flops=_causal_fwd_bwd_flops, anchor=_sdpa_llama_masked_fwd_bwd, rtol=5e-2, atol=5e-2)
def make_attn_llama_mask_bwd(device, dtype, quick):
    B, H, T, D = (2, 2, 64, 32) if quick else (8, 16, 2048, 128)
    mask = _llama_4d_mask(_padding_keep(B, T, device), dtype)
    return _hf_llama_masked_fwd_bwd, _masked_training_inputs(device, dtype, B, H, T, D, mask)


def _hf_gpt2_padded(q, k, v, attention_mask):
    """HF GPT-2's eager attention: division by a 0-dim tensor, torch.where on a bool tril (HF's is a
    buffer, built here) with the dtype's finite finfo.min, then + HF's padding mask, (1 - keep) * finfo.min."""
    T = q.size(-2)
    tril = torch.tril(torch.ones(T, T, dtype=torch.bool, device=q.device)).view(1, 1, T, T)
    att = torch.matmul(q, k.transpose(-1, -2)) / torch.full([], v.size(-1) ** 0.5, dtype=q.dtype, device=q.device)
    fill = torch.full([], torch.finfo(att.dtype).min, dtype=att.dtype, device=att.device)
    att = torch.where(tril, att, fill) + attention_mask
    return torch.matmul(F.softmax(att, dim=-1).type(v.dtype), v)


def _sdpa_causal_and_padded(q, k, v, attention_mask):
    T = q.size(-2)
    tril = torch.tril(torch.ones(T, T, dtype=torch.bool, device=q.device)).view(1, 1, T, T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=tril & (attention_mask == 0))


@workload("attn_hf_padded", "HF GPT-2 eager attention with a padding mask: where(tril, s, finfo.min) + "
          "(1 - keep) * finfo.min (the kernels fold the causal fill into the mask tiles and skip the blocks above "
          "the diagonal where every row sees a real score); B8 H16 T2048 D128; "
          "causal FLOPs; SDPA anchor takes tril & keep as one bool mask", kind="attention", flops=_causal_flops,
          anchor=_sdpa_causal_and_padded, rtol=5e-2, atol=5e-2)
def make_attn_hf_padded(device, dtype, quick):
    B, H, T, D = (2, 2, 64, 32) if quick else (8, 16, 2048, 128)
    attention_mask = (1.0 - _padding_keep(B, T, device).to(dtype)) * torch.finfo(dtype).min
    return _hf_gpt2_padded, (*_qkv(device, dtype, B, H, T, T, D), attention_mask)


_hf_gpt2_padded_fwd_bwd = _masked_fwd_bwd(_hf_gpt2_padded)


_sdpa_causal_and_padded_fwd_bwd = _masked_fwd_bwd(_sdpa_causal_and_padded)


@workload("attn_hf_padded_bwd", "attn_hf_padded fwd+bwd (dq, dk, dv) via autograd (fxopt's backward skips "
          "the key tiles above the diagonal as its forward does); B8 H16 T2048 D128; FLOPs = 3.5x causal fwd",
          kind="attention", training=True,
          flops=_causal_fwd_bwd_flops, anchor=_sdpa_causal_and_padded_fwd_bwd, rtol=5e-2, atol=5e-2)
def make_attn_hf_padded_bwd(device, dtype, quick):
    B, H, T, D = (2, 2, 64, 32) if quick else (8, 16, 2048, 128)
    attention_mask = (1.0 - _padding_keep(B, T, device).to(dtype)) * torch.finfo(dtype).min
    return _hf_gpt2_padded_fwd_bwd, _masked_training_inputs(device, dtype, B, H, T, D, attention_mask)


# ---------------------------------------------------------------- GPT-2 block

class CausalSelfAttention(nn.Module):
    """GPT-2 attention as model code writes it: one fused qkv Linear, heads split with view/transpose,
    a registered lower-triangular `bias` buffer as the causal mask, fp32 softmax. `use_sdpa=True` takes
    the F.scaled_dot_product_attention path instead (as nanoGPT picks its "flash" path), with the
    same weights: that is the anchor."""

    def __init__(self, d_model: int, n_head: int, max_len: int):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        mask = torch.tril(torch.ones(max_len, max_len, dtype=torch.bool))
        self.register_buffer("bias", mask.view(1, 1, max_len, max_len), persistent=False)

    def forward(self, x, use_sdpa: bool = False):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if use_sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = torch.softmax(att.float(), dim=-1).to(q.dtype)
            y = att @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's GELU
        self.c_proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class GPTBlock(nn.Module):
    """Pre-LayerNorm GPT-2 transformer block: x + attn(ln_1(x)), then + mlp(ln_2(.))."""

    def __init__(self, d_model: int, n_head: int, max_len: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, max_len)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x, use_sdpa: bool = False):
        x = x + self.attn(self.ln_1(x), use_sdpa)
        return x + self.mlp(self.ln_2(x))


def _gpt_block(block, x):
    return block(x)


def _gpt_block_sdpa(block, x):
    return block(x, use_sdpa=True)


def _gpt_block_flops(inputs) -> int:
    """Every Linear (2 * M * N * K) plus causal attention's forward FLOPs."""
    block, x = inputs
    B, T, C = x.shape
    linears = sum(2 * B * T * m.in_features * m.out_features for m in block.modules() if isinstance(m, nn.Linear))
    head_dim = C // block.attn.n_head
    q_like = torch.empty(B, block.attn.n_head, T, head_dim, device="meta")
    return linears + attention_flops(q_like, q_like, causal=True)


def _gpt_block_bytes(inputs, outputs) -> int:
    """x and every parameter read once, the output written once (the mask buffer is not needed)."""
    block, x = inputs
    return nbytes(x) + sum(nbytes(p) for p in block.parameters()) + sum(nbytes(t) for t in tensors(outputs))


@workload("gpt_block", "GPT-2 block fwd (LN, qkv Linear, hand-written causal attn with tril buffer, proj, "
          "LN, GELU MLP, residuals); d1024 16 heads B16 T1024", kind="model", flops=_gpt_block_flops,
          min_bytes=_gpt_block_bytes, anchor=_gpt_block_sdpa)
def make_gpt_block(device, dtype, quick):
    B, T, d_model, n_head = (2, 64, 128, 4) if quick else (16, 1024, 1024, 16)
    block = GPTBlock(d_model, n_head, max_len=T).to(device=device, dtype=dtype).eval().requires_grad_(False)
    return _gpt_block, (block, randn(B, T, d_model, device=device, dtype=dtype))
