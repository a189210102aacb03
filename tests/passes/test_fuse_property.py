"""Pointwise fusion, as a property: random elementwise programs compile to kernels that agree with the
same program evaluated eagerly in float64. Plus what must not fuse (matmul, an unfused reduction,
complex dtypes) and what must be absorbed (views and expands at a group's inputs).
"""
from __future__ import annotations

import operator

import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import fxopt
from helpers import TOL, assert_close_to_reference, compile_fxopt, to64

SHAPES = [(4, 6), (6,), (4, 1), ()]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CAP = 2.0  # largest |value| a program may produce: keeps bf16/fp16 rounding inside TOL (see _bounded)

# op -> (source template, bound of the result given the operands' bounds)
UNARY = {
    "neg": ("-{a}", lambda a: a),
    "abs": ("torch.abs({a})", lambda a: a),
    "tanh": ("torch.tanh({a})", lambda a: min(a, 1.0)),
    "sigmoid": ("torch.sigmoid({a})", lambda a: 1.0),
    "relu": ("torch.relu({a})", lambda a: a),
    "exp": ("torch.exp(torch.clamp({a}, -4.0, 0.5))", lambda a: 1.65),
    "half": ("{a} * 0.5", lambda a: a / 2),
    "add1": ("{a} + 1.0", lambda a: a + 1),
}
BINARY = {
    "add": ("{a} + {b}", lambda a, b: a + b),
    "sub": ("{a} - {b}", lambda a, b: a + b),
    "mul": ("{a} * {b}", lambda a, b: a * b),
    "maximum": ("torch.maximum({a}, {b})", lambda a, b: max(a, b)),
    # the condition reads an input, so it is exact in every dtype and never flips on a rounding error
    "where": ("torch.where({c} > 0, {a}, {b})", lambda a, b: max(a, b)),
}
ALLOWED_KERNEL_OPS = {"aten.neg.default", "aten.abs.default", "aten.tanh.default", "aten.sigmoid.default",
                      "aten.relu.default", "aten.exp.default", "aten.clamp.default", "aten.mul.Tensor",
                      "aten.add.Tensor", "aten.sub.Tensor", "aten.maximum.default", "aten.gt.Scalar",
                      "aten.where.self"}


def _bounded(expr: str, bound: float):
    """Values stay within CAP: a bigger result is squashed by tanh (still testing the op under it).
    Errors then stay far inside TOL for bf16, whose rounding is 2^-8 relative per stored value."""
    if bound > CAP:
        return f"torch.tanh({expr})", 1.0
    return expr, bound


@st.composite
def programs(draw):
    """(source of `def f(x0, ...)`, input shapes, dtype): random depth, fan-out, several outputs."""
    n_in = draw(st.integers(1, 3))
    shapes = [draw(st.sampled_from(SHAPES)) for _ in range(n_in)]
    if all(s in ((), (4, 1), (6,)) for s in shapes) and draw(st.booleans()):
        shapes[0] = (4, 6)
    names = [f"x{i}" for i in range(n_in)]
    vals = [(n, s, 1.0) for n, s in zip(names, shapes)]  # (name, shape, bound)
    lines, computed = [], []
    for k in range(draw(st.integers(1, 8))):
        a = draw(st.sampled_from(vals[::-1]))  # shrinks towards the latest value: deep chains
        if draw(st.booleans()):
            op = draw(st.sampled_from(sorted(UNARY)))
            template, bound_fn = UNARY[op]
            expr, bound = _bounded(template.format(a=a[0]), bound_fn(a[2]))
            shape = a[1]
        else:
            op = draw(st.sampled_from(sorted(BINARY)))
            b = draw(st.sampled_from(vals))
            template, bound_fn = BINARY[op]
            c = draw(st.sampled_from(names))
            shape = torch.broadcast_shapes(a[1], b[1], *([shapes[names.index(c)]] if op == "where" else []))
            expr, bound = _bounded(template.format(a=a[0], b=b[0], c=c), bound_fn(a[2], b[2]))
        name = f"v{k}"
        lines.append(f"    {name} = {expr}  # {tuple(shape)}")
        vals.append((name, tuple(shape), bound))
        computed.append(name)
    outs = [computed[-1]] + draw(st.lists(st.sampled_from(computed), max_size=2))
    outs = list(dict.fromkeys(outs))
    source = f"def f({', '.join(names)}):\n" + "\n".join(lines) + f"\n    return ({', '.join(outs)},)\n"
    return source, shapes, draw(st.sampled_from(DTYPES))


def _domain(node):
    val = node.meta["val"]
    return tuple((val[0] if isinstance(val, (tuple, list)) else val).shape)


def _assert_groups_are_maximal(gm):
    """Values of a smaller shape never depend on the full shape's values, so nothing can stand between
    two groups of one domain: a group feeding another group of the same shape is a missed fusion."""
    for group in (n for n in gm.graph.nodes if n.op == "call_module"):
        for arg in group.all_input_nodes:
            src = arg.args[0] if arg.op == "call_function" and arg.target is operator.getitem else arg
            assert not (src.op == "call_module" and _domain(src) == _domain(group)), gm.code


def _build(source: str):
    scope = {"torch": torch}
    exec(compile(source, "<fuse-property-program>", "exec"), scope)
    return scope["f"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prog=programs(), seed=st.integers(0, 2**16))
def test_random_pointwise_programs_match_float64(prog, seed):
    source, shapes, dtype = prog
    note(source)
    note(f"shapes={shapes} dtype={dtype}")
    fn = _build(source)
    g = torch.Generator().manual_seed(seed)
    inputs = [(torch.rand(s, generator=g, dtype=torch.float64) * 2 - 1).to(dtype) for s in shapes]

    torch._dynamo.reset()  # every example is a new program; dynamo's cache must not mix them
    rep = fxopt.explain(fn, *inputs)
    assert rep.fallbacks == [], rep.fallbacks
    kernels = [k for k in rep.kernels if k.graph in ("forward", "inference")]
    assert kernels and all(k.kind == "pointwise" for k in kernels)
    fused_ops = [op for k in kernels for op in k.ops]
    assert set(fused_ops) <= ALLOWED_KERNEL_OPS, fused_ops
    after_cleanup = rep.graph("cleanup")
    compute = [n for n in after_cleanup.graph.nodes if n.op == "call_function" and not n.target.is_view]
    assert len(fused_ops) == len(compute), "every op lands in exactly one kernel"
    _assert_groups_are_maximal(rep.graph("cleanup_after_fuse"))

    torch._dynamo.reset()
    out = compile_fxopt(fn)(*inputs)
    eager = fn(*inputs)
    for o, e in zip(out, eager):
        assert (o.dtype, o.shape) == (e.dtype, e.shape)
    assert_close_to_reference(out, fn(*[to64(t) for t in inputs]), dtype)


# ---- what must stay separate ------------------------------------------------------------------------------
def _kernels(rep):
    return [k for k in rep.kernels if k.graph in ("forward", "inference")]


def _check_numerics(fn, *inputs, dtype=torch.float32):
    torch._dynamo.reset()
    out = compile_fxopt(fn)(*inputs)
    assert_close_to_reference(out, fn(*[to64(t) for t in inputs]), dtype)


def test_matmul_between_chains_gives_two_kernels(device):
    def fn(x, w):
        a = torch.tanh(x) * 2
        return torch.sigmoid(a @ w) + 1

    x, w = torch.randn(4, 6, device=device), torch.randn(6, 5, device=device)
    rep = fxopt.explain(fn, x, w)
    assert [k.ops for k in _kernels(rep)] == [["aten.tanh.default", "aten.mul.Tensor"],
                                              ["aten.sigmoid.default", "aten.add.Tensor"]]
    reasons = dict(rep.fallbacks)
    assert set(reasons) == {"mm"} and "matmul" in reasons["mm"]
    _check_numerics(fn, x, w)


def test_unfused_reduction_between_chains_gives_two_kernels(device):
    """cumsum is a reduction-class op fxopt does not generate: the chains around it cannot share a
    kernel (the second reads the first's output both directly and through cumsum)."""
    def fn(x):
        a = torch.tanh(x) * 2
        return torch.sigmoid(torch.cumsum(a, dim=-1)) + a

    x = torch.randn(4, 6, device=device)
    rep = fxopt.explain(fn, x)
    kernels = _kernels(rep)
    assert len(kernels) == 2
    assert {"aten.tanh.default", "aten.mul.Tensor"} in [set(k.ops) for k in kernels]
    assert {"aten.sigmoid.default", "aten.add.Tensor"} in [set(k.ops) for k in kernels]
    reasons = dict(rep.fallbacks)
    assert set(reasons) == {"cumsum"} and "reduction" in reasons["cumsum"]
    _check_numerics(fn, x)


def test_complex_ops_fall_back_with_a_dtype_reason(device):
    def fn(x, z):
        a = torch.tanh(x) + 1
        w = z * z + 1
        return a, torch.view_as_real(w) * 2 + a.unsqueeze(-1)

    x, z = torch.randn(4, 6, device=device), torch.randn(4, 6, dtype=torch.complex64, device=device)
    rep = fxopt.explain(fn, x, z)
    assert len(rep.fallbacks) == 2
    assert all("complex64" in reason for _, reason in rep.fallbacks), rep.fallbacks
    fused = {op for k in _kernels(rep) for op in k.ops}
    assert len(_kernels(rep)) == 2 and "aten.tanh.default" in fused
    torch._dynamo.reset()
    out = compile_fxopt(fn)(x, z)
    ref = fn(x.double(), z.to(torch.complex128))
    for o, r in zip(out, ref):
        torch.testing.assert_close(o.double(), r, rtol=1e-5, atol=1e-5)


def test_complex_only_graph_has_no_kernels(device):
    fn = lambda z: z * z + 1  # noqa: E731
    z = torch.randn(4, 6, dtype=torch.complex64, device=device)
    rep = fxopt.explain(fn, z)
    assert _kernels(rep) == []
    assert [r for _, r in rep.fallbacks] == ["dtype torch.complex64 has no Triton lowering"] * 2
    torch._dynamo.reset()
    torch.testing.assert_close(compile_fxopt(fn)(z).to(torch.complex128), fn(z.to(torch.complex128)))


# ---- what must be absorbed ---------------------------------------------------------------------------------
def test_input_views_are_absorbed_into_the_kernel(device):
    """A transposed input plus a broadcast bias: one kernel reading both in place."""
    def fn(x, b):
        return torch.tanh(x.permute(1, 0) + b.unsqueeze(0).expand(4, 6)) * 2

    x, b = torch.randn(6, 4, device=device), torch.randn(6, device=device)
    rep = fxopt.explain(fn, x, b)
    kernels = _kernels(rep)
    assert len(kernels) == 1 and not rep.fallbacks
    assert kernels[0].ops == ["aten.add.Tensor", "aten.tanh.default", "aten.mul.Tensor"]
    fuse = next(p for p in rep.passes if p.name == "fuse")
    assert fuse.stats["views_absorbed"] == 3
    gm = rep.graph("cleanup_after_fuse")
    top = [n for n in gm.graph.nodes if n.op in ("call_function", "call_module")]
    assert [n.op for n in top] == ["call_module"], gm.code  # no permute/unsqueeze/expand left outside
    call = top[0]
    assert all(a.op == "placeholder" for a in call.args), "the kernel reads the inputs themselves"
    sub = gm.get_submodule(call.target)
    inside = {n.target for n in sub.graph.nodes if n.op == "call_function"}
    aten = torch.ops.aten
    assert {aten.permute.default, aten.unsqueeze.default, aten.expand.default} <= inside
    _check_numerics(fn, x, b)


def test_views_absorbed_with_low_precision_and_several_outputs(device):
    def fn(x, b):
        t = x.t()
        y = t * b[None, :]
        return torch.sigmoid(y), y - t

    x, b = torch.randn(6, 4, device=device, dtype=torch.bfloat16), torch.randn(6, device=device, dtype=torch.bfloat16)
    rep = fxopt.explain(fn, x, b)
    assert len(_kernels(rep)) == 1 and not rep.fallbacks
    gm = rep.graph("cleanup_after_fuse")
    assert not [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem], gm.code
    _check_numerics(fn, x, b, dtype=torch.bfloat16)


def test_tolerances_used_here_exist():
    assert all(d in TOL for d in DTYPES)
