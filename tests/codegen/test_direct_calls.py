"""Wrappers call fxopt's own ops through their plain implementations (codegen/direct_calls.py), not the
dispatcher: every op in the fxopt namespace needs one, and the results stay those of the op."""
import torch
import torch.nn.functional as F

import fxopt
import fxopt.attention.op  # noqa: F401  (registers the attention ops)
import fxopt.losses.cross_entropy_op  # noqa: F401  (registers the loss ops)
from fxopt.codegen import direct_calls
from helpers import compile_fxopt


def _fxopt_ops() -> list[str]:
    return [name for name in dir(torch.ops.fxopt) if isinstance(getattr(torch.ops.fxopt, name), torch._ops.OpOverloadPacket)]


def test_every_fxopt_op_has_a_direct_implementation():
    ops = _fxopt_ops()
    assert {"flash_attention", "flash_attention_backward", "cross_entropy", "cross_entropy_backward"} <= set(ops)
    missing = [name for name in ops if not callable(getattr(direct_calls, name, None))]
    assert not missing, f"ops without a direct call for wrappers: {missing}"


def test_direct_call_gives_the_op_result():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    got = direct_calls.flash_attention(q, k, v, None, 0.25, True)
    want = torch.ops.fxopt.flash_attention(q, k, v, None, 0.25, True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def _attention_and_loss(q, k, v, target):
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.cross_entropy(y.reshape(-1, y.shape[-1]), target)


def test_wrappers_call_the_direct_implementations_forward_and_backward():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
    target = torch.randint(0, 16, (16,))
    rep = fxopt.explain(_attention_and_loss, q, k, v, target)
    sources = {g.name: g.wrapper_source for g in rep.graphs}
    assert "fxopt_ops.flash_attention(" in sources["forward"] and "fxopt_ops.cross_entropy(" in sources["forward"]
    assert "fxopt_ops.flash_attention_backward(" in sources["backward"]
    assert "torch.ops.fxopt" not in sources["forward"] + sources["backward"]
    torch._dynamo.reset()
    loss = compile_fxopt(_attention_and_loss)(q, k, v, target)
    grads = torch.autograd.grad(loss, (q, k, v))
    ref = _attention_and_loss(q, k, v, target)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, torch.autograd.grad(ref, (q, k, v))):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
