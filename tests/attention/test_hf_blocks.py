"""Attention the way Hugging Face transformers writes it (our own small copies of the eager GPT-2,
Llama and BERT attention code; nothing downloaded): matched, fused, and equal to eager in float64,
forward and gradients. CPU runs use the Triton kernels in the interpreter."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import fxopt
from tests.helpers import TOL, assert_close_to_reference, compile_fxopt
from tests.models.hf_llama import repeat_kv, rotate_half


class GPT2Attention(nn.Module):
    """HF GPT-2 eager attention: Conv1D-style fused qkv, torch.where on a bool tril buffer with
    finfo.min, division by torch.full([], sqrt(d)), an optional additive attention_mask."""

    def __init__(self, d=32, heads=2, max_pos=32):
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.attn_dropout = nn.Dropout(0.1)
        self.register_buffer("bias", torch.tril(torch.ones(max_pos, max_pos, dtype=torch.bool)).view(1, 1, max_pos, max_pos),
                             persistent=False)

    def forward(self, x, attention_mask=None):
        b, t, c = x.shape
        query, key, value = self.c_attn(x).split(c, dim=2)
        query, key, value = (y.view(b, t, self.heads, self.head_dim).transpose(1, 2) for y in (query, key, value))
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        attn_weights = attn_weights / torch.full([], value.size(-1) ** 0.5, dtype=attn_weights.dtype,
                                                 device=attn_weights.device)
        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = self.bias[:, :, key_length - query_length:key_length, :key_length]
        mask_value = torch.full([], torch.finfo(attn_weights.dtype).min, dtype=attn_weights.dtype,
                                device=attn_weights.device)
        attn_weights = torch.where(causal_mask, attn_weights.to(attn_weights.dtype), mask_value)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_weights = attn_weights.type(value.dtype)
        attn_weights = self.attn_dropout(attn_weights)
        attn_output = torch.matmul(attn_weights, value)
        attn_output = attn_output.transpose(1, 2).reshape(b, t, c)
        return self.c_proj(attn_output)


class LlamaAttention(nn.Module):
    """HF Llama eager attention: RoPE, grouped-query heads through repeat_kv, softmax in fp32 cast back
    to the query dtype; the causal mask is an additive input (as HF passes it) or built in the graph."""

    def __init__(self, d=64, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d // heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(d, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, d, bias=False)

    def forward(self, x, cos, sin, attention_mask=None):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        key_states = repeat_kv(k, self.heads // self.kv_heads)
        value_states = repeat_kv(v, self.heads // self.kv_heads)
        attn_weights = torch.matmul(q, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is None:  # what newer HF versions build inside the model
            attention_mask = torch.full((t, t), torch.finfo(x.dtype).min, dtype=x.dtype, device=x.device).triu(1)
        attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        attn_weights = nn.functional.dropout(attn_weights, p=0.0, training=self.training)
        attn_output = torch.matmul(attn_weights, value_states)
        return self.o_proj(attn_output.transpose(1, 2).reshape(b, t, -1))


class BertSelfAttention(nn.Module):
    """HF BERT eager attention: division by math.sqrt(d), an extended padding mask [B, 1, 1, T]."""

    def __init__(self, d=32, heads=2):
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.dropout = nn.Dropout(0.1)

    def transpose_for_scores(self, x):
        return x.view(x.size()[:-1] + (self.heads, self.head_dim)).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask):
        extended = (1.0 - attention_mask[:, None, None, :].to(hidden_states.dtype)) * torch.finfo(hidden_states.dtype).min
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.head_dim)
        attention_scores = attention_scores + extended
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        attention_probs = self.dropout(attention_probs)
        context = torch.matmul(attention_probs, value_layer).permute(0, 2, 1, 3).contiguous()
        return context.view(context.size()[:-2] + (self.heads * self.head_dim,))


def rope(t, dim, device):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(t, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def causal_additive(b, t, device):
    return torch.full((t, t), torch.finfo(torch.float32).min).triu(1).expand(b, 1, t, t).to(device)


def _model_and_inputs(name, device):
    torch.manual_seed(0)
    x = torch.randn(2, 10, 64 if name.startswith("llama") else 32, device=device)
    if name == "gpt2":
        return GPT2Attention().to(device).eval(), (x,), "causal"
    if name == "gpt2_padding":
        pad = torch.zeros(2, 1, 1, 10, device=device)
        pad[1, ..., 7:] = torch.finfo(torch.float32).min
        return GPT2Attention().to(device).eval(), (x, pad), "causal"
    if name == "llama_mask_in_graph":
        return LlamaAttention().to(device).eval(), (x, *rope(10, 16, device)), "causal"
    if name == "llama_mask_input":
        return LlamaAttention().to(device).eval(), (x, *rope(10, 16, device), causal_additive(2, 10, device)), "additive"
    if name == "bert":
        keep = torch.ones(2, 10, device=device)
        keep[0, 6:] = 0
        return BertSelfAttention().to(device).eval(), (x, keep), "additive"
    raise KeyError(name)


BLOCKS = ["gpt2", "gpt2_padding", "llama_mask_in_graph", "llama_mask_input", "bert"]


@pytest.mark.parametrize("name", BLOCKS)
def test_hf_attention_is_fused_and_matches_eager(name, device):
    model, inputs, mask_kind = _model_and_inputs(name, device)
    rep = fxopt.explain(model, *inputs)
    assert [s.fused for s in rep.attention] == [True], [str(s) for s in rep.attention]
    assert rep.attention[0].mask.startswith(mask_kind), rep.attention[0].mask
    if name.startswith("llama"):
        assert rep.attention[0].kv_groups == 2
    out = compile_fxopt(model)(*inputs)
    ref = model.double()(*[t.double() if t.is_floating_point() else t for t in inputs])
    assert_close_to_reference(out, ref, torch.float32)


@pytest.mark.parametrize("name", ["gpt2", "llama_mask_in_graph", "bert"])
def test_gradients_through_the_fused_op_equal_eager(name, device):
    model, inputs, _ = _model_and_inputs(name, device)
    model.train()
    for mod in model.modules():
        if isinstance(mod, nn.Dropout):
            mod.p = 0.0
    x = inputs[0].clone().requires_grad_(True)
    ref_model = _model_and_inputs(name, device)[0].double().train()
    for mod in ref_model.modules():
        if isinstance(mod, nn.Dropout):
            mod.p = 0.0
    x64 = x.detach().double().requires_grad_(True)
    rest64 = [t.double() if t.is_floating_point() else t for t in inputs[1:]]

    compiled = compile_fxopt(model)
    compiled(x, *inputs[1:]).square().sum().backward()
    ref_model(x64, *rest64).square().sum().backward()

    rtol, atol = TOL[torch.float32]
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=rtol * 10, atol=atol * 10)
    for (pname, p), p64 in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad.double(), p64.grad, rtol=rtol * 10, atol=atol * 10, msg=pname)
    rep = fxopt.explain(model, x, *inputs[1:])
    backward = [g for g in rep.graphs if g.name == "backward"]
    assert backward and "flash_attention_backward" in backward[0].captured_text
