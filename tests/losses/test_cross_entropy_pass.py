"""fxopt's cross-entropy pass through torch.compile: what fuses (the forward graph holds
fxopt.cross_entropy and no log_softmax, no float32 copy of bf16 logits, no cast of the loss), every
spelling that must fuse against float64, and what stays unfused and exact. The kernels themselves
are tested in test_cross_entropy.py; on the CPU they run in the Triton interpreter."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxopt
import fxopt.pipeline
from fxopt.options import Environment, Options
from fxopt.pass_manager import PassContext
from fxopt.passes.attention import FuseAttention
from fxopt.passes.cross_entropy import FuseCrossEntropy
from tests.helpers import compile_fxopt
from tests.losses.test_cross_entropy import GRAD_TOL, IGNORE, LOSS_TOL, make_logits, make_target

# ------------------------------------------------------------------ the pass, through torch.compile

@pytest.fixture
def with_loss_pass(monkeypatch):
    """The pipeline as the lead will wire it: attention, then cross-entropy, before autograd."""
    monkeypatch.setattr(fxopt.pipeline, "pre_autograd_passes",
                        lambda options: [FuseAttention(), FuseCrossEntropy()])


class LMHead(nn.Module):
    """A tiny language-model head: hidden states -> vocabulary logits -> the token loss."""

    def __init__(self, d=16, vocab=300, spelling="flat"):
        super().__init__()
        self.proj = nn.Linear(d, vocab)
        self.spelling = spelling

    def forward(self, h, target):
        logits = self.proj(h)  # [B, T, V]
        if self.spelling == "flat":
            return F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1))
        return F.cross_entropy(logits.transpose(1, 2), target, reduction="sum")  # [B, V, T]: classes in dim 1


def lm_inputs(b=2, t=5, d=16, vocab=300):
    g = torch.Generator().manual_seed(3)
    target = torch.randint(0, vocab, (b, t), generator=g)
    target[0, 2] = target[1, 4] = IGNORE  # padding
    return torch.randn(b, t, d, generator=g), target


def grads_of(model, h, target, run):
    model.zero_grad()
    h = h.clone().requires_grad_()
    loss = run(h, target)
    loss.backward()
    return loss.detach(), h.grad, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("spelling", ["flat", "transposed"])
def test_lm_head_forward_backward_equals_eager(with_loss_pass, spelling, device):
    torch.manual_seed(0)
    model = LMHead(spelling=spelling).to(device)
    h, target = (t.to(device) for t in lm_inputs())
    compiled = grads_of(model, h, target, compile_fxopt(model))
    eager = grads_of(model, h, target, model)
    for got, want in zip([compiled[0], compiled[1], *compiled[2]], [eager[0], eager[1], *eager[2]]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def graph_targets(rep, graph):
    return {str(n.target) for n in rep.graph(after="captured", graph=graph).graph.nodes if n.op == "call_function"}


def test_forward_graph_holds_the_fused_op_and_no_log_softmax(with_loss_pass):
    torch.manual_seed(0)
    model = LMHead()
    h, target = lm_inputs()
    rep = fxopt.explain(model, h.requires_grad_(), target)
    forward, backward = graph_targets(rep, "forward"), graph_targets(rep, "backward")
    assert "fxopt.cross_entropy.default" in forward
    assert "fxopt.cross_entropy_backward.default" in backward
    assert not any("log_softmax" in t or "nll_loss" in t for t in forward | backward), forward | backward
    [record] = [p for p in rep.pre_autograd if p.name == "fuse_cross_entropy"]
    assert record.stats["fused"] == 1
    assert any(row.name.startswith("cross_entropy") and row.flops > 0 for row in rep.roofline)


def test_bf16_logits_get_no_float32_copy_of_vocabulary_size(with_loss_pass):
    """`logits.float()` before the loss (as many HF models write it): neither compiled graph holds a
    float32 [N, V] value; the kernels read the bf16 logits and write a bf16 gradient."""
    logits = make_logits(6, 130, torch.bfloat16).requires_grad_()
    target = make_target(6, 130, ignored=(0,))
    rep = fxopt.explain(ce_of_float_upcast, logits, target)
    for graph in ("forward", "backward"):
        for node in rep.graph(after="captured", graph=graph).graph.nodes:
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and tuple(val.shape) == (6, 130):
                assert val.dtype == torch.bfloat16, (graph, node.format_node())


def test_bf16_loss_comes_out_of_the_op_with_no_cast_in_either_graph(with_loss_pass):
    """F.cross_entropy of bf16 logits returns bf16: the op stores it so, and neither graph holds a cast
    of the loss or of its gradient (each would be a kernel and a tensor of its own)."""
    logits = make_logits(6, 130, torch.bfloat16).requires_grad_()
    target = make_target(6, 130, ignored=(0,))
    rep = fxopt.explain(nll_of_log_softmax, logits, target)
    targets = graph_targets(rep, "forward") | graph_targets(rep, "backward")
    assert "fxopt.cross_entropy.default" in targets
    assert not any("_to_copy" in t or "convert_element_type" in t for t in targets), targets
    out = compile_fxopt(nll_of_log_softmax)(logits, target)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), F.cross_entropy(logits.double(), target), rtol=1e-2, atol=1e-2)


# spellings that must fuse: (function, logits dtype)
def ce_module(x, t):
    return nn.CrossEntropyLoss(ignore_index=IGNORE)(x, t)


def nll_of_log_softmax(x, t):
    return F.nll_loss(F.log_softmax(x, dim=-1), t)


def nll_of_method_log_softmax_viewed(x, t):
    return F.nll_loss(x.view(2, 3, -1).log_softmax(-1).view(-1, x.size(-1)), t, reduction="sum")


def nll_of_torch_log_softmax_upcast(x, t):
    return F.nll_loss(torch.log_softmax(x, 1, dtype=torch.float32), t, reduction="none")


def ce_of_float_upcast(x, t):
    return F.cross_entropy(x.float(), t)


def ce_of_upcast_viewed(x, t):
    return F.cross_entropy(x.view(2, 3, -1).float().view(-1, x.size(-1)), t, reduction="none")


def ce_sum_then_scaled(x, t):
    return F.cross_entropy(x, t, reduction="sum", ignore_index=IGNORE) * 0.5


def ce_keywords(x, t):
    return F.cross_entropy(input=x, target=t)  # match_loss once read args[0] only: an IndexError


def nll_of_log_softmax_keywords(x, t):
    return F.nll_loss(input=torch.log_softmax(input=x, dim=1), target=t)


FUSING = [(ce_module, torch.float32), (ce_keywords, torch.float32), (nll_of_log_softmax_keywords, torch.float32),
          (nll_of_log_softmax, torch.float32), (nll_of_method_log_softmax_viewed, torch.float32), (nll_of_torch_log_softmax_upcast, torch.bfloat16),
          (ce_of_float_upcast, torch.bfloat16), (ce_of_upcast_viewed, torch.bfloat16),
          (ce_sum_then_scaled, torch.float16)]


def fused_count(fn, *inputs) -> int:
    rep = fxopt.explain(fn, *inputs)
    return sum(p.stats.get("fused", 0) for p in rep.pre_autograd if p.name == "fuse_cross_entropy")


@pytest.mark.parametrize("fn,dtype", FUSING, ids=[f.__name__ for f, _ in FUSING])
def test_spellings_fuse_and_match_float64(with_loss_pass, fn, dtype):
    logits = make_logits(6, 130, dtype).requires_grad_()
    target = make_target(6, 130, ignored=(3,))
    assert fused_count(fn, logits, target) == 1
    torch._dynamo.reset()
    out = compile_fxopt(fn)(logits, target)
    (grad,) = torch.autograd.grad(out.sum(), logits)
    x64 = logits.detach().double().requires_grad_()
    ref = fn(x64, target)
    (ref_grad,) = torch.autograd.grad(ref.sum(), x64)
    assert out.dtype == fn(logits.detach(), target).dtype  # the loss comes back in eager's dtype
    loss_tol = LOSS_TOL if out.dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)  # rounded to 16 bits
    # (log_softmax(dtype=float32) keeps the float64 reference in float32: compare values, not dtypes)
    torch.testing.assert_close(out.double(), ref.double(), **loss_tol)
    torch.testing.assert_close(grad.double(), ref_grad.double(), **GRAD_TOL[dtype])


# variants that must stay as they are: (function, the reason's key words)
def ce_weighted(x, t):
    return F.cross_entropy(x, t, weight=torch.linspace(0.5, 1.5, x.size(-1)))


def ce_smoothed(x, t):
    return F.cross_entropy(x, t, label_smoothing=0.1)


def ce_probability_targets(x, t):
    return F.cross_entropy(x, F.one_hot(t.clamp(min=0), x.size(-1)).float())


def nll_with_shared_log_probs(x, t):
    logp = F.log_softmax(x, dim=-1)
    return F.nll_loss(logp, t) + logp.mean()


def ce_classes_strided(x, t):
    # [N, C, d] contiguous: the classes (dim 1) are strided; flattening them last would copy the logits
    return F.cross_entropy(x.view(2, 3, -1).transpose(1, 2).contiguous(), t.view(2, 3))


UNFUSED = [(ce_weighted, "class weights"), (ce_smoothed, "label_smoothing"),
           (ce_probability_targets, "probability"), (nll_with_shared_log_probs, "used outside the loss"),
           (ce_classes_strided, "would copy")]


def captured_graph(fn, *inputs):
    """Dynamo's torch-level graph of fn, as the pre-autograd passes receive it."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm

    torch.compile(fn, backend=record, dynamic=False)(*inputs)
    return graphs[0]


@pytest.mark.parametrize("fn,why", UNFUSED, ids=[f.__name__ for f, _ in UNFUSED])
def test_unsupported_variants_stay_unfused_and_exact(with_loss_pass, fn, why):
    logits = make_logits(6, 130, torch.float32).requires_grad_()
    target = make_target(6, 130, ignored=(3,)) if fn is not ce_probability_targets else make_target(6, 130)
    gm, example_inputs = captured_graph(fn, logits, target)
    ctx = PassContext(options=Options(), env=Environment.read(), graph_name="torch",
                      example_inputs=list(example_inputs))
    result = FuseCrossEntropy()(gm, ctx)
    assert result.stats == {"fused": 0, "unfused": 1}
    assert len(ctx.notes) == 1 and why in ctx.notes[0][1], ctx.notes
    torch._dynamo.reset()
    out = compile_fxopt(fn)(logits, target)
    torch.testing.assert_close(out, fn(logits, target), rtol=1e-6, atol=1e-6)


