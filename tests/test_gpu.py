"""GPU-only checks: the real Triton compiler, libdevice lowerings and the bf16 fast-math error bound.

Marked `gpu`: skipped on CPU-only machines (CI); run on the GPU with `pytest -m gpu`.
"""
import pytest
import torch

from fxopt.analysis.op_classes import CUDA_ONLY_OPS  # noqa: F401 (documents what only runs here)

pytestmark = pytest.mark.gpu
aten = torch.ops.aten


@pytest.mark.parametrize("fn", [torch.tanh, torch.sigmoid])
def test_bf16_fast_math_error_is_within_bf16_rounding(fn):
    # tanh.approx.f32: rel. error <= 2^-10.99; bf16 rounding: <= 2^-8 relative. Stored result must
    # stay within their sum of the exact value, everywhere (including sigmoid's tail near 0).
    x = torch.linspace(-30, 30, 1 << 20, device="cuda", dtype=torch.bfloat16)
    got = torch.compile(lambda v: fn(v) * 1.0, backend="fxopt")(x)
    exact = fn(x.double())
    rel = ((got.double() - exact).abs() / exact.abs().clamp_min(1e-30)).max().item()
    assert rel <= 2**-8 + 2**-10.9, rel


def test_libdevice_only_ops_fuse_on_gpu_and_match_eager():
    import fxopt

    def f(x, y):
        return torch.tan(x) + torch.asin(x.clamp(-0.9, 0.9)) + torch.atan2(x, y) + torch.fmod(x, 0.7) \
            + torch.pow(x.abs() + 0.1, y) + torch.sinh(x) + torch.erfc(x)

    x, y = torch.rand(300, 7, device="cuda") - 0.5, torch.rand(7, device="cuda") + 0.5
    out = torch.compile(f, backend="fxopt")(x, y)
    torch.testing.assert_close(out, f(x, y), rtol=1e-5, atol=1e-5)
    rep = fxopt.explain(f, x, y)
    assert len(rep.kernels) == 1 and not [r for _, r in rep.fallbacks if "libdevice" in r]


def test_large_chain_bf16_matches_float64():
    import torch.nn.functional as F

    def chain(x, w, b):
        y = x * w + b
        y = F.gelu(y) * torch.sigmoid(x) + x
        return torch.tanh(y) * 0.5 + y * y

    x, w, b = (torch.randn(2048, 4099, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.compile(chain, backend="fxopt")(x, w, b)
    ref = chain(x.double(), w.double(), b.double())
    assert ((out.double() - ref).norm() / ref.norm()).item() < 4e-3


def test_report_says_how_long_triton_compiled_the_kernels():
    import fxopt

    x = torch.randn(64, 96, device="cuda")
    rep = fxopt.explain(lambda v: torch.softmax(v * 0.5, -1) + torch.sigmoid(v), x)
    g = rep.graphs[0]
    assert 0 < g.triton_compile_seconds <= g.compile_seconds
    assert "of it in Triton" in str(rep)
