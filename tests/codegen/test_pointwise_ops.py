"""Every pointwise op fxopt lowers, compiled through torch.compile(backend="fxopt") and checked against
the same function evaluated eagerly in float64.

Ops are grouped into families: each family's function shares one prologue op, so all its outputs land
in one fused group; the test asserts that exactly one pointwise kernel was generated and that every op
of the family is in it. Ops the core-ATen decomposition table removes before fxopt sees the graph are
compiled through the ATen-graph compiler that torch.compile calls (compile_aten_graph).

FXOPT_TEST_ROWS=1024 runs the families over 1024 rows instead of 3: on the GPU each thread then holds
several elements, where packed bf16x2 code runs (a bf16 `sign` was wrong only there, 2026-12-07).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import fxopt
from fxopt.analysis.op_classes import CUDA_ONLY_OPS, POINTWISE_OPS
from fxopt.backend import decomposition_table
from fxopt.codegen.pointwise_ops import LOWERINGS
from fxopt.compile import compile_aten_graph
from fxopt.options import Options
from fxopt.printing import target_name
from fxopt.report import Report
from helpers import TOL, assert_close_to_reference, compile_fxopt, to64

aten = torch.ops.aten
prims = torch.ops.prims
FLOATS = [torch.float32, torch.bfloat16, torch.float16]
SHAPE = (int(os.environ.get("FXOPT_TEST_ROWS", "3")), 37)


def ops(spec: str) -> list:
    """"add.Tensor exp prims.convert_element_type" -> [aten.add.Tensor, aten.exp.default, prims....default]"""
    out = []
    for name in spec.split():
        ns, name = (prims, name[len("prims."):]) if name.startswith("prims.") else (aten, name)
        op, _, overload = name.partition(".")
        out.append(getattr(getattr(ns, op), overload or "default"))
    return out


# ---- inputs -------------------------------------------------------------------------------------------
def uniform(shape, dtype, device, lo=-3.0, hi=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g, dtype=torch.float64) * (hi - lo) + lo).to(dtype).to(device)


def grid(shape, dtype, device, step=0.25, lim=2.0, seed=0):
    """Values on a coarse grid (exact in every float dtype): ties, half-integers and zeros are common."""
    return (torch.round(uniform(shape, torch.float64, "cpu", -lim, lim, seed) / step) * step).to(dtype).to(device)


def away_from_zero(shape, dtype, device, seed=0):
    sign = torch.where(uniform(shape, torch.float64, "cpu", seed=seed + 1) > 0, 1.0, -1.0)
    return (uniform(shape, torch.float64, "cpu", 0.5, 4.0, seed) * sign).to(dtype).to(device)


def with_specials(shape, dtype, device, seed=0):
    lim = 10.0 if dtype == torch.float16 else 60.0  # exp(60) fits bf16; tanh's exp(2x) overflows fp32 there
    x = uniform(shape, torch.float64, "cpu", -lim, lim, seed).flatten()
    x[::5], x[1::7], x[2::7], x[3::11], x[4::11] = float("nan"), float("inf"), float("-inf"), 0.0, 2.5
    return x.reshape(shape).to(dtype).to(device)


def ints(shape, dtype, device, lo=-6, hi=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, shape, generator=g).to(dtype).to(device)


# ---- the check -----------------------------------------------------------------------------------------
def fused_kernels(rep):
    return [k for k in rep.kernels if k.graph in ("forward", "inference")]


def check(fn, inputs, dtype, expected_ops):
    """Compiled == float64 eager (and eager's dtypes and shapes); one pointwise kernel holding every op."""
    rep = fxopt.explain(fn, *inputs)
    kernels = fused_kernels(rep)
    assert len(kernels) == 1, [k.ops for k in kernels]
    missing = {target_name(op) for op in expected_ops} - set(kernels[0].ops)
    assert not missing, f"{sorted(missing)} not fused; kernels: {[k.ops for k in kernels]}"
    assert not rep.fallbacks, rep.fallbacks
    torch._dynamo.reset()
    out = compile_fxopt(fn)(*inputs)
    as_tuple = lambda v: v if isinstance(v, tuple) else (v,)  # noqa: E731
    for o, e, r in zip(as_tuple(out), as_tuple(fn(*inputs)), as_tuple(fn(*[to64(t) for t in inputs]))):
        assert (o.dtype, o.shape, o.device) == (e.dtype, e.shape, e.device)
        # an output explicitly cast to a coarser float dtype than the inputs is held to that dtype's TOL
        assert_close_to_reference(o, r, o.dtype if TOL.get(o.dtype, (0,))[0] > TOL.get(dtype, (0,))[0] else dtype)
    return out


# ---- float families: (function, input maker per argument, ops it covers) -------------------------------
def f_exp(x):
    a = x * 0.5
    return torch.exp(a), torch.exp2(a), torch.expm1(a), torch.sigmoid(a), torch.tanh(a)


def f_log(x):
    a = torch.abs(x) + 0.25
    return (torch.log(a), torch.log2(a), torch.log10(a), torch.log1p(a), torch.sqrt(a), torch.rsqrt(a),
            torch.reciprocal(a))


def f_trig(x):  # on a grid of halves: rounding sees ties, sign sees zeros
    a = -x
    return (torch.sin(a), torch.cos(a), torch.erf(a), F.gelu(a), F.gelu(a, approximate="tanh"), torch.sign(a),
            torch.relu(a), torch.abs(a), torch.floor(a), torch.ceil(a), torch.round(a), torch.trunc(a))


def f_clamp(x, lo, hi):
    a = x * 2.0
    return (torch.clamp(a, -1.5, 2.5), torch.clamp(a, min=-0.5), torch.clamp(a, max=0.5), F.hardtanh(a),
            F.hardtanh(a, -0.5, 2.0), F.leaky_relu(a), F.leaky_relu(a, 0.2), F.relu6(a),
            torch.clamp(a, min=lo, max=hi), torch.clamp(a, min=lo), torch.clamp(a, max=hi))


def f_pow(x):
    a = x * 0.5
    p = torch.abs(a)
    return (a ** 2, a ** 3, a ** 4, a ** 5, a ** -3, a ** 0, a ** 1, p ** 0.5, p ** -0.5, p ** -1, p ** -2,
            p ** 2.5, p ** -1.5)


def f_arith(x, y):
    a = -x
    return (a + y, a - y, a * y, a / y, torch.add(a, y, alpha=0.5), torch.sub(a, y, alpha=2), torch.maximum(a, y),
            torch.minimum(y, a), torch.remainder(a, y), a % 1.5, torch.where(a > 0, a, y))


def f_compare(x, y):
    a = -x
    return (a == y, a != y, a < y, a <= y, a > y, a >= y, a == 0.5, a != 0.5, a < 0.5, a <= 0.5, a > 0.5,
            a >= 0.5, torch.where(a >= y, a, y))


def f_specials(x, y):
    a = -x
    return (torch.isnan(a), torch.isinf(a), torch.maximum(a, y), torch.minimum(a, y), torch.clamp(a, -1, 1),
            torch.relu(a), torch.abs(a), torch.sign(a), F.leaky_relu(a), torch.floor(a), torch.round(a),
            torch.sigmoid(a), torch.tanh(a), torch.exp(a), a != a, a ** 0, a ** 2, a ** 3, a ** 4, a ** -1)


def f_scalar_overloads(x):
    a = -x
    return (aten.add.Scalar(a, 1.5), aten.add.Scalar(a, 2, alpha=3), aten.sub.Scalar(a, 0.5), aten.mul.Scalar(a, 3),
            aten.div.Scalar(a, 4))


def f_casts(x):
    a = x * 4.0
    return (a.to(torch.float16), a.to(torch.bfloat16) * 0.5, a.to(torch.int32), a.to(torch.bool),
            a.to(torch.float32) + 1, prims.convert_element_type(a, torch.float16), a.clone())


FLOAT_FAMILIES = {  # name -> (function, one input maker per argument, the ops it must fuse)
    "exp": (f_exp, [uniform], ops("mul.Tensor exp exp2 expm1 sigmoid tanh")),
    "log": (f_log, [lambda s, d, dev: uniform(s, d, dev, -8, 8)],
            ops("abs add.Tensor log log2 log10 log1p sqrt rsqrt reciprocal")),
    "trig": (f_trig, [lambda s, d, dev: grid(s, d, dev, step=0.5, lim=4)],
             ops("neg sin cos erf gelu sign relu abs floor ceil round trunc")),
    "clamp": (f_clamp, [grid, lambda s, d, dev: uniform(s, d, dev, -2, 0, seed=1),
                        lambda s, d, dev: uniform(s, d, dev, 0, 2, seed=2)],
              ops("clamp clamp.Tensor hardtanh leaky_relu")),
    "pow": (f_pow, [away_from_zero], ops("pow.Tensor_Scalar")),
    "arith": (f_arith, [uniform, lambda s, d, dev: uniform(s, d, dev, 0.5, 2, seed=1)],
              ops("add.Tensor sub.Tensor mul.Tensor div.Tensor maximum minimum remainder.Tensor remainder.Scalar "
                  "gt.Scalar where.self")),
    "compare": (f_compare, [grid, lambda s, d, dev: grid(s, d, dev, seed=1)],
                ops("eq.Tensor ne.Tensor lt.Tensor le.Tensor gt.Tensor ge.Tensor eq.Scalar ne.Scalar lt.Scalar "
                    "le.Scalar gt.Scalar ge.Scalar")),
    "specials": (f_specials, [with_specials, lambda s, d, dev: uniform(s, d, dev, seed=1)],
                 ops("isnan isinf maximum minimum pow.Tensor_Scalar")),
    "scalar_overloads": (f_scalar_overloads, [uniform], ops("add.Scalar sub.Scalar mul.Scalar div.Scalar")),
    "casts": (f_casts, [uniform], ops("_to_copy prims.convert_element_type clone")),
}


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("family", list(FLOAT_FAMILIES))
def test_float_family(family, dtype, device):
    fn, makers, expected_ops = FLOAT_FAMILIES[family]
    check(fn, [make(SHAPE, dtype, device) for make in makers], dtype, expected_ops)


# ---- values where a shortcut formula goes wrong -------------------------------------------------------
EDGES = [(0.49999997, 0.3), (-0.49999997, 0.3), (8388609.0, 0.1), (-8388611.0, 0.1), (16777218.0, 1.5),
         (4194304.5, -1.5), (-4194305.5, 0.7), (2.5, -0.7), (-3.5, 3.0), (1e30, 7.0), (1e6, 0.3), (-1e6, 0.3),
         (12345.678, 0.1), (0.7, 0.1), (5.0, -1.5), (-5.0, 1.5), (float("inf"), 2.0), (-1.0, float("inf"))]


def test_round_and_remainder_edge_values(device):
    """round: x + 0.5 rounds (odd integers from 2^23 on); remainder: a / b loses whole periods."""
    x, y = (torch.tensor(v, dtype=torch.float32, device=device) for v in zip(*EDGES))
    fn = lambda x, y: (torch.round(-x), torch.remainder(-x, y), -x % 0.25, torch.remainder(y, -x))  # noqa: E731
    out = check(fn, [x, y], torch.float32, ops("round remainder.Tensor remainder.Scalar"))
    # round is exact, and so is fmod: both must match eager bit for bit (TOL would hide an off-by-one at 2^23)
    torch.testing.assert_close(out, fn(x, y), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=str)
def test_integer_remainder_is_exact(dtype, device):
    """Integers beyond 2^24 are not exact in the fp32 a / b the old lowering divided in."""
    big = 2**40 + 3 if dtype == torch.int64 else 2**31 - 1
    i = torch.tensor([123456789, -123456789, big, -big, 100000007, 7, -7, 0], dtype=dtype, device=device)
    j = torch.tensor([10, 10, 3, 7, -13, -3, 3, 5], dtype=dtype, device=device)
    check(lambda i, j: (-i % j, -i % 10, -i % -7), [i, j], dtype, ops("remainder.Tensor remainder.Scalar"))


# ---- broadcasting and layouts ---------------------------------------------------------------------------
def f_layout(x, y):
    a = x * 0.5
    return torch.exp(a) + y, torch.sin(a) * y, torch.where(a > 0, a, y)


LAYOUTS = {  # name -> x; y is a [last dim] vector broadcast against it
    "contiguous": lambda d, dev: uniform((3, 37), d, dev),
    "many_blocks": lambda d, dev: uniform((3, 1003), d, dev),
    "numel_1003": lambda d, dev: uniform((1003,), d, dev),
    "transposed": lambda d, dev: uniform((37, 5), d, dev).t(),
    "strided": lambda d, dev: uniform((3, 74), d, dev)[:, ::2],
    "offset_slice": lambda d, dev: uniform((5, 40), d, dev)[1:, 3:],
    "expanded": lambda d, dev: uniform((1, 37), d, dev).expand(4, 37),
    "size1_dims": lambda d, dev: uniform((1, 37, 1), d, dev),
    "permuted_3d": lambda d, dev: uniform((37, 2, 3), d, dev).permute(1, 2, 0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts(layout, dtype, device):
    x = LAYOUTS[layout](dtype, device)
    y = uniform(x.shape[-1:], dtype, device, seed=3)
    check(f_layout, [x, y], dtype, ops("exp sin where.self"))


@pytest.mark.parametrize("xshape,yshape", [((), ()), ((1,), (1,)), ((1, 1), ()), ((1,), ())], ids=str)
def test_one_element_results(xshape, yshape, device):
    """0-d and one-element results: the store has no lane index (every lane but one is masked off)."""
    x, y = uniform(xshape, torch.float32, device), uniform(yshape, torch.float32, device, seed=1)
    check(f_layout, [x, y], torch.float32, ops("exp sin where.self"))
    check(f_trig, [x], torch.float32, FLOAT_FAMILIES["trig"][2])


BROADCASTS = {"same": (4, 37), "row": (37,), "column": (4, 1), "zero_d": (), "transposed": (37, 4)}  # y vs x [4, 37]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("bcast", list(BROADCASTS))
def test_binary_broadcast(bcast, dtype, device):
    x, y = uniform((4, 37), dtype, device), uniform(BROADCASTS[bcast], dtype, device, 0.5, 2, seed=1)
    check(f_arith, [x, y.t() if bcast == "transposed" else y], dtype, FLOAT_FAMILIES["arith"][2])


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_outer_broadcast(dtype, device):
    """Neither input has the result's shape: [N,1] op [M] -> [N,M]."""
    x, y = uniform((5, 1), dtype, device), uniform((37,), dtype, device, seed=1)
    check(lambda x, y: ((x + y) * y - x, torch.maximum(x + y, y)), [x, y], dtype,
          ops("add.Tensor mul.Tensor sub.Tensor maximum"))


# ---- integer, bool and mixed dtypes ---------------------------------------------------------------------
def f_int(i, j):
    a = -i
    return (a + j, a - j, a * j, torch.add(a, j, alpha=2), a / j, a % j, a % 3, a % -3, torch.abs(a), torch.sign(a),
            torch.relu(a), torch.maximum(a, j), torch.minimum(a, j), torch.floor(a), torch.ceil(a), torch.round(a),
            torch.trunc(a), a ** 2, a ** 3, a ** 4, torch.clamp(a, -2, 3), a < j, a == 0, torch.where(a > 0, a, j),
            a.to(torch.float32) * 0.5)


def f_bits(i, j):
    a = i ^ j
    return (a & j, a & 3, a | j, a | 3, a ^ 3, ~a, torch.logical_and(a, j), torch.logical_or(a, j),
            torch.logical_xor(a, j), torch.logical_not(a))


def f_bools(b, c):
    a = b ^ c
    return (a & c, a & True, a | c, a | False, a ^ True, ~a, torch.logical_not(a), torch.logical_and(a, c),
            a == c, a != c, a.to(torch.float32), a + c, torch.add(a, c, alpha=True), aten.add.Scalar(a, True), a * c,
            torch.maximum(a, c))


def f_mixed(x, i, b):
    a = -x
    return (a + i, a * i, a < i, a == i, torch.where(b, a, i), torch.logical_and(a, b), torch.logical_or(a, i),
            torch.logical_xor(b, a), torch.logical_not(a))


INT_OPS = ops("add.Tensor sub.Tensor mul.Tensor div.Tensor remainder.Tensor remainder.Scalar abs sign relu maximum "
              "minimum pow.Tensor_Scalar clamp lt.Tensor eq.Scalar where.self _to_copy")
BIT_OPS = ops("bitwise_xor.Tensor bitwise_and.Tensor bitwise_and.Scalar bitwise_or.Tensor bitwise_or.Scalar "
              "bitwise_xor.Scalar bitwise_not logical_and logical_or logical_xor logical_not")


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8], ids=str)
def test_integer_ops(dtype, device):
    inputs = [ints(SHAPE, dtype, device), ints((37,), dtype, device, 1, 5, seed=1)]
    if device == "cuda" and dtype in (torch.int16, torch.int8):  # abs stays ATen there (op_classes: LLVM's abs)
        without_abs = [op for op in INT_OPS if op != aten.abs.default]
        check(lambda i, j: f_int(i, j)[:8] + f_int(i, j)[9:], inputs, dtype, without_abs)
        assert any("int8/int16" in why for _, why in fxopt.explain(lambda i: (-i).abs(), inputs[0]).fallbacks)
    else:
        check(f_int, inputs, dtype, INT_OPS)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8], ids=str)
def test_bitwise_and_logical_ops(dtype, device):
    check(f_bits, [ints(SHAPE, dtype, device, 0, 100), ints(SHAPE, dtype, device, 0, 4, seed=1)], dtype, BIT_OPS)


def test_bool_ops(device):
    b, c = uniform(SHAPE, torch.float32, device) > 0, uniform(SHAPE, torch.float32, device, seed=1) > 0
    check(f_bools, [b, c], torch.bool, ops("bitwise_and.Tensor bitwise_and.Scalar bitwise_or.Scalar bitwise_xor.Scalar "
                                           "bitwise_not logical_not eq.Tensor ne.Tensor _to_copy add.Tensor "
                                           "add.Scalar mul.Tensor maximum"))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_mixed_dtypes(dtype, device):
    x, i = grid(SHAPE, dtype, device), ints(SHAPE, torch.int32, device, -2, 3, seed=1)
    b = uniform(SHAPE, torch.float32, device, seed=2) > 0
    check(f_mixed, [x, i, b], dtype, ops("add.Tensor mul.Tensor lt.Tensor eq.Tensor where.self logical_and logical_or "
                                         "logical_xor logical_not"))


def test_out_of_range_integer_scalars(device):
    """Eager wraps an out-of-range Python int into the tensor's dtype; those ops stay ATen calls."""
    def fn(a, u):
        return (a < 300) | (u == -1), a + 300, (a * 3 > 10) & (u > 7)  # the last one is in range: fused

    a = torch.tensor([100, -100, 44, 0, 127, -128], dtype=torch.int8, device=device)
    u = torch.tensor([0, 255, 3, 9, 1, 200], dtype=torch.uint8, device=device)
    rep = fxopt.explain(fn, a, u)
    assert sorted(name for name, _ in rep.fallbacks) == ["add", "eq", "lt"], rep.fallbacks
    assert all("outside the range" in reason for _, reason in rep.fallbacks)
    assert {"aten.mul.Tensor", "aten.gt.Scalar"} <= {op for k in fused_kernels(rep) for op in k.ops}
    torch._dynamo.reset()
    for o, e in zip(compile_fxopt(fn)(a, u), fn(a, u)):
        assert o.dtype == e.dtype and torch.equal(o, e), (o, e)


# ---- ops the decomposition table removes before torch.compile reaches fxopt -----------------------------
def f_decomposed(g, x):
    a = aten.neg(x)
    return (aten.threshold_backward(g, a, 0.25), aten.sigmoid_backward(g, a), aten.tanh_backward(g, a),
            aten.gelu_backward(g, a), aten.silu_backward(g, a), aten.clamp_min(a, -0.5), aten.clamp_max(a, 0.5),
            aten.rsub.Scalar(a, 2, 3), aten.rsub.Scalar(a, 1.5), aten.silu(a))


DECOMPOSED = ops("threshold_backward sigmoid_backward tanh_backward gelu_backward silu_backward clamp_min clamp_max "
                 "rsub.Scalar silu")


def compile_aten(fn, inputs):
    gm = make_fx(fn)(*inputs)
    call = compile_aten_graph(gm, list(inputs), options=Options(), graph_name="inference", report=(rep := Report()))
    return call(list(inputs)), rep


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_decomposed_ops_in_aten_graph(dtype, device):
    """Compiled from an ATen graph: through torch.compile, core-ATen decompositions remove these ops."""
    assert all(op in decomposition_table() for op in DECOMPOSED)
    g, x = uniform(SHAPE, dtype, device), uniform(SHAPE, dtype, device, seed=1)
    out, rep = compile_aten(f_decomposed, (g, x))
    kernels = fused_kernels(rep)
    assert len(kernels) == 1 and not rep.fallbacks, ([k.ops for k in kernels], rep.fallbacks)
    assert {target_name(op) for op in DECOMPOSED} <= set(kernels[0].ops)
    assert [o.dtype for o in out] == [e.dtype for e in f_decomposed(g, x)]
    assert_close_to_reference(tuple(out), f_decomposed(to64(g), to64(x)), dtype)


def test_tanh_gelu_backward_falls_back(device):
    g, x = uniform(SHAPE, torch.float32, device), uniform(SHAPE, torch.float32, device, seed=1)
    fn = lambda g, x: aten.gelu_backward(g, x, approximate="tanh")  # noqa: E731
    out, rep = compile_aten(fn, (g, x))
    assert not fused_kernels(rep)
    assert [r for _, r in rep.fallbacks] == ["tanh-approximate gelu_backward is not lowered yet"]
    assert_close_to_reference(tuple(out), (fn(to64(g), to64(x)),), torch.float32)


# ---- the tables ------------------------------------------------------------------------------------------
def test_lowerings_match_pointwise_ops():
    assert set(LOWERINGS) == set(POINTWISE_OPS)
    assert CUDA_ONLY_OPS <= POINTWISE_OPS


def test_every_interpretable_op_is_covered():
    covered = set(DECOMPOSED) | set(INT_OPS) | set(BIT_OPS) | {op for f in FLOAT_FAMILIES.values() for op in f[2]}
    assert covered == set(POINTWISE_OPS - CUDA_ONLY_OPS), sorted(map(str, POINTWISE_OPS - CUDA_ONLY_OPS - covered))

