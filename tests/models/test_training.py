"""End-to-end training through torch.compile(model, backend="fxopt") (issue 7: training coverage).

The models are in `hf_gpt2.py` and `hf_llama.py`: small GPT-2 and Llama copies written the way Hugging Face transformers
writes them (no downloads), whose forward returns the loss, so embeddings, blocks, the (tied) head and
the cross-entropy are one compiled graph and its backward. fp32 throughout: on CPU the generated Triton
kernels run in the interpreter (conftest sets TRITON_INTERPRET=1), whose bf16 tl.dot is wrong. Sizes
are tiny (2 layers, head dim 16 so that attention fuses, seq 16, batch 2).

What each test proves:
- test_gpt2_adamw_loss_curve_matches_eager: a whole GPT-2 training step (Conv1D, bool tril buffer +
  torch.where(finfo.min), / torch.full([], sqrt(d)), tanh GELU, LayerNorm, tied lm_head, HF's
  ForCausalLMLoss with -100 labels) compiled with fused attention and fused cross-entropy follows
  eager's loss over 5 AdamW steps, and the parameters end up where eager's do.
- test_llama_sgd_loss_curve_matches_eager: Llama (hand-written RMSNorm, RoPE, GQA via repeat_kv, a 4-D
  additive mask from attention_mask, SiLU-gated MLP, untied head) follows eager over 5 SGD+momentum steps.
- test_llama_padding_mask_is_applied: HF Llama writes the padding into a clone of its constant causal
  mask in place; the mask is read by the kernel, not taken for a constant causal one (a bug this test
  found: compile-time evaluation ignored the in-place write).
- test_dropout_*: seeded dropout repeats under compile; training-mode attention dropout stays unfused
  and says why; compiled and eager draw the same masks from the same seed.
- test_checkpointed_blocks_grads_match_eager: torch.utils.checkpoint (use_reentrant=False) around each
  block compiles, and its gradients equal eager's; with dropout inside the regions the recomputation
  replays the same masks. Attention inside a checkpoint region is fused and recomputed in the backward
  (test_checkpointed_attention_is_matched_and_recomputed).
- test_grads_match_float64_reference: every parameter's gradient after one step is as close to a float64
  eager copy as eager fp32's own gradient is.
"""
from __future__ import annotations

import copy
import math
import os
import sys

import pytest
import torch

import fxopt

sys.path.insert(0, os.path.dirname(__file__))
from hf_gpt2 import GPT2Config, GPT2LMHeadModel  # noqa: E402
from hf_llama import LlamaConfig, LlamaForCausalLM  # noqa: E402

BATCH, SEQ, STEPS = 2, 16, 5


def gpt2_batch(config: GPT2Config, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # prompt tokens without loss, as HF data collators mark them
    labels[1, -2:] = -100
    return ids, labels


def llama_batch(config: LlamaConfig, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=g)
    attention_mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    labels = ids.clone()
    labels[1, :3] = -100
    return ids, attention_mask, labels


def train(fn, model, opt, batches):
    """One optimizer step per batch; the losses as Python floats."""
    losses = []
    for args in batches:
        opt.zero_grad(set_to_none=True)
        loss = fn(*args)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_losses_equal(got, ref, rtol=1e-5):
    assert ref[-1] < ref[0], f"training does not move: {ref}"  # the curves are not of constants
    for step, (g, r) in enumerate(zip(got, ref)):
        assert g == pytest.approx(r, rel=rtol), f"step {step}: fxopt {g} vs eager {r}\nfxopt {got}\neager {ref}"


# ----------------------------------------------------------------------------------- GPT-2 + AdamW


def test_gpt2_adamw_loss_curve_matches_eager():
    torch.manual_seed(0)
    config = GPT2Config()
    model = GPT2LMHeadModel(config).train()
    ref_model = copy.deepcopy(model)
    assert model.lm_head.weight is model.wte.weight and ref_model.lm_head.weight is ref_model.wte.weight
    batches = [gpt2_batch(config)] * STEPS  # one batch, learned over the steps: the loss falls

    # what fxopt does with it: both attention sites fused (causal read from the bool buffer, no mask
    # loaded), and the weight-tied LM head with its cross-entropy one fused op
    rep = fxopt.explain(copy.deepcopy(model), *batches[0])
    assert len(rep.attention) == config.n_layer, [str(s) for s in rep.attention]
    for site in rep.attention:
        assert site.fused, str(site)
        assert site.causal and site.scale == pytest.approx(1 / math.sqrt(config.n_embd // config.n_head))
    ce = [p for p in rep.pre_autograd if p.name == "fuse_linear_cross_entropy"]
    assert ce and ce[0].stats.get("fused", 0) == 1, [(p.name, p.stats) for p in rep.pre_autograd]
    assert {g.name for g in rep.graphs} == {"forward", "backward"}

    compiled = torch.compile(model, backend="fxopt")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = train(compiled, model, opt, batches)
    ref_losses = train(ref_model, ref_model, ref_opt, batches)
    assert_losses_equal(losses, ref_losses)
    assert model.lm_head.weight is model.wte.weight  # still tied after compiled steps

    # Parameters after 5 steps. AdamW divides by sqrt(v): a gradient that is zero in exact arithmetic
    # but rounding noise in practice (the key bias: softmax is invariant to adding a constant per query
    # row) gets steps of size ~lr whose signs follow the noise, so the key slice of c_attn.bias is only
    # checked to have moved no more than AdamW's step bound allows.
    ref_params = dict(ref_model.named_parameters())
    e = config.n_embd
    for name, p in model.named_parameters():
        ref = ref_params[name].detach()
        got = p.detach()
        if name.endswith("attn.c_attn.bias"):
            bound = STEPS * 3e-3 * 1.01
            assert (got[e:2 * e] - ref[e:2 * e]).abs().max() <= 2 * bound
            got = torch.cat([got[:e], got[2 * e:]])
            ref = torch.cat([ref[:e], ref[2 * e:]])
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=2e-5, msg=lambda m: f"{name}: {m}")


# ----------------------------------------------------------------------------------- Llama + SGD


def test_llama_sgd_loss_curve_matches_eager():
    torch.manual_seed(0)
    config = LlamaConfig()
    model = LlamaForCausalLM(config).train()
    ref_model = copy.deepcopy(model)
    assert model.lm_head.weight is not model.embed_tokens.weight
    batches = [llama_batch(config)] * STEPS

    rep = fxopt.explain(copy.deepcopy(model), *batches[0])
    assert len(rep.attention) == config.num_hidden_layers
    groups = config.num_attention_heads // config.num_key_value_heads
    for site in rep.attention:
        assert site.fused and site.kv_groups == groups, str(site)
    ce = [p for p in rep.pre_autograd if p.name == "fuse_cross_entropy"]
    assert ce and ce[0].stats.get("fused", 0) >= 1

    compiled = torch.compile(model, backend="fxopt")
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.5, momentum=0.9)
    losses = train(compiled, model, opt, batches)
    ref_losses = train(ref_model, ref_model, ref_opt, batches)
    assert_losses_equal(losses, ref_losses)
    ref_params = dict(ref_model.named_parameters())
    for name, p in model.named_parameters():  # SGD is linear in the gradients: no noise amplification
        torch.testing.assert_close(p.detach(), ref_params[name].detach(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")


def test_llama_padding_mask_is_applied():
    torch.manual_seed(0)
    config = LlamaConfig()
    model = LlamaForCausalLM(config)
    ids, attention_mask, labels = llama_batch(config)
    attention_mask[1, :3] = 0  # left padding in the second row
    ref = model(ids, attention_mask)
    out = torch.compile(model, backend="fxopt")(ids, attention_mask)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_llama_left_padding_gradients_equal_eager_when_the_loss_reads_the_padding_rows():
    """Padding rows are masked everywhere (finfo.min): their attention is the uniform average. A loss
    that does not skip them (labels = ids, no -100) sends them gradient, which every parameter's
    gradient then carries: those rows' backward must be eager's (it was off by about Tk)."""
    torch.manual_seed(0)
    config = LlamaConfig()
    ref_model = LlamaForCausalLM(config)
    model = copy.deepcopy(ref_model)
    ids, attention_mask, _ = llama_batch(config)
    attention_mask[1, :3] = 0  # left padding in the second row
    ref_model(ids, attention_mask, labels=ids).backward()
    torch.compile(model, backend="fxopt")(ids, attention_mask, labels=ids).backward()
    ref = grads_of(ref_model)
    for name, grad in grads_of(model).items():
        torch.testing.assert_close(grad, ref[name], rtol=1e-3, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_mask_mutated_in_place_by_input_is_not_a_constant():
    B, H, T, D = 2, 2, 8, 16
    min_value = torch.finfo(torch.float32).min

    def attn(q, k, v, attention_mask):
        mask = torch.full((T, T), min_value).triu(1)[None, None].expand(B, 1, T, T).clone()
        mask[:, :, :, :] = mask.masked_fill(attention_mask[:, None, None, :] == 0, min_value)
        s = q @ k.transpose(-2, -1) * D ** -0.5 + mask
        return torch.softmax(s, -1) @ v

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
    attention_mask = torch.ones(B, T, dtype=torch.long)
    attention_mask[1, :2] = 0
    torch.testing.assert_close(torch.compile(attn, backend="fxopt")(q, k, v, attention_mask),
                               attn(q, k, v, attention_mask), rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------- dropout


def dropout_config(**kw):
    return GPT2Config(embd_pdrop=0.1, attn_pdrop=0.1, resid_pdrop=0.1, **kw)


def loss_and_grads(fn, model, batch, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = fn(*batch)
    loss.backward()
    return loss.detach(), grads_of(model)


def test_dropout_attention_stays_unfused_and_says_why():
    torch.manual_seed(0)
    config = dropout_config()
    model = GPT2LMHeadModel(config).train()
    rep = fxopt.explain(model, *gpt2_batch(config))
    assert len(rep.attention) == config.n_layer
    for site in rep.attention:
        assert not site.fused and "dropout" in site.reason, str(site)
    # the LM head and its loss are still fused; the dropout masks are drawn by ATen (torch's generator)
    ce = [p for p in rep.pre_autograd if p.name == "fuse_linear_cross_entropy"]
    assert ce and ce[0].stats.get("fused", 0) >= 1
    # and in eval mode the same model's attention fuses (dropout does nothing there)
    torch._dynamo.reset()
    rep = fxopt.explain(model.eval(), *gpt2_batch(config))
    assert all(site.fused for site in rep.attention), [str(s) for s in rep.attention]


def test_dropout_seeded_runs_repeat_and_match_eager():
    """Dropout p=0.1 on embeddings, attention probabilities and residuals, in training mode.

    Compiled runs with the same torch.manual_seed give bit-identical losses and gradients (dropout is
    left to ATen and draws from torch's global generator). The RNG streams of compiled and eager are the
    same too: the compiled graph draws the same masks in the same order as eager (checked: the losses
    with the same seed agree to fp32 rounding, while another seed gives a clearly different loss), so
    compiled is compared with eager directly, not statistically.
    """
    torch.manual_seed(0)
    config = dropout_config()
    model = GPT2LMHeadModel(config).train()
    batch = gpt2_batch(config)
    compiled = torch.compile(model, backend="fxopt")

    loss1, grads1 = loss_and_grads(compiled, model, batch, seed=123)
    loss2, grads2 = loss_and_grads(compiled, model, batch, seed=123)
    assert torch.isfinite(loss1) and all(torch.isfinite(g).all() for g in grads1.values())
    assert torch.equal(loss1, loss2)
    for name in grads1:
        assert torch.equal(grads1[name], grads2[name]), name

    loss_other, _ = loss_and_grads(compiled, model, batch, seed=321)
    assert abs(loss_other.item() - loss1.item()) > 1e-4  # dropout really is on

    ref_loss, ref_grads = loss_and_grads(model, model, batch, seed=123)
    assert loss1.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads1[name], ref, rtol=1e-4, atol=1e-6, msg=lambda m: f"grad of {name}: {m}")


def test_dropout_training_loss_curve_matches_eager():
    """A few AdamW steps with dropout on, each step seeded alike: the curves agree (same RNG stream)."""
    torch.manual_seed(0)
    config = dropout_config()
    model = GPT2LMHeadModel(config).train()
    ref_model = copy.deepcopy(model)
    batches = [gpt2_batch(config)] * 3
    compiled = torch.compile(model, backend="fxopt")
    curves = []
    for fn, m in [(compiled, model), (ref_model, ref_model)]:
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        torch.manual_seed(7)  # one stream for the whole run: the steps draw one after another
        curves.append(train(fn, m, opt, batches))
    assert all(math.isfinite(x) for x in curves[0])
    for step, (g, r) in enumerate(zip(*curves)):
        assert g == pytest.approx(r, rel=1e-5), f"step {step}: {curves}"


# ----------------------------------------------------------------------------------- checkpoint


def test_checkpointed_blocks_grads_match_eager():
    """checkpoint(block, x, use_reentrant=False) around each block: the backward recomputes each block;
    the compiled loss and gradients equal eager's (with and without checkpointing)."""
    torch.manual_seed(0)
    config = GPT2Config(gradient_checkpointing=True)
    model = GPT2LMHeadModel(config).train()
    ref_model = copy.deepcopy(model)
    plain = copy.deepcopy(model)
    plain.config = GPT2Config(gradient_checkpointing=False)
    batch = gpt2_batch(config)

    compiled = torch.compile(model, backend="fxopt")
    loss, grads = loss_and_grads(compiled, model, batch, seed=0)
    ref_loss, ref_grads = loss_and_grads(ref_model, ref_model, batch, seed=0)
    plain_loss, plain_grads = loss_and_grads(plain, plain, batch, seed=0)
    torch.testing.assert_close(ref_loss, plain_loss)  # checkpointing changes nothing in eager
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys() == plain_grads.keys()
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-6, msg=lambda m: f"grad of {name}: {m}")

    # a second step through the compiled checkpointed model (optimizer included) still follows eager
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    losses = train(compiled, model, opt, [batch, gpt2_batch(config, seed=5)])
    ref_losses = train(ref_model, ref_model, ref_opt, [batch, gpt2_batch(config, seed=5)])
    for g, r in zip(losses, ref_losses):
        assert g == pytest.approx(r, rel=1e-5)


def test_checkpointed_attention_is_matched_and_recomputed():
    """Attention inside torch.utils.checkpoint regions (dynamo's tag_activation_checkpoint bodies) is
    fused like attention outside; the backward recomputes the region, fused op included, instead of
    saving its activations (test_checkpointed_blocks_grads_match_eager checks the numbers)."""
    torch.manual_seed(0)
    config = GPT2Config(gradient_checkpointing=True)
    rep = fxopt.explain(GPT2LMHeadModel(config).train(), *gpt2_batch(config))
    assert {g.name for g in rep.graphs} == {"forward", "backward"}  # compiled by fxopt, with a backward
    ce = [p for p in rep.pre_autograd if p.name == "fuse_linear_cross_entropy"]
    assert ce and ce[0].stats.get("fused", 0) == 1  # the head and its loss, outside the regions, are fused
    assert len(rep.attention) == config.n_layer, [str(s) for s in rep.attention]
    assert all(site.fused and site.node.startswith("wrap_body_") for site in rep.attention)
    wrappers = {g.name: g.wrapper_source for g in rep.graphs}
    # the forward saves no log-sum-exp (the backward recomputes attention), so it does not make one
    assert wrappers["forward"].count("fxopt_ops.flash_attention_out_only(") == config.n_layer
    assert wrappers["backward"].count("fxopt_ops.flash_attention(") == config.n_layer  # recomputed, with lse
    assert wrappers["backward"].count("fxopt_ops.flash_attention_backward(") == config.n_layer


def test_checkpointed_dropout_recompute_is_consistent():
    """With dropout inside checkpointed blocks, the recomputation must replay the same masks: compiled
    gradients with checkpointing equal the compiled (and eager) gradients without it, same seed."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(dropout_config(gradient_checkpointing=True)).train()
    ref_model = copy.deepcopy(model)
    batch = gpt2_batch(model.config)
    compiled = torch.compile(model, backend="fxopt")
    loss, grads = loss_and_grads(compiled, model, batch, seed=11)
    ref_loss, ref_grads = loss_and_grads(ref_model, ref_model, batch, seed=11)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-6, msg=lambda m: f"grad of {name}: {m}")


# ----------------------------------------------------------------------------------- float64 reference


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_grads_match_float64_reference(arch):
    """Every parameter's gradient after one compiled step against a float64 eager copy of the model: the
    compiled fp32 error is within a small multiple of eager fp32's own error (plus an fp32-sized floor)."""
    torch.manual_seed(0)
    if arch == "gpt2":
        config = GPT2Config()
        model = GPT2LMHeadModel(config).train()
        batch = gpt2_batch(config)
    else:
        config = LlamaConfig()
        model = LlamaForCausalLM(config).train()
        batch = llama_batch(config)
    eager32 = copy.deepcopy(model)
    model64 = copy.deepcopy(model).double()

    loss, grads = loss_and_grads(torch.compile(model, backend="fxopt"), model, batch, seed=0)
    loss32, grads32 = loss_and_grads(eager32, eager32, batch, seed=0)
    loss64, grads64 = loss_and_grads(model64, model64, batch, seed=0)
    assert loss.item() == pytest.approx(loss64.item(), rel=1e-5)
    assert grads.keys() == grads64.keys()
    for name, ref in grads64.items():
        err = (grads[name].double() - ref).abs().max().item()
        err32 = (grads32[name].double() - ref).abs().max().item()
        scale = ref.abs().max().item()
        assert err <= 4 * err32 + 1e-6 * scale + 1e-9, (
            f"grad of {name}: fxopt error {err:.3g}, eager fp32 error {err32:.3g}, max |grad| {scale:.3g}")
        torch.testing.assert_close(grads[name].double(), ref, rtol=1e-4, atol=1e-6, msg=lambda m: f"grad of {name}: {m}")
