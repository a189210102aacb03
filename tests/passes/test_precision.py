"""The precision pass on small graphs: which node computes in which dtype, per policy entry; the
override knob; cast sharing and round-trip cancelling; interface dtypes; casts in the report.

Structure is read off the torch-level graph after the pass (node.meta["example_value"], which the pass
keeps true); numerics of whole models against torch.autocast are in tests/models/test_precision_models.py.
"""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import fxopt
from fxopt import pipeline
from fxopt.analysis.precision_policy import POLICY, category_of
from fxopt.capture import capture
from fxopt.options import Environment, Options
from fxopt.pass_manager import PassContext
from tests.helpers import compile_fxopt

BF16, FP32 = torch.bfloat16, torch.float32


def precision_graph(fn, *inputs, **options) -> tuple[fx.GraphModule, PassContext]:
    """fn's torch-level graph after the pre-autograd passes (attention, precision)."""
    opts = Options.from_kwargs(**{"precision": "bf16", **options})
    gm, example_inputs = capture(fn, inputs)[0]
    ctx = PassContext(options=opts, env=Environment.read(), graph_name="torch", example_inputs=example_inputs)
    for p in pipeline.pre_autograd_passes(opts):
        gm = p(gm, ctx).gm
    gm.graph.lint()
    gm.recompile()
    return gm, ctx


def value_dtype(node):
    return node.meta["example_value"].dtype


def computes_in(node: fx.Node) -> set:
    """The dtypes of a node's floating-point tensor inputs: what it computes in."""
    return {value_dtype(n) for n in node.all_input_nodes
            if isinstance(n.meta.get("example_value"), torch.Tensor) and value_dtype(n).is_floating_point}


def only(gm, match) -> fx.Node:
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method") and match(n)]
    assert len(nodes) == 1, [n.format_node() for n in gm.graph.nodes]
    return nodes[0]


def node_matcher(which):
    """A policy category's name, or a predicate on nodes."""
    return (lambda n: category_of(n) == which) if isinstance(which, str) else which


gen = torch.Generator().manual_seed(0)
x, w, b = torch.randn(4, 16, generator=gen), torch.randn(16, 16, generator=gen), torch.randn(16, generator=gen)
img, kernel = torch.randn(1, 3, 8, 8, generator=gen), torch.randn(4, 3, 3, 3, generator=gen)

# case: (function, inputs, which node (a policy category or a predicate), the dtype it computes in)
CASES = {
    "matmul": (lambda x, w: x @ w, (x, w), "matmul", BF16),
    "bmm": (lambda x, w: torch.bmm(x[None], w[None]), (x, w), "matmul", BF16),
    "linear": (lambda x, w, b: F.linear(x, w, b), (x, w, b), "linear", BF16),
    "conv": (lambda i, k: F.conv2d(i, k), (img, kernel), "conv", BF16),
    "softmax": (lambda x, w: torch.softmax(x @ w, -1), (x, w), "softmax", FP32),
    "log_softmax": (lambda x, w: F.log_softmax(x @ w, -1), (x, w), "log_softmax", FP32),
    "layer_norm": (lambda x, w: F.layer_norm(x @ w, (16,)), (x, w), "norm", FP32),
    "rms_norm": (lambda x, w: F.rms_norm(x @ w, (16,)), (x, w), "norm", FP32),
    "group_norm": (lambda x, w: F.group_norm((x @ w).view(4, 4, 4), 2), (x, w), "norm", FP32),
    "sum": (lambda x, w: (x @ w).sum(-1), (x, w), "reduction", FP32),
    "mean": (lambda x, w: torch.mean(x @ w, -1), (x, w), "reduction", FP32),
    "var": (lambda x, w: torch.var(x @ w, -1), (x, w), "reduction", FP32),
    "exp_into_sum": (lambda x, w: torch.exp(x @ w).sum(-1), (x, w), "exp_log_pow", FP32),
    "pow_into_mean": (lambda x, w: (x @ w).pow(2).mean(-1), (x, w), "exp_log_pow", FP32),
    "pow_elsewhere_follows": (lambda x, w: (x @ w).pow(2) * 3, (x, w), "exp_log_pow", BF16),
    "mse_loss": (lambda x, w: F.mse_loss(x @ w, x), (x, w), "loss", FP32),
    "cdist": (lambda x, w: torch.cdist(x @ w, x), (x, w), "linalg", FP32),
    "gelu_follows": (lambda x, w: F.gelu(x @ w), (x, w), lambda n: n.target is F.gelu, BF16),
    "residual_promotes": (lambda x, w: x + x @ w, (x, w), lambda n: n.target is operator.add, FP32),
}


@pytest.mark.parametrize("case", CASES)
def test_policy_places_each_op(case):
    fn, inputs, which, expected = CASES[case]
    gm, ctx = precision_graph(fn, *inputs)
    node = only(gm, node_matcher(which))
    assert value_dtype(node) == expected, node.format_node()
    if case.endswith("promotes"):  # bf16 product + fp32 residual: fp32 by type promotion, no cast
        assert computes_in(node) == {BF16, FP32} and not any(node.name in c.reason for c in ctx.casts)
    else:
        assert computes_in(node) == {expected}, node.format_node()
    output = gm.graph.output_node().args[0]
    assert all(value_dtype(v) == FP32 for v in output if value_dtype(v).is_floating_point)  # interface kept


def test_every_policy_category_has_a_case():
    covered = {which for _, _, which, _ in CASES.values() if isinstance(which, str)}
    assert covered | {"attention"} == set(POLICY)  # attention: tests/models/test_precision_models.py


def test_override_moves_softmax_to_low_and_linear_to_fp32():
    fn = lambda x, w, b: torch.softmax(F.linear(x, w, b), -1)  # noqa: E731
    gm, _ = precision_graph(fn, x, w, b, precision_policy={"softmax": "low", "linear": "fp32"})
    assert computes_in(only(gm, node_matcher("linear"))) == {FP32}
    gm, ctx = precision_graph(fn, x, w, b, precision_policy={"softmax": "low"})
    assert computes_in(only(gm, node_matcher("softmax"))) == {BF16}
    assert [c.to_dtype for c in ctx.casts] == ["bf16", "bf16", "bf16", "fp32"]  # linear's inputs, the output


def test_follow_override_leaves_an_op_alone():
    gm, ctx = precision_graph(lambda x, w: x @ w, x, w, precision_policy={"matmul": "follow"})
    assert computes_in(only(gm, node_matcher("matmul"))) == {FP32} and ctx.casts == []


@pytest.mark.parametrize("kwargs, message", [
    ({"precision": "bf16", "precision_policy": {"softmaxx": "low"}}, "unknown category 'softmaxx'; categories are"),
    ({"precision": "bf16", "precision_policy": {"softmax": "bf16"}}, "choose one of ('low', 'fp32', 'follow')"),
    ({"precision_policy": {"softmax": "low"}}, "precision_policy needs precision='bf16' or 'fp16'"),
    ({"precision": "fp16", "precision_policy": ["softmax"]}, "must be a dict"),
])
def test_override_is_validated_with_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        fxopt.backend(**kwargs)


def test_one_cast_per_value_shared_by_its_consumers():
    fn = lambda x, w: (x @ w) @ w + x @ w.t()  # noqa: E731  x and w feed two matmuls each
    gm, ctx = precision_graph(fn, x, w)
    cast_nodes = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "to"]
    sources = [n.args[0].name for n in cast_nodes if n.args[1] is BF16]
    assert sorted(sources) == ["l_w_", "l_x_", "t"], sources  # each value once, whatever its uses
    assert len(ctx.casts) == len(cast_nodes) == 4  # and the sum back to fp32 at the output


def test_exact_round_trip_is_cancelled():
    """(x @ w).float() @ w: the .float() of a bf16 value cast back to bf16 is exact, so it goes."""
    gm, ctx = precision_graph(lambda x, w: (x @ w).float() @ w, x, w)
    first, second = [n for n in gm.graph.nodes if category_of(n) == "matmul"]
    assert second.args[0] is first  # reads the bf16 product directly
    assert not any(n.op == "call_method" and n.target == "float" for n in gm.graph.nodes)
    assert len(ctx.casts) == 3  # x, w to bf16; the result back to fp32


def test_op_that_rejects_new_dtypes_keeps_its_own():
    """lerp insists on equal dtypes: its bf16 input is cast back and the node is noted."""
    gm, ctx = precision_graph(lambda x, w: torch.lerp(x, x @ w, 0.5), x, w)
    assert computes_in(only(gm, lambda n: n.target is torch.lerp)) == {FP32}
    assert any("kept in its original dtypes" in why for _, why in ctx.notes)
    out = compile_fxopt(lambda x, w: torch.lerp(x, x @ w, 0.5), precision="bf16")(x, w)
    torch.testing.assert_close(out, torch.lerp(x, x @ w, 0.5), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("precision", [None, "fp32"])
def test_no_casts_without_a_low_precision(precision):
    rep = fxopt.explain(lambda x, w: torch.softmax(x @ w, -1), x, w, precision=precision)
    assert rep.casts == [] and "precision" not in [p.name for p in rep.pre_autograd]


def test_interface_dtypes_and_casts_in_the_report():
    lin = torch.nn.Linear(16, 16)
    x_in = torch.randn(4, 16, requires_grad=True)
    rep = fxopt.explain(lambda t: torch.softmax(lin(t), -1), x_in, precision="bf16")
    text = str(rep)
    assert f"casts ({len(rep.casts)}), inserted by the precision pass:" in text
    assert [c.reason for c in rep.casts][-1] == "softmax (softmax) computes in fp32"
    assert "linear (linear) computes in bf16" in text
    out = compile_fxopt(lambda t: torch.softmax(lin(t), -1), precision="bf16")(x_in)
    out.sum().backward()
    assert out.dtype == FP32 and x_in.grad.dtype == FP32
    assert lin.weight.dtype == lin.weight.grad.dtype == FP32 and lin.bias.grad.dtype == FP32


def test_verify_defaults_to_the_low_dtypes_tolerance(monkeypatch):
    """verify=True with precision="bf16" passes on a correct pass (its default rtol is bf16's), and an
    explicit tight verify_rtol still names the precision pass."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # bf16 accuracy is checked off the interpreter (see README)
    lin = torch.nn.Linear(32, 32)
    x = torch.randn(8, 32)

    def f(x):
        return torch.relu(lin(x)) * 2

    assert Options(precision="bf16").verify_tolerance == 3e-2 and Options().verify_tolerance == 1e-3
    fxopt.explain(f, x, precision="bf16", verify=True)
    with pytest.raises(fxopt.errors.VerifyError, match="precision"):
        fxopt.explain(f, x, precision="bf16", verify=True, verify_rtol=1e-6)


def test_op_that_cannot_be_rerun_on_fakes_keeps_its_recorded_value(monkeypatch):
    """torch 2.11 raises "Cannot call numel()" re-running some ops on fake tensors over symbolic
    sizes: the op gets its inputs back in their recorded dtypes and keeps dynamo's value, no crash."""
    from fxopt.passes import precision

    rerun = precision.run_on_fakes

    def refuse_flip(node, mode):
        if node.target is torch.flip:
            raise RuntimeError("Cannot call numel() on tensor with symbolic sizes/strides")
        return rerun(node, mode)

    monkeypatch.setattr(precision, "run_on_fakes", refuse_flip)
    fn = lambda x, w: torch.flip(x @ w, [0]) * 2  # noqa: E731
    gm, ctx = precision_graph(fn, x, w)
    flip = only(gm, lambda n: n.target is torch.flip)
    assert computes_in(flip) == {FP32} and value_dtype(flip) == FP32
    assert any("kept in its original dtypes" in why and "numel" in why for _, why in ctx.notes)
    bound = 2 * 2**-8 * (x.abs() @ w.abs())  # a bf16 matmul's rounding (operands and result), doubled
    assert ((compile_fxopt(fn, precision="bf16")(x, w) - fn(x, w)).abs() <= torch.flip(bound, [0]) * 2).all()


def test_policy_op_that_cannot_be_rerun_reads_its_original_fp32_inputs(monkeypatch):
    """The same for a policy op (a Linear in inference, whose weight cast is cached): its inputs go
    back to the original fp32 values themselves, not through bf16 and back, and the compile works."""
    from fxopt.passes import precision

    rerun = precision.run_on_fakes
    linear = torch.nn.Linear(16, 16).eval()

    def refuse_linear(node, mode):
        if node.target is F.linear:
            raise RuntimeError("Cannot call numel() on tensor with symbolic sizes/strides")
        return rerun(node, mode)

    monkeypatch.setattr(precision, "run_on_fakes", refuse_linear)
    fn = lambda x: torch.relu(linear(x))  # noqa: E731
    with torch.no_grad():
        gm, ctx = precision_graph(fn, x)
        node = only(gm, lambda n: n.target is F.linear)
        assert all(n.op == "placeholder" for n in node.all_input_nodes[1:]), node.format_node()
        assert computes_in(node) == {FP32}
        torch.testing.assert_close(compile_fxopt(fn, precision="bf16")(x), fn(x), rtol=1e-5, atol=1e-5)


class _Stn(torch.nn.Module):
    """A spatial transformer (the PyTorch tutorial's): grid_sample of the fp32 image on a grid computed
    from a linear layer's (now low-precision) output."""
    def __init__(self):
        super().__init__()
        self.loc = torch.nn.Linear(3 * 6 * 6, 6)

    def forward(self, x):
        theta = self.loc(x.flatten(1)).view(-1, 2, 3)
        return F.grid_sample(x, F.affine_grid(theta, x.size(), align_corners=False), align_corners=False)


class _ConvBn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.bn = torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.c(x))


class _Distances(torch.nn.Module):
    """cdist, a decomposition and a local response norm after low-precision layers: none has a bf16/fp16
    CPU kernel (autocast runs them in fp32)."""
    def __init__(self):
        super().__init__()
        self.enc, self.protos = torch.nn.Linear(8, 8), torch.nn.Parameter(torch.randn(5, 8))
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x, img):
        h = self.enc(x)
        lrn = F.local_response_norm(self.conv(img), 3)
        return -torch.cdist(h, self.protos), torch.linalg.svdvals(h), lrn


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_ops_that_want_one_dtype_or_have_no_low_precision_kernel(precision):
    """Each crashed at run time under precision= while autocast runs it: grid_sample given a bf16 and an
    fp32 tensor (its meta function accepts the mix, its kernel does not), BatchNorm with
    precision_policy={"norm": "low"} (weight cast, running statistics not), cdist / linalg / local
    response norm without low-precision CPU kernels. Mixed inputs of a non-elementwise op are now put
    back in their dtypes (noted); linalg, distances and FFTs compute in fp32 (a policy category)."""
    torch.manual_seed(0)
    img, x = torch.randn(2, 3, 6, 6), torch.randn(4, 8)
    # (bf16 grid coordinates: 2^-8 of the image's width moves a sample by ~0.1 where the image is steep;
    # autocast's own difference from fp32 here is of that size)
    tol = dict(rtol=5e-2, atol=0.15 if precision == "bf16" else 5e-2)
    cases = [(_Stn(), (img,), {}), (_ConvBn(), (img,), {"precision_policy": {"norm": "low"}}),
             (_Distances(), (x, img), {})]
    for model, inputs, options in cases:
        expected = model(*inputs)
        torch._dynamo.reset()
        got = torch.compile(model, backend=fxopt.backend(precision=precision, **options))(*inputs)
        as_tuple = lambda t: t if isinstance(t, tuple) else (t,)  # noqa: E731
        for g, e in zip(as_tuple(got), as_tuple(expected)):
            torch.testing.assert_close(g, e, **tol)
    assert category_of(fx.Graph().call_function(torch.cdist, ())) == "linalg" and POLICY["linalg"] == "fp32"


def test_attention_with_an_additive_mask_keeps_computing_in_low_precision():
    """The fused op's additive mask stays fp32 by design (the kernel adds it in fp32) beside bf16 q, k, v:
    the mixed-input rule for non-elementwise ops must not put the op back in fp32."""
    def attend(q, k, v, m):
        s = (q @ k.transpose(-2, -1)) / 4 + m
        return s.softmax(-1) @ v

    q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))
    mask = torch.zeros(2, 1, 1, 8)
    mask[0, ..., -3:] = -1e4
    gm, ctx = precision_graph(attend, q, k, v, mask)
    reasons = [c.reason for c in ctx.casts]
    assert sum("(attention) computes in bf16" in r for r in reasons) == 3, reasons
    assert not any("mixed float dtypes" in why for _, why in ctx.notes), ctx.notes
