"""Graphs in unusual company (the backward sweep of 2026-12-05, the autograd sweep of 2026-12-06): run
under vmap (batched gradients, vectorized Jacobians), under forward-mode AD, and with complex
scalars (torch.polar's backward multiplies by 1j).
Each against eager in float64."""
from __future__ import annotations

import torch

from helpers import compile_fxopt


def test_a_compiled_backward_under_vmap_runs_as_aten():
    """autograd.grad(is_grads_batched=True) hands the backward batched tensors, which Triton's launcher
    cannot read (it raised "Cannot access storage of BatchedTensorImpl")."""
    fn = lambda x: (x.exp() * 2).sin()  # noqa: E731
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    y = compile_fxopt(fn)(x)
    eye = torch.eye(12, dtype=torch.float64).view(12, 3, 4)
    got, = torch.autograd.grad(y, x, eye, is_grads_batched=True)
    expected, = torch.autograd.grad(fn(x), x, eye, is_grads_batched=True)
    torch.testing.assert_close(got, expected)
    jac = torch.autograd.functional.jacobian(compile_fxopt(fn), x, vectorize=True)
    torch.testing.assert_close(jac, torch.autograd.functional.jacobian(fn, x, vectorize=True))
    y = compile_fxopt(fn)(x)  # and an ordinary backward afterwards still runs the kernels
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.autograd.grad(fn(x).sum(), x)[0])


def test_batched_gradients_of_the_first_of_two_outputs():
    """The batched tangent is not the last input when only the first output gets one (it was checked
    there only: "Cannot access storage of BatchedTensorImpl")."""
    def fn(x):
        h = x.sin()
        return h.exp() * 2, h.tanh() + x

    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 4, 5, dtype=torch.float64)
    got, = torch.autograd.grad(compile_fxopt(fn)(x)[0], x, g, is_grads_batched=True)
    expected, = torch.autograd.grad(fn(x)[0], x, g, is_grads_batched=True)
    torch.testing.assert_close(got, expected)


def test_forward_mode_ad_keeps_its_tangent():
    """Dual tensors through a compiled inference graph: a kernel's result carries no tangent, so under a
    forward-AD level the graph runs as ATen ops (the tangent came back None)."""
    import torch.autograd.forward_ad as fwad
    fn = lambda x: (x.sin() * 2).exp().sum(-1)  # noqa: E731
    x, v = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    compiled = compile_fxopt(fn)
    with fwad.dual_level():
        primal, tangent = fwad.unpack_dual(compiled(fwad.make_dual(x, v)))
    _, expected = torch.func.jvp(fn, (x,), (v,))
    torch.testing.assert_close(primal, fn(x))
    assert tangent is not None
    torch.testing.assert_close(tangent, expected)
    torch.testing.assert_close(compiled(x), fn(x))  # outside the level the kernels run again


def _attention_then_loss(q, k, v, w, t):
    """Hand-written causal attention (fxopt::flash_attention) feeding an LM head and its loss
    (fxopt::linear_cross_entropy), and a second loss on plain logits (fxopt::cross_entropy)."""
    import math
    import torch.nn.functional as F
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    h = (torch.softmax(s, -1) @ v).reshape(-1, q.shape[-1])
    return F.cross_entropy(h @ w.t(), t) + F.cross_entropy(h.tanh() * 3, t % q.shape[-1])


def test_forward_mode_ad_through_fxopts_own_ops():
    """fxopt's own ops (attention, the losses) have no forward-AD rule, so the tangent came back None
    under a dual level; their torch-op references now run there (torch_references.py)."""
    import torch.autograd.forward_ad as fwad
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
    w, t = torch.randn(40, 16, generator=g), torch.randint(0, 40, (16,), generator=g)
    dq = torch.randn(q.shape, generator=g)
    compiled = compile_fxopt(_attention_then_loss)
    with fwad.dual_level():
        primal, tangent = fwad.unpack_dual(compiled(fwad.make_dual(q, dq), k, v, w, t))
    args64 = [x.double() if x.is_floating_point() else x for x in (q, k, v, w, t)]
    ref, expected = torch.func.jvp(lambda q: _attention_then_loss(q, *args64[1:]), (args64[0],), (dq.double(),))
    torch.testing.assert_close(primal.double(), ref, rtol=1e-5, atol=1e-5)
    assert tangent is not None
    torch.testing.assert_close(tangent.double(), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(compiled(q, k, v, w, t).double(), ref, rtol=1e-5, atol=1e-5)
    import fxopt
    rep = fxopt.explain(_attention_then_loss, q, k, v, w, t)  # the three own ops are in the graph
    fused = {p.name: p.stats.get("fused") for p in rep.pre_autograd}
    assert [s.fused for s in rep.attention] == [True]
    assert fused["fuse_linear_cross_entropy"] == 1 and fused["fuse_cross_entropy"] == 1, fused


def test_complex_scalars_in_a_graph():
    """A complex scalar argument of an ATen call (complex ops stay ATen) is written into the wrapper."""
    x = torch.randn(3, 4, 2, dtype=torch.float64)
    f = lambda t: torch.view_as_real(torch.view_as_complex(t) * (1 + 2j))  # noqa: E731
    torch.testing.assert_close(compile_fxopt(f)(x), f(x))
    g = lambda t, fr: torch.view_as_real(torch.view_as_complex(t) * torch.polar(torch.ones_like(fr), fr))  # noqa: E731
    a, fa = x.clone().requires_grad_(), torch.randn(4, dtype=torch.float64, requires_grad=True)
    b, fb = a.detach().clone().requires_grad_(), fa.detach().clone().requires_grad_()
    compile_fxopt(g)(a, fa).square().sum().backward()
    g(b, fb).square().sum().backward()
    torch.testing.assert_close(a.grad, b.grad)
    torch.testing.assert_close(fa.grad, fb.grad)


def test_a_torch_func_transform_inside_the_graph_keeps_the_losses_and_attention_unfused():
    """torch.compile(torch.func.grad(f)): dynamo captures the transform in the graph, and fxopt's own
    ops have no functorch rules (the fused cross-entropy raised "must override the setup_context
    staticmethod"); the passes that make them leave such a graph as written."""
    import torch.nn.functional as F

    def loss(h, w, t):
        return F.cross_entropy(h @ w.t(), t)

    def attention(q, k, v):
        return torch.softmax((q @ k.transpose(-1, -2)) / 4.0, -1).matmul(v).sum()

    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(12, 16, generator=g), torch.randn(37, 16, generator=g)
    t = torch.randint(0, 37, (12,), generator=g)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
    for fn, args, argnums in ((loss, (h, w, t), 1), (attention, (q, k, v), 0)):
        torch._dynamo.reset()
        got = compile_fxopt(torch.func.grad(fn, argnums=argnums))(*args)
        want = torch.func.grad(fn, argnums=argnums)(*(a.double() if a.is_floating_point() else a for a in args))
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


def test_reference_graph_widens_fp32_output_matmuls():
    """On CUDA, matmul_casts folds a bf16 mm and its fp32 cast into aten.mm.dtype, which has no forward-AD
    formula; the graph forward AD runs (torch_references.reference_graph) multiplies the widened operands."""
    import torch.fx as fx
    from fxopt import torch_references
    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    graph.output(graph.call_function(torch.ops.aten.mm.dtype, (a, b, torch.float32)))
    ref = torch_references.reference_graph(fx.GraphModule(torch.nn.Module(), graph))
    assert ref is not None
    x, y = torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(4, 2, dtype=torch.bfloat16)
    out = ref(x, y)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, x.double().mm(y.double()).float(), rtol=1e-6, atol=1e-6)
