"""Inference attention makes no log-sum-exp: a forward whose graph never reads it (no backward to save
it for) calls flash_attention_out_only, whose kernels neither allocate nor store the statistics.
Interpreter on CPU (the TMA kernel through the interpreter's descriptor emulation)."""
import torch
import torch.nn.functional as F

from fxopt.attention.flash_decode import flash_decode
from fxopt.attention.flash_forward import flash_forward
from helpers import CountingBackend
from .test_dynamic_attention import SelfAttention
from .test_flash_decode import make_qkv as decode_qkv
from .test_flash_forward_tma import TMA
from .test_flash_kernels import make_qkv


def test_forward_kernels_without_lse_give_the_same_out():
    q, k, v = make_qkv(2, 4, 2, 40, 56, 32, torch.float16, transposed=True, seed=7)
    for config in (None, TMA):  # the pointer kernel, then the TMA one
        out, lse = flash_forward(q, k, v, scale=0.2, causal=True, config=config)
        alone, none = flash_forward(q, k, v, scale=0.2, causal=True, config=config, lse=False)
        assert none is None and lse is not None and torch.equal(out, alone)


def test_decode_without_lse_gives_the_same_out():
    q, k, v = decode_qkv(1, 8, 2, 3, 300, 32, torch.float32, seed=8)
    for splits in (1, 4):  # out stored by the split kernel itself, then by the combine kernel
        out, lse = flash_decode(q, k, v, scale=0.25, causal=True, num_splits=splits, config={"BLOCK_N": 16})
        alone, none = flash_decode(q, k, v, scale=0.25, causal=True, num_splits=splits, config={"BLOCK_N": 16},
                                   lse=False)
        assert none is None and lse is not None and torch.equal(out, alone)


def _compiled(grad: bool):
    torch.manual_seed(0)
    model, backend = SelfAttention(), CountingBackend()
    x = torch.randn(2, 12, 32, requires_grad=grad)
    out = torch.compile(model, backend=backend)(x)
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)
    return backend, out, x, model


def test_inference_graph_calls_attention_without_lse():
    with torch.no_grad():
        backend, *_ = _compiled(grad=False)
    wrapper = backend.report.graphs[0].wrapper_source
    assert "fxopt_ops.flash_attention_out_only(" in wrapper and "fxopt_ops.flash_attention(" not in wrapper


def test_training_graph_keeps_lse_for_the_backward():
    backend, out, x, model = _compiled(grad=True)
    wrappers = {g.name: g.wrapper_source for g in backend.report.graphs}
    assert "fxopt_ops.flash_attention(" in wrappers["forward"] and "_out_only" not in wrappers["forward"]
    go = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, x, go)[0], torch.autograd.grad(model(x), x, go)[0],
                               rtol=1e-4, atol=1e-4)


def test_sdpa_call_in_inference_matches_eager():
    q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))
    fn = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), backend="fxopt")
    torch.testing.assert_close(fn(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True),
                               rtol=1e-4, atol=1e-5)
