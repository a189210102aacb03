"""Row sums that read none of each other reduced by one tl.reduce (codegen/joint_sums.py).

The order and the GPU source are checked here on the CPU; the interpreter runs each sum as its own
tl.sum (in the reordered body), so the joint reduce's numerics are checked on the GPU only (the CUDA
LayerNorm-backward tests in test_column_sums.py and the test below)."""
import pytest
import torch
import torch.fx as fx

from fxopt.codegen import joint_sums
from fxopt.codegen import triton_reduction
from tests.codegen.test_column_sums import ln_backward, ln_inputs
from tests.helpers import assert_close_to_reference


def _graph():
    """a -> s1 = sum(a); t = a * a -> s2 = sum(t); u = a - s1 (reads s1); s3 = sum(u) (reads s1)."""
    g = fx.Graph()
    a = g.placeholder("a")
    s1 = g.call_function(torch.ops.aten.sum.dim_IntList, (a, [1], True))
    u = g.call_function(torch.ops.aten.sub.Tensor, (a, s1))
    t = g.call_function(torch.ops.aten.mul.Tensor, (a, a))
    s2 = g.call_function(torch.ops.aten.sum.dim_IntList, (t, [1], True))
    s3 = g.call_function(torch.ops.aten.sum.dim_IntList, (u, [1], True))
    out = g.call_function(torch.ops.aten.add.Tensor, (s2, s3))
    g.output(out)
    return list(g.nodes), (a, s1, u, t, s2, s3, out)


def test_independent_sums_join_and_what_reads_the_first_moves_after_them():
    nodes, (a, s1, u, t, s2, s3, out) = _graph()
    order = joint_sums.joint_order(nodes, lambda n: "f32" if n.target is torch.ops.aten.sum.dim_IntList else None)
    assert (s1, s2) in order and s3 not in [x for x in order if isinstance(x, tuple) for x in x]
    flat = [x for item in order for x in (item if isinstance(item, tuple) else (item,))]
    assert sorted(flat, key=nodes.index) == nodes  # nothing lost or repeated
    pos = {n: i for i, n in enumerate(order)}
    joint = order.index((s1, s2))
    assert pos[t] < joint < pos[u] < pos[s3] < pos[out]  # t before the reduce; u (reads s1) after it


def test_sums_of_different_accumulators_stay_apart():
    nodes, (a, s1, u, t, s2, s3, out) = _graph()
    order = joint_sums.joint_order(nodes, lambda n: {s1: "f32", s2: "f64"}.get(n))
    assert order == nodes


def test_gpu_source_of_layernorm_backward_reduces_both_sums_at_once(monkeypatch):
    """Generated for the GPU (not run): one tl.reduce over both row sums with its combine function."""
    import fxopt
    import fxopt.compile

    sources, real = [], triton_reduction.generate_reduction_kernel

    def also_for_the_gpu(sub, name, target, headroom=None):
        sources.append(real(sub, name, "cuda", headroom).prologue.source)
        return real(sub, name, target, headroom)

    monkeypatch.setattr(fxopt.compile, "generate_reduction_kernel", also_for_the_gpu)
    fxopt.explain(ln_backward, *ln_inputs(8, 32, torch.float32, "cpu"))
    assert len(sources) == 1 and "_rows(" in sources[0]
    assert "def _fx_sum2(a0, a1, b0, b1):" in sources[0] and "return a0 + b0, a1 + b1" in sources[0]
    assert sources[0].count("tl.reduce(") == 1 and sources[0].count("tl.sum(tl.where") == 0


def test_interpreter_keeps_separate_sums():
    lines, sums = joint_sums.joint_reduce(["p", "q"], ["x", "y"], "interpret")
    assert lines == [] and sums == ["tl.sum(x, 1)[:, None]", "tl.sum(y, 1)[:, None]"]
    assert joint_sums.with_combine_helpers("src", lines + sums) == "src"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the joint reduce runs on the GPU only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_layernorm_backward_with_joint_sums_matches_float64(dtype):
    compiled = torch.compile(ln_backward, backend="fxopt")
    args = ln_inputs(300, 1000, dtype, "cuda")
    got, want = compiled(*args), ln_backward(*(t.double() for t in args))
    for g, r in zip(got, want):
        assert_close_to_reference(g, r, dtype)
