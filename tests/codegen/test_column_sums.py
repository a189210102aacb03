"""Column sums fused into the row kernel (fxopt/codegen/column_sums.py): LayerNorm and RMSNorm backward
compute dx, dw and db in one row kernel plus a small combine kernel, against float64 eager.

Runs in the Triton interpreter on CPU (and on CUDA where a GPU is present). COLUMN_PROGRAMS is lowered
so that every program walks several row blocks and the last one runs past the end of the rows.
"""
import pytest
import torch
import torch.nn.functional as F

import fxopt
from fxopt.analysis import reductions
from fxopt.codegen import column_sums
from tests.helpers import assert_close_to_reference, compile_fxopt, jit_kernels


@pytest.fixture(params=[3, 512], ids=["3-programs", "default-programs"])
def programs(request, monkeypatch):
    monkeypatch.setattr(column_sums, "COLUMN_PROGRAMS", request.param)
    return request.param


def ln_backward(dy, x, mean, rstd, w, b):
    return torch.ops.aten.native_layer_norm_backward(dy, x, [x.shape[-1]], mean, rstd, w, b, [True, True, True])


def ln_inputs(n, m, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, w, b, dy = (torch.randn(*s, generator=g).to(device, dtype) for s in [(n, m), (m,), (m,), (n, m)])
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [m], w, b, 1e-5)
    return dy, x, mean, rstd, w, b


def backward_kernels(fn, *args):
    rep = fxopt.explain(fn, *args)
    return [k for k in rep.kernels if k.graph in ("forward", "inference", "backward")], rep


def full_size_intermediates(rep, shape):
    fused = rep.graph(after="fuse")
    return [node for node in fused.graph.nodes if node.op == "call_module"
            and any(isinstance(v, torch.Tensor) and tuple(v.shape) == shape
                    for v in (node.meta["val"] if isinstance(node.meta.get("val"), tuple) else [node.meta.get("val")]))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n,m", [(37, 100), (5, 29)])
def test_layernorm_backward_is_one_row_kernel_with_column_sums(device, programs, n, m, dtype):
    args = ln_inputs(n, m, dtype, device)
    out = compile_fxopt(ln_backward)(*args)
    ref = ln_backward(*(t.double() for t in args))
    for o, r in zip(out, ref):
        assert o.shape == r.shape and o.dtype == dtype
        assert_close_to_reference(o, r, dtype)
    ks, rep = backward_kernels(ln_backward, *args)
    rows = [k for k in ks if k.kind == "reduction"]
    assert len(rows) == 1, [k.name for k in ks]  # dx, dw and db: one row kernel (+ its combine step)
    assert "2 column sum(s)" in rows[0].schedule  # dw and db
    assert jit_kernels(rows[0].source) == 2 and "ws_ptr1" in rows[0].source  # rows, then combine
    # besides it at most the cast of w to fp32 (16-bit inputs), a pointwise kernel over [m]
    assert all(k.kind == "pointwise" and k.ops == ["aten._to_copy.default"] for k in ks if k is not rows[0])


def test_rmsnorm_training_gradients_equal_eager(device, programs):
    """A hand-written RMSNorm's weight gradient is a column sum of the backward's row values."""
    def rmsnorm(x, w):
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w

    x = torch.randn(3, 11, 48, device=device, requires_grad=True)
    w = torch.randn(48, device=device, requires_grad=True)
    dy = torch.randn(3, 11, 48, device=device)
    grads = torch.autograd.grad(compile_fxopt(rmsnorm)(x, w), (x, w), dy)
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    ref = torch.autograd.grad(rmsnorm(x64, w64), (x64, w64), dy.double())
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-5)
    rep = fxopt.explain(rmsnorm, x, w)
    bwd = [k for k in rep.kernels if k.graph == "backward"]
    assert len(bwd) == 1 and "column sum" in bwd[0].schedule  # dx (through autograd's expand) and dw


def test_layer_norm_module_training_gradients_equal_eager(device):
    ln = torch.nn.LayerNorm(40).to(device)
    torch.nn.init.normal_(ln.weight)
    torch.nn.init.normal_(ln.bias)
    x = torch.randn(2, 9, 40, device=device, requires_grad=True)
    dy = torch.randn(2, 9, 40, device=device)
    got = torch.autograd.grad(compile_fxopt(lambda x: F.gelu(ln(x)))(x), (x, ln.weight, ln.bias), dy)
    ln64 = torch.nn.LayerNorm(40).double().to(device)
    ln64.load_state_dict(ln.state_dict())
    x64 = x.detach().double().requires_grad_()
    ref = torch.autograd.grad(F.gelu(ln64(x64)), (x64, ln64.weight, ln64.bias), dy.double())
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-5)


def test_keepdim_column_sum_and_its_consumer(device, programs):
    """sum(..., 0, keepdim=True) and an op that uses the column sum (run after the kernel, outside it);
    square rows (n == m) where a [m] value could be mistaken for a row scalar."""
    def fn(x, w):
        y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5)
        col = (y * w).sum(0, keepdim=True)
        return y * 2, col, col * 3 + (y * w).sum(0).sin()

    for n, m in [(24, 24), (7, 30)]:
        x, w = torch.randn(n, m, device=device), torch.randn(m, device=device)
        out = compile_fxopt(fn)(x, w)
        ref = fn(x.double(), w.double())
        for o, r in zip(out, ref):
            assert o.shape == r.shape
            torch.testing.assert_close(o.double(), r, rtol=1e-4, atol=1e-5)


def test_rows_too_wide_for_registers_keep_separate_column_kernels(device, monkeypatch):
    monkeypatch.setattr(reductions, "ROW_IN_REGISTERS", 16)
    args = ln_inputs(6, 40, torch.float32, device)
    ks, rep = backward_kernels(ln_backward, *args)
    assert not any("column sum" in (k.schedule or "") for k in ks)
    assert len(ks) > 1
    out = compile_fxopt(ln_backward)(*args)
    for o, r in zip(out, ln_backward(*(t.double() for t in args))):
        torch.testing.assert_close(o.double(), r, rtol=1e-4, atol=1e-5)


def test_no_full_size_fp32_product_goes_through_memory(device):
    """The [N, M] product dy * x_hat that dw sums is never a kernel output."""
    args = ln_inputs(12, 40, torch.bfloat16, device)
    _, rep = backward_kernels(ln_backward, *args)
    assert len(full_size_intermediates(rep, (12, 40))) == 1  # only the kernel that writes dx


def test_rows_read_across_strides(device):
    """x and dy transposed views (the row kernel reads its rows strided): still one row kernel with
    one row per step, and right."""
    n, m = 24, 40
    dy, x, mean, rstd, w, b = ln_inputs(n, m, torch.float32, device)
    dy_t, x_t = dy.t().contiguous().t(), x.t().contiguous().t()
    args = (dy_t, x_t, mean, rstd, w, b)
    out = compile_fxopt(ln_backward)(*args)
    for o, r in zip(out, ln_backward(*(t.double() for t in args))):
        torch.testing.assert_close(o.double(), r, rtol=1e-4, atol=1e-5)
    ks, _ = backward_kernels(ln_backward, *args)
    assert any("column sum" in (k.schedule or "") for k in ks)


@pytest.mark.parametrize("stages", [2, 3])
def test_a_software_pipelined_row_loop_gives_the_same_sums(device, monkeypatch, stages):
    """COLUMN_STAGES > 1 runs the row loop through tl.range(num_stages=...) (cp.async prefetch on a GPU)."""
    monkeypatch.setattr(column_sums, "COLUMN_PROGRAMS", 3)
    monkeypatch.setattr(column_sums, "COLUMN_STAGES", stages)
    args = ln_inputs(37, 100, torch.float16, device, seed=1)
    ks, _ = backward_kernels(ln_backward, *args)
    assert any(f"num_stages={stages}" in k.source for k in ks)
    out = compile_fxopt(ln_backward)(*args)
    for o, r in zip(out, ln_backward(*(t.double() for t in args))):
        assert_close_to_reference(o, r, torch.float16)


def test_symbolic_row_count_keeps_column_sums_in_the_row_kernel(device, programs):
    """dynamic=True, LayerNorm of a static width over a symbolic number of rows: the backward still
    computes dw and db as column sums of its row kernel (a fixed number of programs, XSTEPS per call),
    one compilation for row counts below, at and well above the programs' rows."""
    from tests.helpers import CountingBackend

    torch.manual_seed(0)
    ln = torch.nn.LayerNorm(48).to(device)
    torch.nn.init.normal_(ln.weight)
    torch.nn.init.normal_(ln.bias)
    ln64 = torch.nn.LayerNorm(48).double().to(device)
    ln64.load_state_dict(ln.state_dict())
    backend = CountingBackend()
    compiled = torch.compile(ln, backend=backend, dynamic=True)
    for rows in (37, 300, 5):
        x = torch.randn(rows, 48, device=device, requires_grad=True)
        dy = torch.randn(rows, 48, device=device)
        got = torch.autograd.grad(compiled(x), (x, ln.weight, ln.bias), dy)
        x64 = x.detach().double().requires_grad_()
        ref = torch.autograd.grad(ln64(x64), (x64, ln64.weight, ln64.bias), dy.double())
        for g, r in zip(got, ref):
            torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-4)
    assert backend.calls <= 2  # dynamo may call the backend twice on the very first call
    bwd = [k for k in backend.report.kernels if k.graph == "backward"]
    assert len(bwd) == 1 and "column sum(s) over XSTEPS" in bwd[-1].schedule, [k.schedule for k in bwd]


def test_per_call_xsteps_is_rechecked_at_every_launch(monkeypatch):
    """XSTEPS of a symbolic row count is source the wrapper evaluates per call; it can be 1 at one call
    (Triton specialises an int equal to 1) and more at the next, so the fast launcher must re-check it
    (on the H200 it was reused: rows past the first step were never computed)."""
    import fxopt.compile as compile_module
    from fxopt.codegen.wrapper_layouts import launch_checks
    from tests.helpers import CountingBackend

    seen = []

    def recording(gm, kernels, launched):
        checks = launch_checks(gm, kernels, launched)
        seen.append((kernels, checks))
        return checks
    monkeypatch.setattr(compile_module, "launch_checks", recording)
    ln = torch.nn.LayerNorm(48)
    compiled = torch.compile(ln, backend=CountingBackend(), dynamic=True)
    compiled(torch.randn(37, 48, requires_grad=True)).sum().backward()
    rows = [(k, checks) for kernels, checks in seen for kernel in kernels.values()
            for k in (kernel.prologue,) if k is not None and k.name.endswith("_rows")]
    assert rows, "no column-sum row kernel"
    (kernel, checks), = rows
    first_int = len(kernel.inputs) + len(kernel.workspaces) + len(kernel.outputs)
    xsteps = first_int + [j for j, v in enumerate(kernel.int_args) if isinstance(v, str)][0]
    assert xsteps in checks[kernel.name]


def test_symbolic_row_length_keeps_column_sums_with_blocks_chosen_per_call(device, programs):
    """dynamic=True over LayerNorm backward's own op (every dim symbolic, as in the benchmark): the row
    length is symbolic too, so RBLOCK, XBLOCK and warps are chosen per call (the whole row in one
    block, no bounds test where the row fills it: EVEN_R); one compilation for rows of 48, 130, 1000,
    17 and 64 elements, all against float64."""
    from tests.helpers import CountingBackend

    backend = CountingBackend()
    compiled = torch.compile(ln_backward, backend=backend, dynamic=True)
    for n, m in [(37, 48), (300, 130), (5, 1000), (64, 17), (20, 64)]:
        args = ln_inputs(n, m, torch.float32, device, seed=n)
        got = compiled(*args)
        want = ln_backward(*(t.double() for t in args))
        for g, r in zip(got, want):
            torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-4)
    assert backend.calls == 1
    (kernel,) = backend.report.kernels
    assert "column sum(s) over XSTEPS x XBLOCK (per call)" in kernel.schedule


def test_a_row_past_tritons_largest_block_is_a_clear_error():
    from fxopt.codegen.wrapper_runtime import WHOLE_ROW_MAX, whole_row_block

    assert whole_row_block(1000, "k") == 1024 and whole_row_block(WHOLE_ROW_MAX, "k") == WHOLE_ROW_MAX
    with pytest.raises(RuntimeError, match="mark_static"):
        whole_row_block(WHOLE_ROW_MAX + 1, "k")


def test_row_kernel_registers_are_capped_so_two_programs_share_an_sm():
    """COLUMN_PROGRAMS assumes two row-kernel programs per SM; the launch caps registers (maxnreg) so
    they fit: 64 per thread at 16 warps, computed per call where the warps are (symbolic row length).
    Without it triton 3.6 gave the dynamic LayerNorm backward 88 registers: one program per SM."""
    from tests.helpers import CountingBackend

    assert column_sums.register_cap(16) == 64 and column_sums.register_cap(8) == 128
    assert column_sums.register_cap(4) is None  # 256 would be past the 255 a thread can have
    assert eval(column_sums.register_cap("16")) == 64 and eval(column_sums.register_cap("2")) == 255
    backend = CountingBackend()
    compiled = torch.compile(ln_backward, backend=backend, dynamic=True)
    args = ln_inputs(37, 48, torch.float32, "cpu")
    got, want = compiled(*args), ln_backward(*(t.double() for t in args))
    for g, r in zip(got, want):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-4)
    launch = [line for line in backend.report.wrapper_source.splitlines() if "_rows[" in line]
    assert len(launch) == 1 and "maxnreg=min(255, 65536 // (2 * 32 * (" in launch[0], launch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="registers are ptxas's: GPU only")
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_cuda_row_kernel_keeps_to_its_register_cap(dynamic):
    from fxopt.codegen import fast_launch

    compiled = torch.compile(ln_backward, backend="fxopt", dynamic=dynamic)
    args = ln_inputs(1024, 4096, torch.bfloat16, "cuda")  # 8 warps: a cap of 128
    got, want = compiled(*args), ln_backward(*(t.double() for t in args))
    for g, r in zip(got, want):
        assert_close_to_reference(g, r, torch.bfloat16)
    regs = [(k.n_regs, k.metadata.num_warps) for fk in list(fast_launch.ALL) if fk.fn.__name__.endswith("_rows")
            for k, _, _ in fk._compiled.values()]
    assert regs and all(column_sums.register_cap(w) is None or n <= column_sums.register_cap(w) for n, w in regs), regs
