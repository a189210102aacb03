"""Mixed precision on whole models: GPT-style and Llama-style blocks as accurate as torch.autocast
(against a float64 reference), a tiny GPT trained with precision="bf16" following autocast's loss
curve, an fp16 step under torch.amp.GradScaler, and no cast left as a kernel of its own where a
neighbouring kernel could have taken it.

CPU notes. torch.autocast on the CPU keeps softmax and layer_norm in the low dtype (CUDA's autocast
runs them in fp32), so the bound below is against autocast-on-CPU's error. The Triton interpreter
(TRITON_INTERPRET=1, set by conftest) computes tl.dot on bf16 wrongly and rounds fp32 -> bf16 by
truncation (its cast has no rounding mode; the GPU rounds to nearest even), which doubles bf16 errors.
So the bf16 accuracy runs set TRITON_INTERPRET=0 (fused groups run as torch subgraphs, the attention op
takes its torch reference path); fp16 runs and the bf16 training run (attention unfused there) keep
the interpreter, so every generated kernel runs.
"""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxopt
from fxopt.passes.fuse import FUSED_PREFIX
from fxopt.passes.cached_casts import CachedCast
from tests.helpers import compile_fxopt

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from tiny_gpt import Block, GPTConfig, lm_loss, make  # noqa: E402

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
aten, prims = torch.ops.aten, torch.ops.prims
CASTS = {aten._to_copy.default, prims.convert_element_type.default}
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default}


class RMSNorm(nn.Module):
    """Llama's RMSNorm: up to fp32, mean of squares, back to the input dtype."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


class LlamaBlock(nn.Module):
    """RMSNorm, RoPE, grouped-query attention through repeat_kv, a causal mask built in the graph,
    softmax in fp32 cast back, and a SwiGLU MLP, the way HF Llama writes them."""

    def __init__(self, d=64, heads=4, kv_heads=2, hidden=128):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d // heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.gate, self.up = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def _repeat_kv(self, t):
        b, h, s, d = t.shape
        n = self.heads // self.kv_heads
        return t[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        scores = torch.matmul(q, self._repeat_kv(k).transpose(2, 3)) * self.head_dim ** -0.5
        scores = scores + torch.full((t, t), torch.finfo(x.dtype).min, dtype=x.dtype).triu(1)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        x = x + self.o_proj(torch.matmul(probs, self._repeat_kv(v)).transpose(1, 2).reshape(b, t, -1))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def rope(t, dim):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(t, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def block_and_inputs(name):
    torch.manual_seed(0)
    if name == "gpt":
        return Block(GPTConfig(n_embd=64, n_head=2, block_size=32)).eval(), (torch.randn(2, 16, 64),)
    return LlamaBlock().eval(), (torch.randn(2, 16, 64), *rope(16, 16))


def rel_error(out, ref64) -> float:
    return ((out.double() - ref64).norm() / ref64.norm()).item()


# precision -> TRITON_INTERPRET (see the module docstring for why bf16 leaves the interpreter)
RUNS = {"bf16": "0", "fp16": "1"}
SHORT = {"bf16": "bf16", "fp16": "f16"}  # as graphs print dtypes


@pytest.mark.parametrize("precision", RUNS)
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_block_is_as_accurate_as_autocast(name, precision, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", RUNS[precision])
    model, inputs = block_and_inputs(name)
    ref = copy.deepcopy(model).double()(*[t.double() for t in inputs])
    with torch.autocast("cpu", dtype=LOW[precision]):
        autocast_out = model(*inputs)
    out = compile_fxopt(model, precision=precision)(*inputs)
    assert out.dtype == torch.float32  # the block's interface stays fp32
    ours, theirs = rel_error(out, ref), rel_error(autocast_out, ref)
    assert ours <= 1.5 * theirs, f"fxopt {ours:.3g} vs autocast {theirs:.3g} relative error against float64"
    rep = fxopt.explain(model, *inputs, precision=precision)
    assert [s.fused for s in rep.attention] == [True]
    attention = [line for line in rep.graphs[0].captured_text.splitlines() if "fxopt.flash_attention" in line]
    assert len(attention) == 1 and f"# ({SHORT[precision]}[" in attention[0], attention  # runs in the low dtype


def _forward_backward(model, fn, inputs, dy):
    """The block's output and the gradients of (output * dy).sum() w.r.t. its input and parameters."""
    model = copy.deepcopy(model).train(False)
    x = inputs[0].detach().clone().requires_grad_(True)
    out = fn(model)(x, *inputs[1:])
    (out.float() * dy).sum().backward()
    return [out, x.grad] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_block_gradients_are_as_accurate_as_autocast_in_fp16(name):
    """Training: the output and every gradient (input, each parameter) within 1.5x of autocast's relative
    error against float64, in fp16 so that every forward and backward kernel runs in the interpreter
    (its bf16 casts truncate, see above; bf16 training accuracy is the GPU runner's check)."""
    model, inputs = block_and_inputs(name)
    dy = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1))
    ref = _forward_backward(model.double(), lambda m: m, [t.double() for t in inputs], dy.double())
    model = model.float()

    def autocast(m):
        def run(*args):
            with torch.autocast("cpu", dtype=torch.float16):
                return m(*args)
        return run
    theirs = _forward_backward(model, autocast, inputs, dy)
    ours = _forward_backward(model, lambda m: compile_fxopt(m, precision="fp16"), inputs, dy)
    assert ours[0].dtype == torch.float32 and all(g.dtype == torch.float32 for g in ours[1:])
    for i, (o, t, r) in enumerate(zip(ours, theirs, ref)):
        assert rel_error(o, r) <= 1.5 * rel_error(t, r) + 1e-6, (i, rel_error(o, r), rel_error(t, r))


def _is_kernel(node) -> bool:
    return node.op == "call_module" and str(node.target).startswith(FUSED_PREFIX)


def _cast_only_kernels(gm):
    """Kernels whose every op is a cast (or a view absorbed into the kernel's loads)."""
    found = []
    for node in gm.graph.nodes:
        if _is_kernel(node):
            ops = [n.target for n in gm.get_submodule(node.target).graph.nodes if n.op == "call_function"]
            if any(op in CASTS for op in ops) and all(op in CASTS or op.is_view for op in ops):
                found.append(node)
    return found


@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
def test_no_cast_stands_alone_next_to_a_kernel(grad):
    """A cast kernel of its own only where no kernel is next to it: a parameter's cast before its matmul
    (training),
    the fp32 logits out of the head's bf16 matmul; backward: the logits' fp32 gradient into the head's
    matmul, each bf16 weight gradient cast to fp32 for its parameter."""
    model, (idx,) = make(GPTConfig(vocab_size=128, block_size=16, n_layer=1, n_head=2, n_embd=32), batch=2, seq=8)
    with torch.set_grad_enabled(grad):
        rep = fxopt.explain(model, idx, precision="bf16")
    assert {g.name for g in rep.graphs} == ({"forward", "backward"} if grad else {"inference"})
    parameter_casts = parameter_cast_kernels = 0
    for g in rep.graphs:
        gm = rep.graph(after="cleanup_after_fuse", graph=g.name)
        for kernel in _cast_only_kernels(gm):
            neighbours = kernel.all_input_nodes + list(kernel.users)
            assert not any(_is_kernel(n) for n in neighbours), f"{g.name}: {kernel.name} could fuse with a neighbour"
            assert all(n.op == "placeholder" or n.target in MATMULS for n in kernel.all_input_nodes), kernel.format_node()
            if g.name != "backward" and all(n.op == "placeholder" for n in kernel.all_input_nodes):
                parameter_casts += len(kernel.args)  # (passes/combine_casts.py: one kernel casts several)
                parameter_cast_kernels += 1
    # training: weight and bias of the block's 4 linears and the (tied) head's weight, every call, in
    # one launch; inference: none, the casts are cached across calls (test_inference_caches_parameter_casts)
    assert (parameter_casts, parameter_cast_kernels) == ((4 * 2 + 1, 1) if grad else (0, 0))


def _train(fn, model, idx, steps, scaler=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(fn(idx), idx)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        losses.append(loss.item())
    return losses


def _autocast(model, dtype):
    def run(idx):
        with torch.autocast("cpu", dtype=dtype):
            return model(idx)
    return run


def test_tiny_gpt_in_bf16_follows_the_autocast_loss_curve():
    """Head dim 8: attention stays unfused (matmul, fp32 softmax, matmul), so every kernel runs in the
    interpreter under the default bf16 policy."""
    model, (idx,) = make(GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32), batch=2, seq=8)
    ref_model = copy.deepcopy(model)
    losses = _train(compile_fxopt(model, precision="bf16"), model, idx, steps=4)
    ref_losses = _train(_autocast(ref_model, torch.bfloat16), ref_model, idx, steps=4)
    assert ref_losses[-1] < ref_losses[0] * 0.9  # it trains: the comparison is not of constants
    for step, (got, ref) in enumerate(zip(losses, ref_losses)):
        assert got == pytest.approx(ref, rel=0.01), f"step {step}: fxopt {got} vs autocast {ref}"
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_fp16_step_with_grad_scaler_matches_autocast():
    """fp16 with torch.amp.GradScaler: scaled loss, fp32 gradients unscaled and checked for inf by the
    scaler, fused attention (head dim 16) forward and backward in fp16."""
    model, (idx,) = make(GPTConfig(vocab_size=128, block_size=16, n_layer=1, n_head=2, n_embd=32), batch=2, seq=8)
    ref_model = copy.deepcopy(model)
    scaler, ref_scaler = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 12) for _ in range(2))
    losses = _train(compile_fxopt(model, precision="fp16"), model, idx, steps=2, scaler=scaler)
    ref_losses = _train(_autocast(ref_model, torch.float16), ref_model, idx, steps=2, scaler=ref_scaler)
    assert losses == pytest.approx(ref_losses, rel=0.01)
    assert scaler.get_scale() == ref_scaler.get_scale() == 2.0 ** 12  # no step was skipped for inf/NaN
    assert all(p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all() for p in model.parameters())
    for p, p0 in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, p0, rtol=0, atol=0.03)  # both moved by 2 AdamW steps of lr 1e-2


def test_inference_caches_parameter_casts():
    """Under no_grad the parameters' fp16 copies are made once and reused; an in-place change to a
    parameter (its version counter moves) makes its copy again."""
    model, (idx,) = make(GPTConfig(vocab_size=128, block_size=16, n_layer=1, n_head=2, n_embd=32), batch=2, seq=8)
    compiled = compile_fxopt(model.eval(), precision="fp16")
    with torch.no_grad():
        first = compiled(idx)
        torch.testing.assert_close(first, _autocast(model, torch.float16)(idx).float(), rtol=1e-2, atol=1e-2)
        model.lm_head.weight.mul_(2.0)  # tied to wte: the embedding and the head both change
        second = compiled(idx)
        torch.testing.assert_close(second, _autocast(model, torch.float16)(idx).float(), rtol=1e-2, atol=1e-2)
    assert not torch.allclose(first, second)
    with torch.no_grad():
        rep = fxopt.explain(model, idx, precision="fp16")
    assert sum("cached until the parameter changes" in c.reason for c in rep.casts) == 4 * 2 + 1


def test_cached_cast_is_made_again_only_when_the_parameter_changes():
    param = nn.Parameter(torch.randn(4, 4))
    cache = CachedCast(index=0, dtype=torch.bfloat16)
    copy_ = cache.get(param)
    assert cache.get(param) is copy_ and copy_.dtype == torch.bfloat16
    with torch.no_grad():
        param.add_(1.0)
    assert cache.get(param) is not copy_
    torch.testing.assert_close(cache.get(param), param.detach().to(torch.bfloat16), rtol=0, atol=0)
    param.data = torch.zeros(4, 4)  # swapped storage: the pointer moves even where the version would not
    assert torch.equal(cache.get(param), torch.zeros(4, 4, dtype=torch.bfloat16))


def test_cached_casts_keep_the_inference_graph_static_under_default_dynamic():
    """torch.compile's default (dynamic=None) gives inputs dynamo has not seen symbolic sizes: the lifted
    parameter casts must enter aot_autograd with their static fake values, or the whole inference graph
    is symbolic and runs unfused."""
    from fxopt.backend import compile_dynamo_graph
    model, (idx,) = make(GPTConfig(vocab_size=128, block_size=16, n_layer=1, n_head=2, n_embd=32), batch=2, seq=8)
    rep, opts = fxopt.Report(), fxopt.Options(precision="fp16")  # fp16: the interpreter's bf16 tl.dot is wrong
    compiled = torch.compile(model.eval(), backend=lambda gm, inputs: compile_dynamo_graph(gm, inputs, opts, rep))
    with torch.no_grad():
        out = compiled(idx)
        ref = _autocast(model, torch.float16)(idx).float()
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
    assert [g.name for g in rep.graphs] == ["inference"]
    assert not rep.graphs[0].notes, rep.graphs[0].notes  # no "symbolic (dynamic) shapes" fallback
    assert rep.kernels and any("cached until the parameter changes" in c.reason for c in rep.casts)
