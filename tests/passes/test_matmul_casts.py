"""passes/matmul_casts.py: a 16-bit mm read only by casts to float32 becomes mm(..., out_dtype=float32)
on CUDA graphs (no cast kernel, no rounding before the cast); anything else is left alone.

Structure is checked on the CPU with fake CUDA tensors (the op has no CPU kernel); the numerics of
the folded matmul run on the GPU (marked gpu)."""
import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import fxopt
from fxopt.options import Environment, Options
from fxopt.pass_manager import PassContext
from fxopt.passes.matmul_casts import FoldMatmulCasts

aten = torch.ops.aten
pytestmark = pytest.mark.skipif(not hasattr(aten.mm, "dtype"), reason="torch without aten.mm.dtype")


def _graph(fn, *shapes, dtype=torch.bfloat16, device="cuda"):
    with FakeTensorMode():
        args = [torch.empty(s, dtype=dtype, device=device) for s in shapes]
        return make_fx(fn)(*args)


def _run(gm, target="cuda"):
    return FoldMatmulCasts()(gm, PassContext(Options(), Environment(), target=target))


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_a_gradient_cast_up_becomes_one_float32_matmul():
    gm = _graph(lambda a, b: torch.mm(a.t(), b).float(), (64, 32), (64, 16))
    result = _run(gm)
    assert result.stats == {"folded": 1}
    targets = _targets(result.gm)
    assert aten.mm.dtype in targets and aten.mm.default not in targets and aten._to_copy.default not in targets
    out = [n for n in result.gm.graph.nodes if n.op == "output"][0].args[0]
    assert out.meta["val"].dtype == torch.float32 and tuple(out.meta["val"].shape) == (32, 16)


@pytest.mark.parametrize("case", ["other_user", "to_fp16", "fp32_inputs", "cpu_graph", "cpu_tensors"])
def test_anything_else_is_left_alone(case):
    fn = lambda a, b: torch.mm(a, b).float()  # noqa: E731
    kw = {}
    if case == "other_user":
        def fn(a, b):
            m = torch.mm(a, b)
            return m.float(), m * 2  # the 16-bit result is needed too
    elif case == "to_fp16":
        fn = lambda a, b: torch.mm(a, b).half()  # noqa: E731
    elif case == "fp32_inputs":
        kw = dict(dtype=torch.float32)
        fn = lambda a, b: torch.mm(a, b).double()  # noqa: E731
    elif case == "cpu_tensors":
        kw = dict(device="cpu")
    gm = _graph(fn, (8, 8), (8, 8), **kw)
    result = _run(gm, target="interpret" if case == "cpu_graph" else "cuda")
    assert result.stats == {"folded": 0} and aten.mm.dtype not in _targets(result.gm)


@pytest.mark.gpu
def test_mixed_precision_linear_gradients_come_out_of_one_matmul():
    lin = nn.Linear(256, 128, device="cuda")
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    rep = fxopt.explain(lambda x: lin(x).square().sum(), x, precision="bf16")
    backward = [g for g in rep.graphs if g.name == "backward"][0].wrapper_source
    assert "aten.mm.dtype" in backward
    compiled = torch.compile(lambda x: lin(x).square().sum(), backend=fxopt.backend(precision="bf16"))
    compiled(x).backward()
    got = lin.weight.grad.clone()
    lin.weight.grad = None
    lin64 = nn.Linear(256, 128, device="cuda", dtype=torch.float64)
    lin64.load_state_dict(lin.state_dict())
    lin64(x.detach().double()).square().sum().backward()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lin(x).square().sum().backward()
    err = (got.double() - lin64.weight.grad).norm() / lin64.weight.grad.norm()
    autocast_err = (lin.weight.grad.double() - lin64.weight.grad).norm() / lin64.weight.grad.norm()
    assert got.dtype == torch.float32 and err <= 1.5 * autocast_err
