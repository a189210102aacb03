"""Whole-block workloads for the precision, training and CUDA-graph issues (6, 7), registered into
workloads.WORKLOADS.

  gpt_block_mixed / llama_block_mixed   inference of an fp32 model in mixed precision
  gpt_block_train / llama_block_train   forward + backward of an fp32 model in mixed precision
  gpt_block_train_cg                    the GPT-2 training step with CUDA graphs on both compilers
  gpt_block_b1 / gpt_block_b1_cg        a launch-bound GPT block forward (1 x 16 tokens), without and
                                        with CUDA graphs
  gpt_stack_train                       24 GPT-2 blocks trained as one graph: how the first call's
                                        compile grows with depth

"Mixed" workloads (`Workload.precision="bf16"`) keep the parameters and inputs in float32 whatever
--dtype says: eager and Inductor run the function under `torch.autocast(bf16)`, fxopt compiles it with
`fxopt.backend(precision="bf16")` and no autocast (measure.compile_for). Both are checked against
eager-with-autocast and, when not allclose, judged against a float64 run (measure.compare).
`cudagraphs=True` workloads compile Inductor with mode="reduce-overhead" and fxopt with cudagraphs=True.

The Llama block follows the Llama 3.2 1B shapes (d2048, 32 query heads of 64, 8 KV heads, SwiGLU
8192) written the way Hugging Face writes it: RMSNorm by hand in fp32, rotary embeddings with
rotate_half, repeat_kv for GQA, an additive causal mask, softmax in fp32.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .workloads import nbytes, randn, tensors, workload
from . import workloads_attention as attn  # the module, not its names: importing workloads_attention
# first imports workloads, which imports this module while workloads_attention is half-initialised


# ---------------------------------------------------------------- a Llama block, as HF writes it

class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(x, n_rep: int):
    B, H, T, D = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(B, H, n_rep, T, D).reshape(B, H * n_rep, T, D)


class LlamaAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, n_kv: int, max_len: int):
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = n_head, n_kv, d_model // n_head
        self.q_proj = nn.Linear(d_model, n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_head * self.head_dim, d_model, bias=False)
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        freqs = torch.outer(torch.arange(max_len).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        mask = torch.full((max_len, max_len), float("-inf")).triu(1)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x, use_sdpa: bool = False):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = self.cos[:T].to(q.dtype), self.sin[:T].to(q.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = repeat_kv(k, self.n_head // self.n_kv), repeat_kv(v, self.n_head // self.n_kv)
        if use_sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = q @ k.transpose(2, 3) / math.sqrt(self.head_dim)
            att = att + self.causal_mask[:T, :T]
            att = torch.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
            y = att @ v
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class LlamaMLP(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, d_model: int, n_head: int, n_kv: int, hidden: int, max_len: int):
        super().__init__()
        self.input_layernorm = RMSNorm(d_model)
        self.self_attn = LlamaAttention(d_model, n_head, n_kv, max_len)
        self.post_attention_layernorm = RMSNorm(d_model)
        self.mlp = LlamaMLP(d_model, hidden)

    def forward(self, x, use_sdpa: bool = False):
        x = x + self.self_attn(self.input_layernorm(x), use_sdpa)
        return x + self.mlp(self.post_attention_layernorm(x))


# ---------------------------------------------------------------- what each backend runs

def _block(block, x):
    return block(x)


def _block_sdpa(block, x):
    return block(x, use_sdpa=True)


def _block_train(block, x, dy, use_sdpa: bool = False):
    """Forward and backward: (output, dx, every parameter's gradient)."""
    out = block(x, use_sdpa)
    return (out, *attn._gradients(out, (x, *block.parameters()), dy))


def _block_train_sdpa(block, x, dy):
    return _block_train(block, x, dy, use_sdpa=True)


def _linear_flops(block, x) -> int:
    tokens = x.shape[0] * x.shape[1]
    return sum(2 * tokens * m.in_features * m.out_features for m in block.modules() if isinstance(m, nn.Linear))


def _attention_flops(block, x) -> int:
    B, T, C = x.shape
    n_head = (getattr(block, "attn", None) or block.self_attn).n_head
    q_like = torch.empty(B, n_head, T, C // n_head, device="meta")
    return attn.attention_flops(q_like, q_like, causal=True)


def _forward_flops(inputs) -> int:
    block, x = inputs[:2]
    return _linear_flops(block, x) + _attention_flops(block, x)


def _train_flops(inputs) -> int:
    """Linears: forward + two backward matmuls (3x); attention: forward + backward (3.5x, FlashAttention's count)."""
    block, x = inputs[:2]
    return 3 * _linear_flops(block, x) + int(3.5 * _attention_flops(block, x))


def _io_bytes(inputs, outputs) -> int:
    """Activations and every parameter read once, the outputs (gradients included) written once."""
    block, *acts = inputs
    return (sum(nbytes(t) for t in acts) + sum(nbytes(p) for p in block.parameters())
            + sum(nbytes(t) for t in tensors(outputs)))


def _gpt(device, dtype, quick, B, T, train=False):
    d_model, n_head = (128, 4) if quick else (1024, 16)
    T = 64 if quick and T > 64 else T
    B = min(B, 2) if quick else B
    block = attn.GPTBlock(d_model, n_head, max_len=T).to(device=device, dtype=dtype)
    block.train(False).requires_grad_(train)
    x = randn(B, T, d_model, device=device, dtype=dtype).requires_grad_(train)
    return block, x


def _llama(device, dtype, quick, B, T, train=False):
    d_model, n_head, n_kv, hidden = (128, 4, 2, 256) if quick else (2048, 32, 8, 8192)
    B, T = (2, 64) if quick else (B, T)
    block = LlamaBlock(d_model, n_head, n_kv, hidden, max_len=T).to(device=device, dtype=dtype)
    block.train(False).requires_grad_(train)
    x = randn(B, T, d_model, device=device, dtype=dtype).requires_grad_(train)
    return block, x


MIXED = dict(kind="model", precision="bf16", rtol=5e-2, atol=5e-2)


@workload("gpt_block_mixed", "GPT-2 block fwd, fp32 params and input; autocast(bf16) for eager/Inductor, "
          "precision='bf16' for fxopt; d1024 16 heads B16 T1024", flops=_forward_flops, min_bytes=_io_bytes,
          anchor=_block_sdpa, **MIXED)
def make_gpt_block_mixed(device, dtype, quick):
    return _block, _gpt(device, torch.float32, quick, 16, 1024)


@workload("llama_block_mixed", "Llama block fwd (RMSNorm, RoPE, GQA 32/8 heads, SwiGLU 8192), fp32 params; "
          "autocast(bf16) vs precision='bf16'; d2048 B4 T1024", flops=_forward_flops, min_bytes=_io_bytes,
          anchor=_block_sdpa, **MIXED)
def make_llama_block_mixed(device, dtype, quick):
    return _block, _llama(device, torch.float32, quick, 4, 1024)


@workload("gpt_block_train", "GPT-2 block fwd+bwd (out, dx, all param grads), fp32 params; autocast(bf16) "
          "vs precision='bf16'; d1024 B8 T1024", training=True, flops=_train_flops, min_bytes=_io_bytes,
          anchor=_block_train_sdpa, **MIXED)
def make_gpt_block_train(device, dtype, quick):
    block, x = _gpt(device, torch.float32, quick, 8, 1024, train=True)
    return _block_train, (block, x, torch.randn_like(x).requires_grad_(False))


workload("gpt_block_train_cg", "as gpt_block_train with CUDA graphs: Inductor mode='reduce-overhead', fxopt "
         "cudagraphs=True (the step without launch cost)", training=True, flops=_train_flops, min_bytes=_io_bytes,
         anchor=_block_train_sdpa, cudagraphs=True, **MIXED)(make_gpt_block_train)


@workload("llama_block_train", "Llama block fwd+bwd (out, dx, all param grads), fp32 params; autocast(bf16) "
          "vs precision='bf16'; d2048 B4 T1024", training=True, flops=_train_flops, min_bytes=_io_bytes,
          anchor=_block_train_sdpa, **MIXED)
def make_llama_block_train(device, dtype, quick):
    block, x = _llama(device, torch.float32, quick, 4, 1024, train=True)
    return _block_train, (block, x, torch.randn_like(x).requires_grad_(False))


@workload("gpt_block_b1", "GPT-2 block fwd, batch 1 x 16 tokens (launch-bound), no CUDA graphs; d1024",
          kind="model", flops=_forward_flops, min_bytes=_io_bytes, anchor=_block_sdpa)
def make_gpt_block_b1(device, dtype, quick):
    return _block, _gpt(device, dtype, quick, 1, 16)


workload("gpt_block_b1_cg", "as gpt_block_b1 with CUDA graphs: Inductor mode='reduce-overhead', fxopt "
         "cudagraphs=True", kind="model", flops=_forward_flops, min_bytes=_io_bytes,
         cudagraphs=True)(make_gpt_block_b1)  # the same block and input, with graphs


# ---------------------------------------------------------------- a deep stack: compile time against depth

class GPTStack(nn.Module):
    """GPT-2 medium's body: `n_layer` blocks, captured as one graph (no graph breaks between blocks)."""

    def __init__(self, n_layer: int, d_model: int, n_head: int, max_len: int):
        super().__init__()
        self.blocks = nn.ModuleList(attn.GPTBlock(d_model, n_head, max_len) for _ in range(n_layer))

    def forward(self, x, use_sdpa: bool = False):
        for block in self.blocks:
            x = block(x, use_sdpa)
        return x


def _stack_train_flops(inputs) -> int:
    stack, x = inputs[:2]
    return len(stack.blocks) * _train_flops((stack.blocks[0], x))


@workload("gpt_stack_train", "24 GPT-2 blocks fwd+bwd as one graph (GPT-2 medium body: d1024 16 heads), fp32 "
          "params; autocast(bf16) vs precision='bf16'; B4 T1024", training=True, flops=_stack_train_flops,
          min_bytes=_io_bytes, anchor=_block_train_sdpa, **MIXED)
def make_gpt_stack_train(device, dtype, quick):
    n_layer, d_model, n_head, B, T = (2, 128, 4, 2, 64) if quick else (24, 1024, 16, 4, 1024)
    stack = GPTStack(n_layer, d_model, n_head, max_len=T).to(device=device)
    stack.train(False)
    x = randn(B, T, d_model, device=device, dtype=torch.float32).requires_grad_(True)
    return _block_train, (stack, x, torch.randn_like(x).requires_grad_(False))
