"""The branch-free erf fxopt uses for bf16/fp16 results (fxopt/codegen/erf_poly.py), in the Triton
interpreter: within 4 ulp of float64's erf over a dense grid in fp32, special values right, and GELU
through torch.compile rounding to the same bf16 values as eager almost everywhere."""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fxopt.codegen.erf_poly import CLAMP, GELU_CLAMP, SPLIT, erf_call, gelu_call, with_erf_helper
from tests.helpers import compile_fxopt

_KERNEL = '''@triton.jit
def {name}(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, i < n)
    tl.store(out_ptr + i, {call}, i < n)
'''


def load_kernel(tmp_path_factory, name: str, call: str):
    source = "import triton\nimport triton.language as tl\n\n\n" + with_erf_helper(
        _KERNEL.format(name=name, call=call), "interpret")
    path = tmp_path_factory.mktemp(name) / f"{name}.py"  # @triton.jit reads its source from a file
    path.write_text(source)
    namespace = {}
    exec(compile(source, str(path), "exec"), namespace)
    return namespace[name]


@pytest.fixture(scope="module")
def erf_kernel(tmp_path_factory):
    return load_kernel(tmp_path_factory, "erf_kernel", erf_call("x"))


@pytest.fixture(scope="module")
def gelu_kernel(tmp_path_factory):
    return load_kernel(tmp_path_factory, "gelu_kernel", gelu_call("x"))


def run(kernel, x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    return out


def test_within_four_ulp_of_float64(erf_kernel):
    x = torch.cat([torch.linspace(-6, 6, 120001), torch.logspace(-30, 0, 3001), -torch.logspace(-30, 0, 3001),
                   torch.tensor([SPLIT, -SPLIT, CLAMP, -CLAMP, math.nextafter(SPLIT, 0), 0.0, -0.0])]).float()
    got = run(erf_kernel, x).double()
    want = torch.erf(x.double())
    ulp = torch.finfo(torch.float32).eps * torch.clamp(want.abs(), min=torch.finfo(torch.float32).tiny)
    worst = ((got - want).abs() / ulp).max().item()
    assert worst <= 4.0, worst
    assert torch.equal(torch.signbit(got[x == 0]), torch.signbit(x[x == 0]))  # erf(-0) = -0


def test_special_values(erf_kernel):
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 4.5, -4.5])
    got = run(erf_kernel, x)
    assert math.isnan(got[0])
    assert got[1:].tolist() == [1.0, -1.0, 1.0, -1.0, 1.0, -1.0]


def test_gelu_close_to_float64_in_fp32(gelu_kernel):
    """The GELU helper: within 1e-5 relative of float64 where |x| < 3 (16-bit results cannot see that),
    within 1e-5 absolute everywhere, exact zero past the clamp on the negative side."""
    x = torch.cat([torch.linspace(-9, 9, 180001), torch.logspace(-30, 0, 3001), -torch.logspace(-30, 0, 3001),
                   torch.tensor([GELU_CLAMP, -GELU_CLAMP, 0.0, -0.0])]).float()
    got = run(gelu_kernel, x).double()
    want = F.gelu(x.double())
    inner = x.abs() < 3
    rel = ((got - want).abs() / want.abs().clamp(min=1e-300))[inner & (x != 0)]
    assert rel.max().item() <= 1e-5, rel.max().item()
    assert (got - want).abs().max().item() <= 1e-5
    assert torch.equal(got[x <= -GELU_CLAMP], torch.zeros_like(got[x <= -GELU_CLAMP]))
    assert torch.equal(torch.signbit(got[x == 0]), torch.signbit(x[x == 0]))  # GELU(-0) = -0


def test_gelu_special_values(gelu_kernel):
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30])
    got = run(gelu_kernel, x)
    # float64's GELU: NaN, inf, NaN (-inf * 0, as eager's formula), 1e30, -0 (CPU eager says NaN for inf)
    assert got.isnan().tolist() == [True, False, True, False, False]
    assert got[1].item() == float("inf") and got[3].item() == x[3].item() and got[4].item() == 0.0


def test_fp16_gelu_as_accurate_as_eager():
    """GELU through torch.compile against float64, next to eager's own fp32 erf rounded to fp16 (fp16:
    the interpreter rounds fp32 -> fp16 correctly; its fp32 -> bf16 conversion truncates). Both lose
    relative accuracy where 1 + erf(x) cancels (x < -2: eager's worst is ~1000 fp16 ulp at x = -5.5);
    fxopt's may not be worse than eager's, at worst or on average."""
    torch.manual_seed(0)
    x = (torch.randn(64, 1000) * 3).half()
    got = compile_fxopt(lambda x: F.gelu(x))(x).double()
    eager = F.gelu(x.float()).half().double()
    ref = F.gelu(x.double())
    ulp = torch.finfo(torch.float16).eps * torch.clamp(ref.abs(), min=2.0 ** -24)
    ours, theirs = (got - ref).abs() / ulp, (eager - ref).abs() / ulp
    assert ours.max().item() <= theirs.max().item() + 1.0, (ours.max().item(), theirs.max().item())
    assert ours[x.abs() < 2].max().item() <= 1.0  # no cancellation there: correctly rounded or one ulp off
    assert ours.mean().item() <= 1.1 * theirs.mean().item(), (ours.mean().item(), theirs.mean().item())


def test_precision_policy_of_fp32_values_inside_16_bit_kernels():
    """fp32 intermediates of a kernel whose outputs are all 16-bit (a bf16 softmax's upcast exp) use
    Triton's exp and the branch-free erf; sin/cos keep libdevice (large angles), tanh.approx stays for
    bf16 results only; kernels with an fp32 output keep libdevice."""
    from fxopt.codegen.pointwise_ops import LOWERINGS, LowerCtx
    aten = torch.ops.aten
    f32, bf16 = torch.float32, torch.bfloat16
    inside = LowerCtx("cuda", f32, f32, bf16)
    plain = LowerCtx("cuda", f32, f32, None)
    lower = lambda op, c: LOWERINGS[op](c, None, ["x"])  # noqa: E731
    assert lower(aten.exp.default, inside) == "tl.exp(x)" and lower(aten.exp.default, plain) == "libdevice.exp(x)"
    assert lower(aten.erf.default, inside) == "_fx_erf(x)" and lower(aten.erf.default, plain) == "libdevice.erf(x)"
    gelu = lambda c: LOWERINGS[aten.gelu.default](c, SimpleNamespace(kwargs={}), ["x"])  # noqa: E731
    assert gelu(inside) == "_fx_gelu(x)" and "libdevice.erf" in gelu(plain)
    assert lower(aten.sin.default, inside) == "libdevice.sin(x)"
    assert not inside.approx_ok and LowerCtx("cuda", bf16, f32).approx_ok
