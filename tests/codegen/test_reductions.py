"""Reduction fusion: one kernel per row-wise operation, numerically equal to float64 eager.

Runs in the Triton interpreter on CPU (and on CUDA where a GPU is present, via the `device` fixture).
Shapes are small; widths are odd so masks are exercised; `PERSISTENT_MAX` is lowered in some tests so
that the looped (long-row) kernels run at interpreter-friendly sizes.
"""
import pytest
import torch
import torch.nn.functional as F

import fxopt
from fxopt.analysis import reductions
from fxopt.codegen import reduction_schedules, triton_reduction
from tests.helpers import assert_close_to_reference, compile_fxopt

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def kernels(fn, *args):
    rep = fxopt.explain(fn, *args)
    return [k for k in rep.kernels if k.graph in ("forward", "inference")], rep


def check(fn, *args, dtype=torch.float32):
    out = compile_fxopt(fn)(*args)
    ref = fn(*[a.double() if isinstance(a, torch.Tensor) and a.dtype.is_floating_point else a for a in args])
    assert_close_to_reference(out, ref, dtype)


@pytest.fixture(params=["persistent", "looped", "split", "strided"])
def schedule(request, monkeypatch):
    """Force each schedule at small sizes: looped rows of 8-element blocks; split cuts them in chunks;
    strided: looped kernels of 4 programs striding over more row tiles, passes that
    re-read a row alternating direction."""
    if request.param != "persistent":
        monkeypatch.setattr(triton_reduction, "PERSISTENT_MAX", 16)
        monkeypatch.setattr(triton_reduction, "LOOP_RBLOCK", 8)
    if request.param == "strided":
        monkeypatch.setattr(reduction_schedules, "STRIDED_CONFIG", (8, 2))
        monkeypatch.setattr(reduction_schedules, "STRIDED_MIN_BLOCKS", 2)
        monkeypatch.setattr(reduction_schedules, "STRIDED_PROGRAMS", 4)  # on a GPU too
    monkeypatch.setattr(triton_reduction, "SPLIT_PROGRAMS", 64 if request.param == "split" else 0)
    monkeypatch.setattr(triton_reduction, "SPLIT_MIN_BLOCKS", 1)
    return request.param


def softmax_scaled(x):
    return torch.softmax(x * 0.125, -1)


def ln_gelu(x, r, w, b):
    return F.gelu(F.layer_norm(x + r, (x.shape[-1],), w, b))


def rmsnorm(x, w):
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_is_one_kernel(device, dtype, schedule):
    x = torch.randn(7, 37, device=device, dtype=dtype)
    ks, _ = kernels(softmax_scaled, x)
    # softmax writes a row output after its reductions: the split form would re-read the row, so
    # fxopt keeps it looped (two passes) even when splitting is allowed
    expected = "looped" if schedule == "split" else schedule
    assert len(ks) == 1 and ks[0].kind == "reduction" and ks[0].schedule.startswith(expected)
    assert {"aten.amax.default", "aten.exp.default", "aten.sum.dim_IntList"} <= set(ks[0].ops)
    if schedule == "strided":  # programs stride over row tiles; the second pass walks the row backwards
        assert "for xtile in range(tl.program_id(0), 7, tl.num_programs(0))" in ks[0].source
        assert "for rstep in range(0, rnumel, RBLOCK)" in ks[0].source and "evict_first" in ks[0].source
    check(softmax_scaled, x, dtype=dtype)


def test_softmax_with_masked_entries_matches_eager(device, schedule):
    x = torch.randn(5, 41, device=device)
    mask = torch.rand(5, 41, device=device) < 0.5
    mask[:, 0] = False
    mask[3] = True  # a fully masked row: eager gives NaN, so must we

    def masked(x, mask):
        return torch.softmax(x.masked_fill(mask, float("-inf")), -1)

    out = compile_fxopt(masked)(x, mask)
    ref = masked(x.double(), mask)
    assert torch.isnan(out[3]).all() and torch.isnan(ref[3]).all()
    torch.testing.assert_close(out[[0, 1, 2, 4]].double(), ref[[0, 1, 2, 4]], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_layernorm_gelu_is_one_kernel(device, dtype, schedule):
    args = (torch.randn(6, 45, device=device, dtype=dtype), torch.randn(6, 45, device=device, dtype=dtype),
            torch.randn(45, device=device, dtype=dtype), torch.randn(45, device=device, dtype=dtype))
    ks, _ = kernels(ln_gelu, *args)
    assert len(ks) == 1 and ("aten.erf.default" in ks[0].ops or "aten.gelu.default" in ks[0].ops)
    check(ln_gelu, *args, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_handwritten_rmsnorm_is_one_kernel(device, dtype, schedule):
    x, w = torch.randn(3, 5, 33, device=device, dtype=dtype), torch.randn(33, device=device, dtype=dtype)
    ks, _ = kernels(rmsnorm, x, w)
    assert len(ks) == 1 and "aten.rsqrt.default" in ks[0].ops
    check(rmsnorm, x, w, dtype=dtype)


@pytest.mark.parametrize("dim,keepdim", [(-1, True), (-1, False), (0, True), (0, False), (1, False), ((0, 2), True)])
def test_sum_mean_amax_amin_over_any_dim(device, dim, keepdim, schedule):
    x = torch.randn(9, 6, 19, device=device)

    def f(x):
        return ((x * 2).sum(dim, keepdim=keepdim), x.mean(dim, keepdim=keepdim),
                x.amax(dim, keepdim=keepdim), (-x).amin(dim, keepdim=keepdim))

    check(f, x)


def test_full_reduction_to_a_scalar_and_integer_sums(device):
    x = torch.randn(13, 11, device=device)
    check(lambda x: (x * x).sum() / x.numel(), x)
    i = torch.randint(-5, 5, (7, 9), device=device, dtype=torch.int32)
    out = compile_fxopt(lambda i: (i * 3).sum(-1))(i)
    assert out.dtype == torch.int64 and torch.equal(out, (i * 3).sum(-1))


def logsumexp(x):
    m = x.amax(-1, keepdim=True)
    return (x - m).exp().sum(-1, keepdim=True).log() + m


def test_logsumexp_uses_the_online_pair_in_every_schedule(device, schedule):
    x = torch.randn(5, 43, device=device) * 4
    x[2, :20] = float("-inf")
    ks, _ = kernels(logsumexp, x)
    assert len(ks) == 1 and ks[0].schedule.startswith(schedule)
    assert "acc_amax" in ks[0].source or schedule == "persistent"  # max and sum share one pass
    out = compile_fxopt(logsumexp)(x)
    torch.testing.assert_close(out.double(), torch.logsumexp(x.double(), -1, keepdim=True), rtol=1e-5, atol=1e-5)


def test_online_softmax_infinities_and_max_jumps_match_eager(device, schedule):
    """The online pass spends one exp per element (exp(-|m_old - x|), the other factor being 1): rows whose
    max climbs or falls in every block, -inf prefixes and whole -inf rows, and +inf entries (NaN rows in
    eager: exp(inf - inf)) must come out as eager's float64."""
    x = torch.randn(8, 45, device=device) * 3
    x[0] = torch.linspace(-30, 30, 45, device=device)  # the max grows at every element
    x[1] = torch.linspace(30, -30, 45, device=device)  # set by the first element, never again
    x[2, :30] = float("-inf")
    x[3] = float("-inf")
    x[4, 40] = float("inf")
    x[5, 2], x[5, 44] = float("inf"), float("-inf")
    x[6, ::2] = float("-inf")
    for fn in (lambda t: torch.softmax(t, -1), lambda t: torch.log_softmax(t, -1), logsumexp):
        out = compile_fxopt(fn)(x)
        torch.testing.assert_close(out.double(), fn(x.double()), rtol=1e-5, atol=1e-5, equal_nan=True)


def test_log_softmax_and_nan_propagation(device, schedule):
    x = torch.randn(4, 30, device=device)
    x[1, 3] = float("nan")
    out = compile_fxopt(lambda x: torch.log_softmax(x, -1))(x)
    ref = torch.log_softmax(x.double(), -1)
    assert torch.isnan(out[1]).all()
    torch.testing.assert_close(out[[0, 2, 3]].double(), ref[[0, 2, 3]], rtol=1e-5, atol=1e-5)
    assert torch.isnan(compile_fxopt(lambda x: x.amax(-1))(x)[1])


def test_empty_rows_match_eager(device):
    x = torch.randn(0, 5, device=device)
    torch.testing.assert_close(compile_fxopt(lambda x: x.sum(-1) + 1)(x), x.sum(-1) + 1)
    y = torch.randn(3, 0, device=device)
    torch.testing.assert_close(compile_fxopt(lambda y: (y * 2).sum(-1))(y), torch.zeros(3, device=device))
    rep = fxopt.explain(lambda y: (y * 2).sum(-1), y)
    assert any("empty" in r for _, r in rep.fallbacks)


def test_variance_of_a_zero_dim_tensor_over_dim_0_or_minus_1(device):
    """Eager accepts var(0) / std(-1) of a 0-d tensor (NaN with correction 1, 0 without); fxopt's var
    decomposition took `dim % x.dim()` and crashed with a modulo by zero."""
    x = torch.tensor(1.5, device=device)
    fn = lambda t: ((t * 2).var(0), (t * 2).std(-1, keepdim=True, correction=0))  # noqa: E731
    for got, want in zip(compile_fxopt(fn)(x), fn(x.double())):
        assert got.shape == want.shape
        torch.testing.assert_close(got.double(), want, equal_nan=True)


@pytest.mark.parametrize("which", ["layernorm", "rmsnorm", "softmax", "log_softmax"])
def test_backward_fuses_and_gradients_equal_eager(device, which, schedule):
    torch.manual_seed(0)
    x = torch.randn(6, 29, device=device, requires_grad=True)
    w = torch.randn(29, device=device, requires_grad=True)
    b = torch.randn(29, device=device, requires_grad=True)
    fns = {"layernorm": lambda x, w, b: F.layer_norm(x, (29,), w, b),
           "rmsnorm": lambda x, w, b: rmsnorm(x, w) + b,
           "softmax": lambda x, w, b: torch.softmax(x * w, -1) + b,
           "log_softmax": lambda x, w, b: torch.log_softmax(x + b, -1) * w}
    fn = fns[which]
    dy = torch.randn(6, 29, device=device)
    out = compile_fxopt(fn)(x, w, b)
    grads = torch.autograd.grad(out, (x, w, b), dy)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = torch.autograd.grad(fn(x64, w64, b64), (x64, w64, b64), dy.double())
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-5)
    rep = fxopt.explain(fn, x, w, b)
    bwd = [k for k in rep.kernels if k.graph == "backward"]
    assert any(k.kind == "reduction" for k in bwd)
    assert not [r for _, r in rep.fallbacks if "reduction" in r]  # every reduction was fused


def test_layernorm_backward_column_sums_recompute_instead_of_reloading(device, monkeypatch):
    """dw and db are sums over the rows; where the rows are too wide for the row kernel to take them
    (codegen/column_sums.py), their kernel recomputes x_hat from x, mean and rstd rather than reading
    an fp32 copy the row kernel would have to write (passes/recompute.py)."""
    monkeypatch.setattr(reductions, "ROW_IN_REGISTERS", 16)
    n, m = 12, 40
    x, w, b = (torch.randn(n, m, device=device, dtype=torch.bfloat16), torch.randn(m, device=device,
               dtype=torch.bfloat16), torch.randn(m, device=device, dtype=torch.bfloat16))
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [m], w, b, 1e-5)
    dy = torch.randn(n, m, device=device, dtype=torch.bfloat16)

    def bwd(dy, x, mean, rstd, w, b):
        return torch.ops.aten.native_layer_norm_backward(dy, x, [m], mean, rstd, w, b, [True, True, True])

    rep = fxopt.explain(bwd, dy, x, mean, rstd, w, b)
    copied = next(p for p in rep.passes if p.name == "recompute_for_reductions")
    assert copied.stats["chains_copied"] >= 1
    fused = rep.graph(after="fuse")
    full_size = [v for node in fused.graph.nodes if node.op != "placeholder"
                 for v in (node.meta.get("val") if isinstance(node.meta.get("val"), tuple) else [node.meta.get("val")])
                 if isinstance(v, torch.Tensor) and tuple(v.shape) == (n, m)]
    assert all(v.dtype == torch.bfloat16 for v in full_size)  # only dx: no fp32 [n, m] goes through memory
    out = compile_fxopt(bwd)(dy, x, mean, rstd, w, b)
    ref = bwd(*(t.double() for t in (dy, x, mean, rstd, w, b)))
    for o, r in zip(out, ref):
        assert_close_to_reference(o, r, torch.bfloat16)


def test_row_scalars_squeezed_or_unsqueezed_stay_in_the_group(device, schedule):
    """torch.logsumexp squeezes its max; x.mean(-1).unsqueeze(-1) restores a dim: still one kernel."""
    x = torch.randn(5, 43, device=device) * 3

    def centred(x):
        return x - x.mean(-1).unsqueeze(-1) * x.amax(-1).view(5, 1)

    for fn in (lambda x: torch.logsumexp(x, -1), centred):
        ks, _ = kernels(fn, x)
        assert len(ks) == 1, [k.ops for k in ks]
        check(fn, x)


def test_looped_row_values_never_take_a_graph_nodes_name(device):
    """A row value is renamed per pass of a looped kernel; `div` in pass 1 once became `div_1`, the name of
    another node of the same kernel (a row scalar computed before the loop): the gradient of this function
    was off by 0.1 with no error. Checked against float64 autograd."""
    def f(z):
        return z.amax((0, 1)), z.norm(dim=-1)

    z = torch.randn(64, 128, 3, device=device, requires_grad=True)
    z64 = z.detach().double().requires_grad_()
    for fn, inp in ((compile_fxopt(f), z), (f, z64)):
        a, b = fn(inp)
        (a.sum() + 2 * b.sum()).backward()
    torch.testing.assert_close(z.grad.double(), z64.grad, rtol=1e-4, atol=1e-5)


def test_variance_over_the_first_dim_with_symbolic_sizes(device):
    """`x.var(0)` under dynamic=True: the kernel's size expression (N - 1) and a row value were both `sub_1`."""
    f = torch.compile(lambda x: x.var(0), backend="fxopt", dynamic=True)
    for n in (5, 7, 33):
        x = torch.randn(n, 3, device=device)
        torch.testing.assert_close(f(x).double(), x.double().var(0), rtol=1e-5, atol=1e-6)


def test_pass_marker_avoids_every_existing_name():
    names = {"div", "div_1", "x_p1", "y__p2"}
    marker = reduction_schedules.pass_marker(names)
    assert not any(n.endswith(marker + "1") or n.endswith(marker + "2") for n in names)
    assert {n + marker + "1" for n in names}.isdisjoint(names)
    assert reduction_schedules.pass_marker({"div", "div_1"}) == "_p"


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_norm_backward_over_a_width_of_one(norm, device):
    """The column-sum combine kernel stored a [1, RBLOCK] value through a pointer with no rindex term when
    the normalized width is 1 (an interpreter error, a GPU compile error); now padded like other stores."""
    def f(x, w, b):
        return (F.layer_norm(x, (1,), w, b) if norm == "layer_norm" else F.rms_norm(x, (1,), w) + b).square().sum()

    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g) for s in ((6, 1), (1,), (1,)))
    # |x| >= 0.5: over a width of 1, x * rsqrt(x^2 + eps) is +-1 to within eps / x^2, so the gradient is a
    # difference of nearly equal terms whose fp32 rounding (GPU rsqrt: 2 ulp) grows as 1 / |x|
    x = torch.where(x < 0, x - 0.5, x + 0.5)
    x, w, b = (t.to(device).requires_grad_() for t in (x, w, b))
    got = torch.autograd.grad(compile_fxopt(f)(x, w, b), (x, w, b))
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = torch.autograd.grad(f(x64, w64, b64), (x64, w64, b64))
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", ["softmax", "mean_times_x", "log_softmax", "var_plus_x", "softmax_dim0",
                                  "expanded_in_graph"])
def test_inputs_broadcast_along_the_reduced_dim(case, device, schedule):
    """An input with stride 0 along the reduced dim (`x[:, :1].expand(5, 17)`): values of the full shape
    computed from it were taken for row scalars and stored once per row, the other 16 columns left
    uninitialised (errors of 1e29, no exception). Now a full-shape value is stored over the whole row."""
    g = torch.Generator().manual_seed(0)
    col, row = torch.randn(5, 1, generator=g).to(device), torch.randn(1, 17, generator=g).to(device)
    fn, x = {"softmax": (lambda x: torch.softmax(x * 2, -1) * 3, col.expand(5, 17)),
             "mean_times_x": (lambda x: (x + 1).mean(1, keepdim=True) * x, col.expand(5, 17)),
             "log_softmax": (lambda x: F.log_softmax(x, 1), col.expand(5, 17)),
             "var_plus_x": (lambda x: x.var(-1, keepdim=True) + x, col.expand(5, 17)),
             "softmax_dim0": (lambda x: torch.softmax(x * 2, 0), row.expand(5, 17)),
             "expanded_in_graph": (lambda y: torch.softmax(y.unsqueeze(-1).expand(5, 17) * 2, -1) * 3, col[:, 0])}[case]
    ks, _ = kernels(fn, x)
    assert any(k.kind == "reduction" for k in ks)
    check(fn, x)
