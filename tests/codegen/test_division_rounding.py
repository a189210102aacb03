"""float32 divisions rounded as eager's: Triton's `/` on float32 compiles to div.full.f32 on NVIDIA GPUs, an
approximation up to 2 ulp off, where eager's kernels divide correctly rounded (IEEE). Generated kernels
divide with tl.math.div_rn (codegen/division.true_divide), so every quotient here is bit-exact with eager,
and an exact quotient stays exact (its floor is not one less). The interpreter's division was always
IEEE: on the CPU these pass either way; the CUDA cases are the ones that check the GPU's code."""
from __future__ import annotations

import pytest
import torch

from helpers import compile_fxopt

N = 1 << 14


def _operands(device):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(N, generator=g) * torch.exp2(torch.randint(-20, 20, (N,), generator=g).float())
    b = torch.randn(N, generator=g) * torch.exp2(torch.randint(-20, 20, (N,), generator=g).float())
    return a.to(device), b.to(device)


QUOTIENTS = {  # (on CUDA, eager's a / 3 is a * (1 / 3): its kernel multiplies by a scalar divisor's reciprocal)
    "a / b": lambda a, b: (a * 1) / b,
    "a / 3": lambda a, b: (a * 1) / 3.0,
    "a / 3 (fp16)": lambda a, b: (a * 1).half() / 3,
    "a / 0.1 (fp64)": lambda a, b: (a * 1).double() / 0.1,
    "reciprocal": lambda a, b: torch.reciprocal(a * 1),
    "a ** -1": lambda a, b: (a * 1) ** -1,
    "a ** -2": lambda a, b: (a * 1) ** -2,
}


@pytest.mark.parametrize("name", sorted(QUOTIENTS))
def test_float32_quotients_are_correctly_rounded(name, device):
    a, b = _operands(device)
    fn = QUOTIENTS[name]
    torch.testing.assert_close(compile_fxopt(fn)(a, b), fn(a, b), rtol=0, atol=0, equal_nan=True)


def test_exact_quotients_stay_exact(device):
    """floor((q * b) / b) is q: with an approximate division some came out one less."""
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-2000, 2000, (N,), generator=g).float()
    b = torch.randint(1, 5000, (N,), generator=g).float()
    a = q * b  # exact in float32 (|a| < 2^24)
    fn = lambda a, b: torch.floor((a * 1) / b)  # noqa: E731
    got = compile_fxopt(fn)(a.to(device), b.to(device))
    assert torch.equal(got.cpu(), q)


def test_generated_float32_divisions_are_div_rn():
    """CI has no GPU: the kernel text is where the CPU can see that no float32 `/` is left to Triton."""
    import fxopt
    a, b = _operands("cpu")
    rep = fxopt.explain(lambda a, b: (a * 1) / b + torch.reciprocal(b * 2), a, b)
    source = "\n".join(k.source for k in rep.kernels)
    assert source.count("tl.math.div_rn(") == 2, source


@pytest.mark.parametrize("dtype, expected", [(torch.float32, "(x * 0.3333333432674408)"),
                                             (torch.float64, "(x * 0.3333333333333333)")])
def test_gpu_divides_by_a_python_number_as_eager_does(dtype, expected):
    """CI has no GPU: the CUDA lowering's text. Eager's CUDA kernel multiplies by 1/b rounded to the compute
    dtype on the host; eager on the CPU divides, as the interpreter's kernels do."""
    from fxopt.codegen.division import lower_div
    from fxopt.codegen.pointwise_ops import LowerCtx
    gm = torch.fx.symbolic_trace(lambda x: torch.ops.aten.div.Tensor(x, 3.0))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert lower_div(LowerCtx("cuda", dtype, dtype), node, ["x", "3.0"]) == expected
    assert "x * " not in lower_div(LowerCtx("interpret", dtype, dtype), node, ["x", "3.0"])
