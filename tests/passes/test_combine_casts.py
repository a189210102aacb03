"""passes/combine_casts.py and codegen/combined_casts.py: groups that only cast a graph input become
one kernel (a training step's parameter casts: one launch instead of one per parameter), unless
moving a cast earlier would raise the graph's peak. Kernels run in the Triton interpreter here (and
on CUDA through the `device` fixture where a GPU exists)."""
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

from fxopt.options import Environment, Options
from fxopt.pass_manager import PassContext
from fxopt.passes.combine_casts import CombineInputCasts
from fxopt.passes.fuse import FusePointwise

from tests.helpers import CountingBackend, assert_close_to_reference


def _combined(report, graph=None):
    return [k for g in report.graphs if graph in (None, g.name) for k in g.kernels if k.name.startswith("cast_inputs")]


def test_independent_input_casts_of_any_float_dtypes_equal_torch(device):
    """Three graph inputs cast to three dtypes, ragged and whole blocks: one kernel, bit-equal to .to()
    (on the GPU; the Triton interpreter rounds float -> bf16 toward zero, within one bf16 ulp)."""
    def f(a, b, c, d):
        return a.half(), b.float(), c.to(torch.bfloat16), d * 2  # d's multiply: a kernel of its own
    torch.manual_seed(0)
    a = torch.randn(3, 700, device=device)  # 2100 elements: two whole blocks and a ragged one
    b = torch.randn(1024, device=device, dtype=torch.bfloat16)
    c = torch.randn(5, device=device, dtype=torch.float16) * 1e3
    d = torch.randn(7, device=device)  # a shape of its own: older partitioners group same-shape nodes
    be = CountingBackend()
    out = torch.compile(f, backend=be)(a, b, c, d)
    for got, want in zip(out, f(a, b, c, d)):
        assert got.dtype == want.dtype
        if got.dtype == torch.bfloat16 and device == "cpu":  # the interpreter truncates to bf16: within an ulp
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0)
        else:
            assert torch.equal(got, want)
    (kernel,) = _combined(be.report)
    assert len(kernel.ops) == 3 and kernel.source.count("tl.store(") == 3
    assert kernel.schedule == "3 casts of graph inputs in one launch"  # what explain prints beside it


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 48)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def test_a_mixed_precision_training_step_casts_its_parameters_in_one_launch(device):
    """precision="bf16" on an fp32 MLP: the forward's casts of its four parameters and its input are one
    kernel; output and
    every gradient equal float64 eager within bf16's tolerance."""
    torch.manual_seed(0)
    model = _MLP().to(device)
    reference = _MLP().double().to(device)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 8, 32, device=device)
    be = CountingBackend(precision="bf16")
    out = torch.compile(model, backend=be)(x)
    out.float().square().mean().backward()
    ref = reference(x.double())
    ref.square().mean().backward()
    assert_close_to_reference(out.float(), ref, torch.bfloat16)
    for p, r in zip(model.parameters(), reference.parameters()):
        assert_close_to_reference(p.grad, r.grad, torch.bfloat16)
    (kernel,) = _combined(be.report, "forward")
    assert len(kernel.ops) == 5  # the four parameters and the input x
    forward = next(g for g in be.report.graphs if g.name == "forward")
    assert forward.wrapper_source.count("cast_inputs_") == 2  # its definition and its one launch


def _fused_then_combined(fn, *args):
    ctx = PassContext(Options(), Environment(), target="interpret")
    gm = FusePointwise()(make_fx(fn)(*args), ctx).gm
    return CombineInputCasts()(gm, ctx)


def test_a_cast_moved_earlier_only_where_the_peak_stays():
    """w2's cast comes after a 16 KB buffer dies, at the graph's peak: moved to w1's cast it would be
    alive beside that buffer and raise the peak, so it stays apart. Where the peak is at the end (both
    big buffers are returned), moving it costs nothing and it joins."""
    def peak_in_the_middle(x, w1, w2):
        w1c = w1.to(torch.bfloat16)
        s = torch.relu(x * 2).sum()
        return w1c, s, w2.to(torch.bfloat16)

    def peak_at_the_end(x, w1, w2):
        w1c = w1.to(torch.bfloat16)
        y = x * 2
        w2c = w2.to(torch.bfloat16)
        return w1c, y, w2c, y + 1
    x, w1, w2 = torch.randn(4096), torch.randn(8), torch.randn(64)
    assert _fused_then_combined(peak_in_the_middle, x, w1, w2).stats == {"kernels": 0, "casts": 0}
    result = _fused_then_combined(peak_at_the_end, x, w1, w2)
    assert result.stats == {"kernels": 1, "casts": 2}
    combined = [n for n in result.gm.graph.nodes if n.op == "call_module" and "casts" in str(n.target)]
    assert len(combined) == 1 and [a.name for a in combined[0].args] == ["w1_1", "w2_1"]


def test_a_graph_without_a_single_peak_joins_nothing_and_the_pass_ends(monkeypatch):
    """Symbolic sizes elsewhere in the graph (live_bytes is None: no peak to keep) leave every cast
    apart; the pass still ends (it once looped forever on an HF Llama under dynamic shapes)."""
    import fxopt.passes.combine_casts as combine_casts
    monkeypatch.setattr(combine_casts, "live_bytes", lambda gm: None)

    def f(x, w1, w2):
        return w1.to(torch.bfloat16), x * 2, w2.to(torch.bfloat16), x + 1
    result = _fused_then_combined(f, torch.randn(4096), torch.randn(8), torch.randn(64))
    assert result.stats == {"kernels": 0, "casts": 0}


def test_more_casts_than_a_kernel_takes_split_into_kernels_of_at_most_max_members(device):
    """MAX_MEMBERS + 4 returned parameter casts (the peak is at the end, so all may join): two kernels,
    one of MAX_MEMBERS members and one of 4, every result equal to torch's cast."""
    from fxopt.passes.combine_casts import MAX_MEMBERS
    n = MAX_MEMBERS + 4

    def f(*ws):
        return tuple(w.to(torch.float16) for w in ws)
    torch.manual_seed(0)
    ws = [torch.randn(3 + i, device=device) for i in range(n)]  # shapes of their own: one group each
    be = CountingBackend()
    out = torch.compile(f, backend=be)(*ws)
    for got, w in zip(out, ws):
        assert got.dtype == torch.float16 and torch.equal(got, w.to(torch.float16))
    assert sorted(len(k.ops) for k in _combined(be.report)) == [4, MAX_MEMBERS]
