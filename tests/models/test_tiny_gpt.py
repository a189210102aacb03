"""End to end: the GPT of examples/tiny_gpt.py through torch.compile(model, backend="fxopt").

On CPU the generated Triton kernels run in the interpreter (conftest sets TRITON_INTERPRET=1), so the
shapes are tiny. Checks: logits, loss and every gradient equal eager; the report shows kernels in the
forward and the backward graph, each block's GPT-2 GELU chain is one kernel and no elementwise op is
left unfused; a few optimizer steps follow eager's losses.
"""
from __future__ import annotations

import copy
import os
import sys
import warnings
from collections import Counter

import pytest
import torch

import fxopt

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from tiny_gpt import GPTConfig, lm_loss, make  # noqa: E402

CONFIG = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32)
BATCH, SEQ = 2, 8

# GPT-2's gelu, 0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x**3))), as core ATen ops: the whole chain
GELU_OPS = Counter({"aten.mul.Tensor": 4, "aten.add.Tensor": 2, "aten.pow.Tensor_Scalar": 1,
                    "aten.tanh.default": 1})


@pytest.fixture
def gpt():
    return make(CONFIG, batch=BATCH, seq=SEQ)


def _step(fn, model, idx):
    model.zero_grad(set_to_none=True)
    logits = fn(idx)
    loss = lm_loss(logits, idx)
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_logits_loss_and_grads_match_eager(gpt):
    model, (idx,) = gpt
    ref_logits, ref_loss, ref_grads = _step(model, model, idx)
    compiled = torch.compile(model, backend="fxopt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits, loss, grads = _step(compiled, model, idx)
    # the Triton kernels really ran (in the interpreter), not the eager fallback for CPU tensors
    assert not [w for w in caught if "fused groups run as eager" in str(w.message)]
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    assert "lm_head.weight" not in grads  # tied to wte.weight: one parameter, one (summed) gradient
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-6, msg=lambda m: f"grad of {name}: {m}")


def test_report_structure(gpt):
    model, (idx,) = gpt
    rep = fxopt.explain(model, idx)
    graphs = {g.name: g for g in rep.graphs}
    assert set(graphs) == {"forward", "backward"}
    assert all(g.target == "interpret" for g in rep.graphs)
    forward, backward = graphs["forward"], graphs["backward"]
    assert any(k.kind == "pointwise" for k in forward.kernels)
    assert any(k.kind == "pointwise" for k in backward.kernels)

    # one kernel per block holds GPT-2's gelu, and it holds all of it (mul, pow, add, tanh: 8 ops)
    gelu = [k for k in forward.kernels if "aten.tanh.default" in k.ops and "aten.mul.Tensor" in k.ops]
    assert len(gelu) == CONFIG.n_layer, [k.ops for k in forward.kernels]
    for k in gelu:
        assert Counter(k.ops) == GELU_OPS, k.ops
    # the backward graph fuses the gelu derivative (tanh recomputed with it) per block, too
    assert sum("aten.tanh.default" in k.ops for k in backward.kernels) == CONFIG.n_layer

    # nothing elementwise is left to ATen: what is left is matmuls, reductions, creation ops, etc.
    for g in rep.graphs:
        unfused = [(node, why) for node, why in g.fallbacks if why == "not fused"]
        assert not unfused, f"{g.name} graph: elementwise nodes left unfused: {unfused}"
        assert not any(n.target is torch.ops.aten.tanh.default for n in g.snapshots["fuse"].graph.nodes)


def test_optimizer_steps_match_eager(gpt):
    model, (idx,) = gpt
    ref_model = copy.deepcopy(model)
    compiled = torch.compile(model, backend="fxopt")
    losses, ref_losses = [], []
    for fn, m, out in [(compiled, model, losses), (ref_model, ref_model, ref_losses)]:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01)
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss = lm_loss(fn(idx), idx)
            loss.backward()
            opt.step()
            out.append(loss.item())
    assert ref_losses[-1] < ref_losses[0]  # training moves: the comparison is not of constants
    for step, (got, ref) in enumerate(zip(losses, ref_losses)):
        assert got == pytest.approx(ref, rel=1e-4), f"step {step}: fxopt {got} vs eager {ref}"
    # (parameters are not compared elementwise: AdamW divides by sqrt(v), which blows rounding noise in
    # gradients that are zero in exact arithmetic, such as the key bias under softmax, up to lr-sized steps)
