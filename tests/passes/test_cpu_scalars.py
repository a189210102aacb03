"""passes/cpu_scalars.py: a 0-d CPU tensor input (dynamo's float attribute under dynamic=True) whose
elementwise math feeds GPU ops becomes a GPU scalar made from its value, so that math fuses on the
GPU; anything else reading it is left alone.

Structure is checked on the CPU with fake CUDA tensors; the numerics need a GPU (marked gpu)."""
import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from fxopt.options import Environment, Options
from fxopt.pass_manager import PassContext
from fxopt.passes.cpu_scalars import ScalarsToDevice
from fxopt.passes.fuse import FusePointwise
from fxopt.passes.fuse_reductions import FuseReductions
from tests.helpers import CountingBackend

aten = torch.ops.aten


def _graph(fn, x_device="cuda", eps_dtype=torch.float64):
    with FakeTensorMode():
        x = torch.empty(4, 32, device=x_device)
        eps = torch.empty((), dtype=eps_dtype)  # on the CPU, as dynamo passes a float attribute
        return make_fx(fn)(x, eps)


def _run(gm, target="cuda"):
    ctx = PassContext(Options(), Environment(), target=target)
    return ScalarsToDevice()(gm, ctx), ctx


def rmsnorm(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps.to(torch.float32))


def test_the_scalar_is_read_once_and_its_cast_computes_on_the_gpu():
    gm = _graph(rmsnorm)
    result, ctx = _run(gm)
    assert result.stats == {"moved": 1}
    eps = [n for n in gm.graph.nodes if n.op == "placeholder"][1]
    assert [u.target for u in eps.users] == [aten._local_scalar_dense.default]
    # the cast to float32 is the scalar made in float32 (the same rounding): no cast left
    (scalar,) = [n for n in gm.graph.nodes if n.target is aten.scalar_tensor.default]
    assert scalar.kwargs["dtype"] == torch.float32 and scalar.kwargs["device"].type == "cuda"
    assert not [n for n in gm.graph.nodes if n.target is aten._to_copy.default]
    for n in gm.graph.nodes:  # every tensor besides the input itself is now on the GPU
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and n is not eps:
            assert val.device.type == "cuda", n.name
    # and the whole norm is one fused group: the add no longer mixes devices
    FuseReductions()(gm, ctx)
    FusePointwise()(gm, ctx)
    assert sum(n.op == "call_module" for n in gm.graph.nodes) == 1


def _returns_chain_value(x, eps):
    e = eps.to(torch.float32) * 2
    return x + e, e  # e is a graph output: it must stay a CPU tensor


def _chain_read_by_aten(x, eps):
    e = eps.to(torch.float32)
    return x + e, e.expand(3)  # a view of the CPU value


def _read_only_by_cpu_math(x, eps):
    return x.sum() + 1, eps * 3  # nothing on the GPU reads the scalar


def test_math_on_the_scalar_after_its_cast_moves_with_it():
    gm = _graph(lambda x, eps: x / (eps.to(torch.float32) * 2 + 1))
    result, _ = _run(gm)
    assert result.stats == {"moved": 1}
    (mul,) = [n for n in gm.graph.nodes if n.target is aten.mul.Tensor]
    assert mul.args[0].target is aten.scalar_tensor.default
    for n in [mul, *mul.users]:
        assert n.meta["val"].device.type == "cuda" and n.meta["val"].dtype == torch.float32


def test_two_casts_and_a_direct_use_each_get_their_scalar():
    def f(x, eps):
        return (x + eps.to(torch.float32)) * eps.to(torch.float16) + x * eps
    gm = _graph(f)
    result, _ = _run(gm)
    assert result.stats == {"moved": 1}
    made = sorted(str(n.kwargs["dtype"]) for n in gm.graph.nodes if n.target is aten.scalar_tensor.default)
    assert made == ["torch.float16", "torch.float32", "torch.float64"]
    gm.graph.lint()
    eps = [n for n in gm.graph.nodes if n.op == "placeholder"][1]
    assert [u.target for u in eps.users] == [aten._local_scalar_dense.default]


@pytest.mark.parametrize("fn", [_returns_chain_value, _chain_read_by_aten, _read_only_by_cpu_math])
def test_a_scalar_whose_values_leave_the_gpu_math_is_left_alone(fn):
    gm = _graph(fn)
    before = str(gm.graph)
    result, _ = _run(gm)
    assert result.stats == {"moved": 0} and str(gm.graph) == before


@pytest.mark.parametrize("case", ["cpu_graph", "int_scalar"])
def test_cpu_graphs_and_integer_scalars_are_left_alone(case):
    gm = _graph(rmsnorm, x_device="cpu") if case == "cpu_graph" else \
        _graph(lambda x, n: x * n.to(torch.float32), eps_dtype=torch.int64)
    result, _ = _run(gm, target="interpret" if case == "cpu_graph" else "cuda")
    assert result.stats == {"moved": 0}


class RMSNorm(nn.Module):
    """Llama's, with eps a float attribute: dynamo passes it as a 0-d CPU tensor under dynamic=True."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.rand(d) + 0.5), eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_dynamic_rmsnorm_with_a_float_attribute_is_one_kernel_and_equal_to_eager():
    torch._dynamo.reset()
    m = RMSNorm(256).cuda()
    be = CountingBackend()
    compiled = torch.compile(m, backend=be, dynamic=True)
    for rows in (8, 24, 100):
        x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16) * 3
        with torch.no_grad():
            got = compiled(x)
            ref = RMSNorm.forward(m.double(), x.double()).to(got.dtype)
            m.float()
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
    assert be.calls == 1
    src = be.report.wrapper_source
    assert "convert_element_type" not in src and "with device_guard" in src
    assert len([k for k in be.report.kernels if k.graph in ("forward", "inference")]) == 1


def test_cuda_graphs_key_a_cpu_scalar_by_value_and_read_only_gpu_inputs_from_memory():
    """With the scalar made on the GPU from its value, a captured graph freezes that value: the graph's
    signature holds it (a new value, a new graph), and the scalar is not an input read from memory."""
    from fxopt.cudagraph_checks import Refused, refusal_reason, signature
    from fxopt.cudagraph_io import Entry
    eps = torch.tensor(1e-6, dtype=torch.float64)
    key = signature([eps])[0]
    assert key == signature([torch.tensor(1e-6, dtype=torch.float64)])[0]
    assert key != signature([torch.tensor(1e-5, dtype=torch.float64)])[0]
    nan = torch.tensor(float("nan"))
    assert signature([nan])[0] == signature([nan.clone()])[0]  # else every call would capture anew
    with pytest.raises(Refused, match="CPU tensor"):
        signature([torch.randn(3)])
    assert Entry().graph_inputs([torch.randn(3), eps, 3]) == [0]
    assert Entry(cpu_ok=True).graph_inputs([torch.randn(3), eps, 3]) == [0, 1]
    gm = _graph(rmsnorm)
    _run(gm)
    assert refusal_reason(gm, "cuda") is None  # its .item() reads the host, not the GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_dynamic_rmsnorm_with_a_float_attribute_replays_as_cuda_graphs():
    torch._dynamo.reset()
    m = RMSNorm(256).cuda()
    be = CountingBackend(cudagraphs=True)
    compiled = torch.compile(m, backend=be, dynamic=True)
    for eps in (1e-6, 1e-6, 1e-6, 1e-6, 1e-2, 1e-2, 1e-2, 1e-2):  # a new eps: a new graph, never the old value
        m.eps = eps
        x = torch.randn(24, 256, device="cuda", dtype=torch.bfloat16) * 0.05
        with torch.no_grad():
            got = compiled(x).clone()
            ref = RMSNorm.forward(m.double(), x.double()).to(got.dtype)
            m.float()
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
    notes = " ".join(note for g in be.report.graphs for note in g.notes)
    # one graph kept per eps (2 warm-up calls each); x may sit at one address through the warm-ups and
    # move later, which re-captures that graph once with x copied (cudagraphs.GraphedCallable)
    assert "refused" not in notes and "2 kept of at most" in notes, notes
