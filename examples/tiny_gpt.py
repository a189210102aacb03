"""A small GPT, written the way real model code (Hugging Face GPT-2 style) writes it.

Nothing here knows about fxopt: attention is written by hand (no scaled_dot_product_attention), GELU
is GPT-2's tanh formula spelled out, and the LM head shares its weight with the token embedding.

    model, (idx,) = make(GPTConfig(n_layer=2, n_embd=64), batch=2, seq=16)
    logits = model(idx)                  # (batch, seq, vocab_size)
    loss = lm_loss(logits, idx)          # next-token cross-entropy
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 512
    block_size: int = 64  # longest sequence the model accepts (size of the position table and mask)
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5


def new_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation, as GPT-2 writes it (one chain of elementwise ops)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.head_dim = config.n_embd // config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        mask = torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool))
        self.register_buffer("bias", mask.view(1, 1, config.block_size, config.block_size), persistent=False)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        return x.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)

    def _merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        B, nh, T, hd = x.size()
        return x.transpose(1, 2).contiguous().view(B, T, nh * hd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.size(1)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = self._split_heads(q), self._split_heads(k), self._split_heads(v)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v
        return self.resid_dropout(self.c_proj(self._merge_heads(y)))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(new_gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as GPT-2 does
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.size()
        assert T <= self.config.block_size, f"sequence of {T} tokens, block_size is {self.config.block_size}"
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device).unsqueeze(0)  # (1, T)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        return self.lm_head(x)  # (B, T, vocab_size)


def lm_loss(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: position t predicts token t+1."""
    shift_logits = logits[:, :-1, :].contiguous()
    shift_labels = idx[:, 1:].contiguous()
    return F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))


def make(config: GPTConfig | None = None, batch: int = 2, seq: int = 16, device="cpu",
         dtype: torch.dtype = torch.float32, seed: int = 0):
    """(model, (idx,)): a GPT with deterministic weights (seeded), and a batch of random tokens."""
    config = config or GPTConfig()
    if seq > config.block_size:
        raise ValueError(f"seq={seq} is longer than config.block_size={config.block_size}")
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(config)
    model = model.to(device=device, dtype=dtype)
    idx = torch.randint(0, config.vocab_size, (batch, seq), generator=gen).to(device)
    return model, (idx,)
