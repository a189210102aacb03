"""Column partials kept in the row output's last row blocks (fxopt/codegen/partials_in_output.py): the
norm backwards run without a workspace (rows kernel, combine, fix-up) and still equal float64 eager.

Runs in the Triton interpreter on CPU (and on CUDA where a GPU is present). COLUMN_PROGRAMS is lowered so
that every program walks several row blocks; the shapes pick XBLOCK 1-4 in the CPU configs.
"""
import os
import subprocess
import sys

import pytest
import torch
import torch._dynamo

from benchmarks.workloads_reduction import _rms_backward as rms_backward  # the hand-written RMSNorm's gradient
import fxopt
from fxopt.codegen import column_sums, triton_reduction
from tests.codegen.test_column_sums import ln_backward, ln_inputs
from tests.helpers import assert_close_to_reference, compile_fxopt, jit_kernels


@pytest.fixture
def column_config(monkeypatch):
    """Fix the row kernel's (XBLOCK, warps, programs), which otherwise differ between the CPU and CUDA
    configs, so that a test knows how many row blocks each program owns."""
    def fix(xblock, warps, programs):
        monkeypatch.setattr(triton_reduction.ReductionEmitter, "_column_config",
                            lambda self, x, w: (xblock, warps, programs))
    return fix


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
    return "partials in out" in kernel.schedule  # out<j>: the row output holding them


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_rmsnorm_backward_keeps_its_partials_in_dx(device, monkeypatch, column_config, dtype):
    column_config(2, 4, 8)  # 32 blocks of 2 rows, 4 per program; one block holds a 1024-float partial
    g = torch.Generator().manual_seed(0)
    dy, x = (torch.randn(64, 1024, generator=g).to(device, dtype) for _ in range(2))
    w = torch.randn(1024, generator=g).to(device, dtype)
    k = row_kernel(rms_backward, dy, x, w)
    assert hosted(k) and "ws_ptr" not in k.source and jit_kernels(k.source) == 3  # rows, combine, fix-up
    out = compile_fxopt(rms_backward)(dy, x, w)
    if dtype != torch.bfloat16 or device != "cpu":  # the interpreter truncates bf16 casts: see below
        assert_as_accurate_as_eager(out, rms_backward(dy, x, w), rms_reference(dy, x, w), dtype)
    again = compile_fxopt(rms_backward)(dy, x, w)
    assert all(torch.equal(a, b) for a, b in zip(out, again))  # the combine adds programs in a fixed order
    # against the workspace schedule: the same sums in the same order, so equal up to the rounding of
    # separately compiled code (the fix-up kernel may contract other products into FMAs than the rows
    # kernel); bit for bit in the interpreter, which contracts none
    torch._dynamo.reset()
    monkeypatch.setattr(column_sums, "hosting_plan", lambda *args: None)
    k = row_kernel(rms_backward, dy, x, w)
    assert not hosted(k) and "ws_ptr0" in k.source
    with_workspace = compile_fxopt(rms_backward)(dy, x, w)
    for a, b in zip(out, with_workspace):
        if device == "cpu":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("n,m,dtype,config,reserve", [(72, 512, torch.float32, (4, 4, 5), 1),
                                                      (40, 2048, torch.bfloat16, (1, 4, 8), 4)],
                         ids=["fp32-ragged-last-program", "bf16-four-blocks-each"])
def test_layernorm_backward_two_column_sums_in_dx(device, column_config, n, m, dtype, config, reserve):
    """dw and db: two partial rows per program; 72 rows in blocks of 4 over programs of 4 blocks leave
    the last program 2."""
    column_config(*config)
    args = ln_inputs(n, m, dtype, device)
    k = row_kernel(ln_backward, *args)
    assert hosted(k) and f"last {reserve} row block(s)" in k.schedule
    out = compile_fxopt(ln_backward)(*args)
    assert_as_accurate_as_eager(out, ln_backward(*args), ln_backward(*(t.double() for t in args)), dtype)


def test_a_program_with_too_few_blocks_keeps_the_workspace(device, column_config):
    """bf16 dx with two fp32 partial rows needs four one-row blocks per program; 33 rows over programs
    of 5 leave the last one 3: the kernel keeps its workspace (and the same results)."""
    column_config(1, 4, 8)
    args = ln_inputs(33, 2048, torch.bfloat16, device)
    k = row_kernel(ln_backward, *args)
    assert not hosted(k) and "ws_ptr1" in k.source
    out = compile_fxopt(ln_backward)(*args)
    assert_as_accurate_as_eager(out, ln_backward(*args), ln_backward(*(t.double() for t in args)), torch.bfloat16)


def test_the_workspace_stays_where_it_does_not_raise_the_peak(device, column_config):
    """Before the norm backward the graph held a 256 KiB matmul result; at the norm backward 128 KiB
    (dx) are live, so its 32 KiB of partials fit under the peak: the faster two-kernel schedule stays."""
    column_config(2, 4, 8)

    def after_a_bigger_buffer(dy, x, w, a):
        s = (a @ a).sum()  # (a @ a): an ATen result, freed after the sum
        dx, dw = rms_backward(dy, x, w)
        return dx, dw, s

    g = torch.Generator().manual_seed(2)
    dy, x = (torch.randn(64, 1024, generator=g).to(device, torch.float16) for _ in range(2))
    w, a = torch.randn(1024, generator=g).to(device, torch.float16), torch.randn(256, 256, generator=g).to(device)
    rep = fxopt.explain(after_a_bigger_buffer, dy, x, w, a)
    rows = [k for k in rep.kernels if k.kind == "reduction" and "column sum" in (k.schedule or "")]
    assert len(rows) == 1 and not hosted(rows[0]) and "ws_ptr0" in rows[0].source
    assert hosted(row_kernel(rms_backward, dy, x, w))  # alone, the norm backward is the peak
    out = compile_fxopt(after_a_bigger_buffer)(dy, x, w, a)
    ref = rms_reference(dy, x, w)
    assert_as_accurate_as_eager(out[:2], rms_backward(dy, x, w), ref, torch.float16)


def test_the_kernel_file_runs_all_three_launches(device, column_config, tmp_path):
    """The runnable file explain/dumps write for a kernel launches rows, combine and fix-up in order."""
    column_config(2, 4, 8)
    g = torch.Generator().manual_seed(3)
    dy, x = (torch.randn(64, 1024, generator=g).to(device) for _ in range(2))
    w = torch.randn(1024, generator=g).to(device)
    k = row_kernel(rms_backward, dy, x, w)
    assert hosted(k) and k.standalone.count("[(") >= 3 and "_fixup[" in k.standalone
    path = tmp_path / f"{k.name}.py"
    path.write_text(k.standalone)
    run = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TRITON_INTERPRET="1" if device == "cpu" else "0"))
    assert run.returncode == 0, run.stderr[-2000:]
