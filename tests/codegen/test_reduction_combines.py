"""Independent row sums reduced together (fxopt/codegen/reduction_combines.py): the CUDA source of a
LayerNorm backward reduces its two row sums in one `tl.reduce` with a generated `_fx_sum2`; the
interpreter's source keeps separate `tl.sum`s (combine functions are GPU-only there). Numerics of the
batched form are checked on the GPU (here, and in test_column_sums's CUDA test)."""
import pytest
import torch

import fxopt.compile as compile_module
from fxopt.codegen import reduction_combines
from tests.helpers import assert_close_to_reference
from tests.codegen.test_column_sums import ln_backward, ln_inputs


def _reduction_sources(monkeypatch, fn, args, target: str) -> list[str]:
    """The sources fxopt generates for fn's reduction groups with `target`, compiled on the CPU."""
    original, sources = compile_module.generate_reduction_kernel, []

    def generate(sub, name, kernel_target):
        sources.append(original(sub, name, target).full_source())
        return original(sub, name, kernel_target)
    monkeypatch.setattr(compile_module, "generate_reduction_kernel", generate)
    torch._dynamo.reset()
    torch.compile(fn, backend="fxopt")(*args)
    return sources


def test_layer_norm_backward_sums_share_one_reduce_on_cuda(monkeypatch):
    (src,) = _reduction_sources(monkeypatch, ln_backward, ln_inputs(8, 64, torch.float32, "cpu"), "cuda")
    assert src.count("tl.reduce((") == 1 and "_fx_sum2)" in src and "def _fx_sum2(a0, a1, b0, b1):" in src
    assert "tl.sum(tl.where" not in src.split("_rows(")[1].split("column partials")[0]  # no row sum left alone


@pytest.mark.parametrize("how", ["interpret", "switched off"])
def test_sums_stay_separate_in_the_interpreter_or_when_switched_off(monkeypatch, how):
    if how == "switched off":
        monkeypatch.setattr(reduction_combines, "BATCH_SUMS", False)
    target = "interpret" if how == "interpret" else "cuda"
    (src,) = _reduction_sources(monkeypatch, ln_backward, ln_inputs(8, 64, torch.float32, "cpu"), target)
    assert "_fx_sum" not in src and src.count("tl.sum(tl.where") >= 2


def test_sum_combine_adds_pairwise():
    namespace = {"triton": type("T", (), {"jit": staticmethod(lambda f: f)})}
    exec(reduction_combines.sum_combine(3), namespace)
    assert namespace["_fx_sum3"](1, 2, 3, 10, 20, 30) == (11, 22, 33)


def _rms_backward(dy, x, w):
    h = x.float()
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    g = dy.float() * w.float()
    return rstd * g - h * rstd.pow(3) * (g * h).mean(-1, keepdim=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="combine functions run on the GPU only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_batched_sums_equal_float64(dtype):
    """RMSNorm backward written out (two independent means per row, one reduce) and LayerNorm backward on the GPU."""
    g = torch.Generator().manual_seed(0)
    dy, x, w = (torch.randn(*s, generator=g).to("cuda", dtype) for s in [(300, 1000), (300, 1000), (1000,)])
    got = torch.compile(_rms_backward, backend="fxopt")(dy, x, w)
    assert_close_to_reference(got, _rms_backward(dy.double(), x.double(), w.double()), dtype)
    args = ln_inputs(257, 768, dtype, "cuda")
    for got, want in zip(torch.compile(ln_backward, backend="fxopt")(*args), ln_backward(*(t.double() for t in args))):
        assert_close_to_reference(got, want, dtype)
