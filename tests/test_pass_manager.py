"""The pass manager's instruments: lint, timing, snapshots, and verify naming the pass that broke numerics."""
from dataclasses import dataclass

import pytest
import torch

import fxopt
from fxopt import pipeline
from fxopt.errors import VerifyError
from fxopt.pass_manager import PassResult


@dataclass(frozen=True)
class MulBecomesAdd:
    """A deliberately wrong pass: rewrites the first aten.mul into aten.add."""

    name: str = "mul_becomes_add"

    def __call__(self, gm, ctx):
        for n in gm.graph.nodes:
            if n.target is torch.ops.aten.mul.Tensor:
                n.target = torch.ops.aten.add.Tensor
                return PassResult(gm, True, {"broken": 1})
        return PassResult(gm, False, {})


@dataclass(frozen=True)
class Raises:
    name: str = "raises"

    def __call__(self, gm, ctx):
        raise ValueError("boom")


def f(x, y):
    return torch.sigmoid(x * y) + 1


def test_verify_names_the_broken_pass_and_node(monkeypatch):
    passes = pipeline.post_grad_passes(fxopt.Options())
    monkeypatch.setattr(pipeline, "post_grad_passes", lambda opts: [passes[0], MulBecomesAdd(), *passes[1:]])
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    with pytest.raises(Exception) as info:
        fxopt.explain(f, x, y, verify=True)
    msg = str(info.value)
    assert "pass 'mul_becomes_add'" in msg and "first differing node: 'mul" in msg
    assert isinstance(info.value, VerifyError) or "VerifyError" in msg


def test_verify_passes_on_the_real_pipeline_and_records_errors():
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    rep = fxopt.explain(f, x, y, verify=True)
    errors = [p.max_rel_error for p in rep.passes]
    assert errors and all(e is not None and e < 1e-5 for e in errors)
    assert rep.passes[-1].name == "codegen"  # the generated kernels are checked too


def test_failing_pass_is_named_with_the_passes_before_it(monkeypatch):
    passes = pipeline.post_grad_passes(fxopt.Options())
    monkeypatch.setattr(pipeline, "post_grad_passes", lambda opts: [passes[0], Raises()])
    with pytest.raises(Exception, match=r"pass 'raises' failed on the inference graph; passes that ran before it: cleanup"):
        fxopt.explain(f, torch.randn(4), torch.randn(4))


def test_records_time_and_node_counts():
    rep = fxopt.explain(f, torch.randn(4), torch.randn(4))
    fuse = next(p for p in rep.passes if p.name == "fuse")
    assert fuse.nodes_before == 3 and fuse.nodes_after == 1 and fuse.stats["groups"] == 1
    assert fuse.seconds > 0 and fuse.changed
    assert "self.fused" in fuse.text and "# f32[4] cpu" in fuse.text


def test_the_pass_manager_makes_the_graphs_code_only_when_it_runs():
    """Passes recompile after each change; the pass manager's module defers the code to the first call, and
    the fused groups' modules are deferred too, so nothing between passes generates or compiles code."""
    import torch.fx as fx
    from torch.fx._lazy_graph_module import _LazyGraphModule
    from fxopt.pass_manager import PassContext, PassManager

    from torch.fx.experimental.proxy_tensor import make_fx
    gm = make_fx(lambda x, y: torch.sigmoid(x * y) + torch.cos(x), tracing_mode="fake")(torch.randn(4), torch.randn(4))
    gm.meta["marker"] = 1
    gm.compiler_note = "kept"
    ctx = PassContext(options=fxopt.Options(), env=fxopt.options.Environment.read(), graph_name="inference",
                      target="interpret")
    fuse = [p for p in pipeline.post_grad_passes(fxopt.Options()) if p.name == "fuse"]
    out, records, _ = PassManager(fuse).run(gm, ctx)
    assert records[0].stats["groups"] == 1
    assert isinstance(out, _LazyGraphModule) and out._needs_recompile() and out.meta == {"marker": 1}
    assert out.compiler_note == "kept"
    groups = [m for m in out.children() if isinstance(m, fx.GraphModule)]
    assert len(groups) == 1 and groups[0]._needs_recompile()
    x, y = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    torch.testing.assert_close(out(x, y), torch.sigmoid(x * y) + torch.cos(x))
    assert not out._needs_recompile() and "fused" in out.code


def test_snapshots_of_a_graph_with_a_constant_tensor_share_it():
    """explain keeps a copy of the graph after every pass; a tensor constant (torch.tensor(...) in the
    model) must not be cloned there: under aot_autograd's fake mode cloning its storage fails."""
    def fn(x):
        return x * torch.tensor([0.5, 0.25, 2.0]) + 1

    x = torch.randn(4, 3)
    rep = fxopt.explain(fn, x)
    graph = rep.graphs[0]
    constants = [getattr(gm, n.target) for gm in graph.snapshots.values() for n in gm.graph.nodes
                 if n.op == "get_attr" and isinstance(getattr(gm, n.target), torch.Tensor)]
    assert constants and len({c.data_ptr() for c in constants}) == 1
    assert torch.equal(constants[0], torch.tensor([0.5, 0.25, 2.0]))


def test_verify_accepts_random_ops_and_leaves_the_callers_rng_alone():
    """Every verification run starts from one RNG state, so a dropout mask is the same draw in the captured
    graph and after each pass (a sweep found verify=True rejecting every graph with dropout, blaming a pass
    that changed nothing), and the caller's RNG stream is where it would be without verify."""
    import torch.nn.functional as F

    def drop(x):
        return F.dropout(x.sin(), 0.5, training=True) * 2

    x = torch.randn(6, 12)
    results = []
    for verify in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(3)
        out = torch.compile(drop, backend=fxopt.backend(verify=verify))(x)
        results.append((out, torch.rand(4)))
    (plain, after_plain), (verified, after_verified) = results
    assert torch.equal(plain, verified) and torch.equal(after_plain, after_verified)
    torch.manual_seed(3)
    torch.testing.assert_close(drop(x), plain)  # the same mask as eager's (values to fp32 rounding)


def test_verify_does_not_repeat_in_place_updates_of_graph_attributes():
    """A compiled optimizer step updates parameters and state in place: verification runs must put them
    back (each took another SGD step before: the parameters moved four steps for one call)."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    twins = [copy.deepcopy(model) for _ in range(2)]
    for m, backend in zip(twins, (None, fxopt.backend(verify=True))):
        torch._dynamo.reset()
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        step = opt.step if backend is None else torch.compile(opt.step, backend=backend)
        for _ in range(2):
            for p in m.parameters():
                p.grad = torch.ones_like(p)
            step()
    for eager_p, verified_p in zip(*(m.parameters() for m in twins)):
        torch.testing.assert_close(verified_p, eager_p)


def test_verify_compares_tuple_values_of_higher_order_ops():
    from fxopt.verify import rel_error
    a = (torch.ones(3), torch.zeros(2))
    assert rel_error(a, (torch.ones(3), torch.zeros(2))) == 0.0
    assert rel_error(a, (torch.ones(3), torch.ones(2))) > 0.5
    assert rel_error(a, (torch.ones(3),)) == float("inf")


def test_verify_takes_expanded_inputs_and_skips_symbolic_torch_graphs():
    """An input expanded along a dim (stride 0: a padding mask `m.expand(B, T, T)`) is made and cloned with its
    own layout (empty_strided + copy_ refused it; clone() made it contiguous, and the kernel compiled for
    stride 0 refused that); under dynamic=True the torch-level graph is not run on example tensors (its
    `torch.ones(s, s)` failed), as the ATen graphs are not, with a note."""
    def f(x, m):
        return (x * 2 + m).sum(-1)

    x, m = torch.randn(2, 7, 7), torch.randn(2, 1, 7).expand(2, 7, 7)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, backend=fxopt.backend(verify=True))(x, m), f(x, m))

    def causal(q, k, v):
        t = q.size(-2)
        s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        return s.softmax(-1) @ v

    q, k, v = (torch.randn(1, 2, 9, 16) for _ in range(3))
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(causal, backend=fxopt.backend(verify=True), dynamic=True)(q, k, v),
                               causal(q, k, v))


def test_verify_tolerance_follows_the_graphs_own_low_precision():
    """An fp16 model without `precision=`: fxopt computes its pointwise chains in fp32 and rounds once,
    the captured graph rounds after every op, so the two differ by fp16 rounding (1.1e-3 here, while
    fxopt is 3x closer to float64 than eager). verify's default tolerance is the graph's lowest
    precision's (5e-3 for fp16), not 1e-3: it raised "the fault is in codegen" on a correct model."""
    def chain(x, w):
        h = x.float()
        h = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        g = torch.nn.functional.silu(h) * (h * 1.7 + 0.3)
        for _ in range(6):
            g = g + torch.tanh(g * 1.3) * 0.9 - g.sigmoid() * 0.45
        return g

    torch.manual_seed(0)
    x, w = torch.randn(24, 64, dtype=torch.float16), (1 + 0.1 * torch.randn(64)).half()
    rep = fxopt.explain(chain, x, w, verify=True)
    assert rep.passes[-1].name == "codegen" and 1e-3 < rep.passes[-1].max_rel_error < 5e-3
    assert fxopt.Options().verify_tolerance_for({torch.float32, torch.float16}) == 5e-3
    assert fxopt.Options(precision="fp16").verify_tolerance_for({torch.bfloat16}) == 3e-2
    assert fxopt.Options(verify_rtol=1e-4).verify_tolerance_for({torch.bfloat16}) == 1e-4


def test_verify_ignores_what_the_captured_graph_leaves_undefined():
    """verify runs a backward graph on random saved values (a log-sum-exp, an rstd), where the captured
    graph itself can give NaN: those places are not compared (it reported an infinite error, "the fault
    is in codegen", for a correct GQA + RMSNorm block under precision="fp16"). A NaN where the captured
    graph has a number is still an infinite error."""
    from fxopt.verify import rel_error
    ref = torch.tensor([1.0, float("nan"), 2.0])
    assert rel_error(torch.tensor([1.0, 5.0, 2.0]), ref) == 0.0
    assert rel_error(torch.tensor([1.0, float("nan"), 2.0]), ref) == 0.0
    assert rel_error(torch.tensor([float("nan"), 0.0, 2.0]), ref) == float("inf")
    assert rel_error(torch.tensor([1.0, 0.0, 2.2]), ref) == pytest.approx(0.2 / 5 ** 0.5)


def test_verify_skips_graphs_that_do_not_run_on_its_inputs_and_says_so():
    """The captured graph itself raising on verify's inputs (zero ints for a backward's saved LU pivots,
    which lu_solve refuses; a tensor hook on an intermediate, registered under verify's no_grad) failed
    the whole compile. Such a graph compiles unverified, with the reason in the report."""
    torch._dynamo.reset()

    def solve(a, b):
        return torch.linalg.solve(a, b).tanh().sum()

    def hooked(x, w):
        h = x @ w
        h.register_hook(lambda g: g * 2)
        return h.tanh().sum()

    a = (torch.randn(4, 4) + 4 * torch.eye(4)).requires_grad_()
    b = torch.randn(4, 2, requires_grad=True)
    x, w = torch.randn(4, 5, requires_grad=True), torch.randn(5, 3, requires_grad=True)
    for fn, args in ((solve, (a, b)), (hooked, (x, w))):
        torch._dynamo.reset()
        rep = fxopt.explain(fn, *args, verify=True)
        notes = [n for g in rep.graphs for n in g.notes] + list(rep.pre_autograd_notes)
        assert any("verify=True is skipped" in n for n in notes), notes
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend=fxopt.backend(verify=True))
        compiled(*args).backward()
        grads = [p.grad.clone() for p in args]
        for p in args:
            p.grad = None
        fn(*args).backward()
        for g, p in zip(grads, args):
            torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)
            p.grad = None
    torch._dynamo.reset()


def _fp16_regions(x, W, b, w):
    """fp16 autocast regions around a softmax over fp32 logits: verify's random inputs make the captured
    graph's per-op fp16 roundings grow to 1.4e-2 of its output (against float64)."""
    y = torch.nn.functional.layer_norm(x, (13,), w, b)
    with torch.autocast("cpu", dtype=torch.float16):
        g = torch.nn.functional.gelu(y @ W) * 1.5
        s = g.sum(-1, keepdim=True)
    z = (g.float() + y).softmax(-1) * s.float()
    with torch.autocast("cpu", dtype=torch.float16):
        k = z @ W
    return (k.float() * y).tanh().sum(-1), z


def test_verify_lets_float64_judge_fp16_graphs_where_codegen_is_the_more_accurate():
    """Found by a sweep: verify=True raised "the fault is in codegen" on this correct function, whose
    generated code differs from the captured graph by 1.2e-2 (> 5e-3) because the captured graph rounds
    to fp16 after every op. Against the graph run in float64 the generated code is 3x closer."""
    torch.manual_seed(0)
    args = [torch.randn(7, 13), torch.randn(13, 13) * 0.3, torch.randn(13), torch.randn(13)]
    out = torch.compile(_fp16_regions, backend=fxopt.backend(verify=True))(*args)
    for got, want in zip(out, _fp16_regions(*args)):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_verify_still_blames_codegen_for_a_wrong_kernel_in_an_fp16_graph(monkeypatch):
    from fxopt.codegen import pointwise_ops
    right = pointwise_ops.LOWERINGS[torch.ops.aten.tanh.default]
    monkeypatch.setitem(pointwise_ops.LOWERINGS, torch.ops.aten.tanh.default,
                        lambda c, n, o: f"(1.05 * {right(c, n, o)})")  # 5% off
    torch.manual_seed(0)
    args = [torch.randn(7, 13), torch.randn(13, 13) * 0.3, torch.randn(13), torch.randn(13)]
    with pytest.raises(Exception) as info:
        torch.compile(_fp16_regions, backend=fxopt.backend(verify=True))(*args)
    assert "the fault is in codegen" in str(info.value) and "against the graph run in float64" in str(info.value)


def test_verify_judges_an_output_that_is_zero_up_to_rounding_by_its_noise():
    """Found by a sweep: `(x - x.mean(-1, keepdim=True)).sum(-1)` is zero up to fp32 rounding; the
    generated code's and the captured graph's noise differ by 100% of an output that small, and verify
    blamed codegen (relative error 1.05) though fxopt was closer to float64 than eager."""
    def centred_sum(x):
        return (x - x.mean(-1, keepdim=True)).sum(-1)

    for seed in range(3):
        torch.manual_seed(seed)
        x = torch.randn(3, 33)
        out = torch.compile(centred_sum, backend=fxopt.backend(verify=True))(x)
        torch.testing.assert_close(out.double(), centred_sum(x.double()), rtol=0, atol=1e-5)
        torch._dynamo.reset()
