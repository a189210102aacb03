"""Column partials kept in the row output's last row blocks (fxopt/codegen/partials_in_output.py): the
norm backwards run without a workspace (rows kernel, combine, fix-up) and still equal float64 eager.

Runs in the Triton interpreter on CPU (and on CUDA where a GPU is present). COLUMN_PROGRAMS is lowered so
that every program walks several row blocks; the shapes pick XBLOCK 1-4 in the CPU configs.
"""
import pytest
import torch
import torch._dynamo

import fxopt
from fxopt.codegen import column_sums
from tests.codegen.test_column_sums import ln_backward, ln_inputs
from tests.helpers import assert_close_to_reference, compile_fxopt


def rms_backward(dy, x, w):
    """The gradient of a hand-written RMSNorm (fp32 inside, casts around) w.r.t. x and w."""
    h = x.float()
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    g = dy.float() * w.float()
    dx = rstd * g - h * rstd.pow(3) * (g * h).mean(-1, keepdim=True)
    dw = (dy.float() * (h * rstd).to(x.dtype).float()).sum(0)
    return dx.to(x.dtype), dw.to(w.dtype)


def rms_reference(dy, x, w):
    """rms_backward in float64, rounding x * rstd to x's dtype where rms_backward does."""
    h = x.double()
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    g = dy.double() * w.double()
    dx = rstd * g - h * rstd.pow(3) * (g * h).mean(-1, keepdim=True)
    return dx, (dy.double() * (h * rstd).to(x.dtype).double()).sum(0)


def assert_as_accurate_as_eager(out, eager, ref64, dtype):
    """Each output within the dtype's tolerance of float64, or no further from it than twice eager's
    own result in that dtype (bf16 column sums with cancellation: eager's error is the yardstick)."""
    for o, e, r in zip(out, eager, ref64):
        err, eager_err = (o.double() - r).abs().max().item(), (e.double() - r).abs().max().item()
        if err > 2 * eager_err:
            assert_close_to_reference(o, r, dtype)


def row_kernel(fn, *args):
    rep = fxopt.explain(fn, *args)
    rows = [k for k in rep.kernels if k.kind == "reduction"]
    assert len(rows) == 1, [k.name for k in rep.kernels]
    return rows[0]


def hosted(kernel) -> bool:
    return "partials in out0" in kernel.schedule


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_rmsnorm_backward_keeps_its_partials_in_dx(device, monkeypatch, dtype):
    monkeypatch.setattr(column_sums, "COLUMN_PROGRAMS", 8)
    g = torch.Generator().manual_seed(0)
    dy, x = (torch.randn(64, 1024, generator=g).to(device, dtype) for _ in range(2))
    w = torch.randn(1024, generator=g).to(device, dtype)
    k = row_kernel(rms_backward, dy, x, w)
    assert hosted(k) and "ws_ptr" not in k.source and k.source.count("@triton.jit") == 3  # rows, combine, fix-up
    out = compile_fxopt(rms_backward)(dy, x, w)
    if dtype != torch.bfloat16 or device != "cpu":  # the interpreter truncates bf16 casts: see below
        assert_as_accurate_as_eager(out, rms_backward(dy, x, w), rms_reference(dy, x, w), dtype)
    # the same programs add the same rows in the same order, the combine adds programs in order: the
    # results are those of the workspace schedule, bit for bit
    torch._dynamo.reset()
    monkeypatch.setattr(column_sums, "hosting_plan", lambda *args: None)
    k = row_kernel(rms_backward, dy, x, w)
    assert not hosted(k) and "ws_ptr0" in k.source
    with_workspace = compile_fxopt(rms_backward)(dy, x, w)
    assert all(torch.equal(a, b) for a, b in zip(out, with_workspace))


@pytest.mark.parametrize("n,m,dtype,reserve", [(72, 512, torch.float32, 1), (40, 2048, torch.bfloat16, 4)],
                         ids=["fp32-ragged-last-program", "bf16-four-blocks-each"])
def test_layernorm_backward_two_column_sums_in_dx(device, monkeypatch, n, m, dtype, reserve):
    """dw and db: two partial rows per program; the last program owns fewer blocks than the others."""
    monkeypatch.setattr(column_sums, "COLUMN_PROGRAMS", 8 if n == 40 else 5)
    args = ln_inputs(n, m, dtype, device)
    k = row_kernel(ln_backward, *args)
    assert hosted(k) and f"last {reserve} row block(s)" in k.schedule
    out = compile_fxopt(ln_backward)(*args)
    assert_as_accurate_as_eager(out, ln_backward(*args), ln_backward(*(t.double() for t in args)), dtype)


def test_a_program_with_too_few_blocks_keeps_the_workspace(device, monkeypatch):
    """bf16 dx with two fp32 partial rows needs four one-row blocks per program; 33 rows over programs
    of 5 leave the last one 3: the kernel keeps its workspace (and the same results)."""
    monkeypatch.setattr(column_sums, "COLUMN_PROGRAMS", 8)
    args = ln_inputs(33, 2048, torch.bfloat16, device)
    k = row_kernel(ln_backward, *args)
    assert not hosted(k) and "ws_ptr1" in k.source
    out = compile_fxopt(ln_backward)(*args)
    assert_as_accurate_as_eager(out, ln_backward(*args), ln_backward(*(t.double() for t in args)), torch.bfloat16)

