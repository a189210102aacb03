"""The precision pass where the model writes tensors in place, and the cached parameter casts of inference:
a sweep found each of these silently reading a value from before a write, or an old weight. The
reference is eager float32 (fxopt's fp16 result within fp16's error of it); aot_eager matches eager in
every case, so each difference was fxopt's."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxopt

FP16_TOL = dict(rtol=2e-2, atol=2e-2)


def fp16(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend=fxopt.backend(precision="fp16"))


def test_a_value_written_in_place_after_a_cast_is_cast_again():
    """`y = lin_a(x).float(); y.add_(10); lin_b(y)`: the round trip to fp16 was cancelled to lin_a's fp16
    output, losing the add_; and `u = x * 2; lin(u); u.add_(10); lin(u)` shared one cast made before the
    add_."""
    torch.manual_seed(0)
    a, b = nn.Linear(8, 8), nn.Linear(8, 4)

    def round_trip(x):
        y = a(x).float()
        y.add_(10)
        return b(y)

    def shared(x):
        u = x * 2
        z1 = b(u)
        u.add_(10)
        return z1, b(u)

    x = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(fp16(round_trip)(x), round_trip(x), **FP16_TOL)
        for got, want in zip(fp16(shared)(x), shared(x)):
            torch.testing.assert_close(got, want, **FP16_TOL)


def test_parameters_written_by_the_graph_are_cast_where_read():
    """Embedding(max_norm) renormalises its (tied) weight inside the forward: the inference cast cached
    before the call read the weight from before the write (wrong on the first call)."""
    torch.manual_seed(0)

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.e = nn.Embedding(10, 8, max_norm=0.5)

        def forward(self, i):
            return F.linear(self.e(i), self.e.weight)

    model = Tied()
    reference = copy.deepcopy(model)
    i = torch.tensor([1, 2, 3])
    with torch.no_grad():
        compiled = fp16(model)
        for _ in range(2):
            torch.testing.assert_close(compiled(i), reference(i), **FP16_TOL)


def test_cached_casts_follow_fused_optimizer_steps_and_new_models():
    """A fused AdamW writes parameters without moving their version counter (eval after each step read
    the first step's weights); a new model whose weight lands at a freed weight's address has the same
    version as the old one."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    reference = copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, fused=True) for m in (model, reference)]
    compiled = fp16(model)
    x = torch.randn(4, 8)
    for _ in range(3):
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), reference(x), **FP16_TOL)
        for m, opt in zip((model, reference), opts):
            m(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
    for _ in range(3):  # new models of one class: dynamo reuses the graph, the cache must not
        fresh = nn.Linear(8, 8)
        with torch.no_grad():
            torch.testing.assert_close(fp16(fresh)(x), fresh(x), **FP16_TOL)
        del fresh


def test_ops_that_need_equal_dtypes_and_fills_too_large_for_fp16_stay_in_fp32():
    """index_add of a low-precision source into an fp32 tensor (its fake kernel does not check dtypes: a
    run-time error), and `masked_fill(m, finfo(float32).min)` baked by dynamo for fp32 scores (-inf in
    fp16: a row masked everywhere was NaN where eager's is the uniform average)."""
    torch.manual_seed(0)
    lin = nn.Linear(6, 6)
    idx = torch.tensor([0, 2, 2, 4])

    def index_add(x):
        return torch.zeros(5, 6).index_add(0, idx, lin(x))

    def masked(x, m):
        s = lin(x)
        return s.masked_fill(m, torch.finfo(s.dtype).min).softmax(-1)

    x, m = torch.randn(4, 6), torch.rand(4, 6) > 0.5
    m[1] = True
    with torch.no_grad():
        torch.testing.assert_close(fp16(index_add)(x), index_add(x), **FP16_TOL)
        got = fp16(masked)(x, m)
        assert not got.isnan().any()
        torch.testing.assert_close(got, masked(x, m), **FP16_TOL)


def _masked_in_place(x, w, m):
    s = x @ w
    s.masked_fill_(m, torch.finfo(torch.float32).min)
    return s.softmax(-1)


def _index_add_in_place(x, w, y, idx):
    s = x @ w
    s.index_add_(0, idx, y)
    return s


def _set_rows(x, w, y, idx):
    s = x @ w
    s[idx] = y
    return s * 2


def _matmul_out(x, w, o):
    torch.mm(x, w, out=o)
    return o + 0


def test_a_low_precision_result_written_in_place_keeps_the_write():
    """The mutation sweep of 2026-12-06: `s = x @ w` computes in fp16, then the model writes `s` in place
    with what fp16 cannot hold or take (a finfo(float32).min fill, an fp32 index_add_ source, `s[idx] = y`).
    The op was kept in fp32 by casting its *written* argument, so the write went into a temporary and
    was lost (the mask, the update), or raised in the wrapper (index_put: Half vs Float). The written
    value now keeps the model's fp32 from where it is made."""
    torch.manual_seed(0)
    x, w = torch.randn(4, 8), torch.randn(8, 8) / 3
    m = torch.zeros(4, 8, dtype=torch.bool)
    m[:, :4] = True
    y, idx = torch.full((2, 8), 100.0), torch.tensor([0, 2])
    for fn, args in ((_masked_in_place, (x, w, m)), (_index_add_in_place, (x, w, y, idx)), (_set_rows, (x, w, y, idx))):
        want = fn(*args)
        got = fp16(fn)(*args)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, **FP16_TOL)


def test_a_matmul_into_an_out_tensor_writes_the_callers_tensor():
    """`torch.mm(x, w, out=o)`: the policy cast `o` too, so the product went into a copy (o stayed 0)."""
    torch.manual_seed(1)
    x, w = torch.randn(2, 3), torch.randn(3, 3)
    o_eager, o_fxopt = torch.zeros(2, 3), torch.zeros(2, 3)
    want = _matmul_out(x, w, o_eager)
    got = fp16(_matmul_out)(x, w, o_fxopt)
    torch.testing.assert_close(got, want, **FP16_TOL)
    torch.testing.assert_close(o_fxopt, o_eager, **FP16_TOL)


class _HalvedBuffer(nn.Module):
    def __init__(self, spelling):
        super().__init__()
        self.register_buffer("b", torch.eye(4))
        self.spelling = spelling

    def forward(self, x):
        y1 = x @ self.b
        {"T": lambda: self.b.T, "mT": lambda: self.b.mT, "data": lambda: self.b.data,
         "ravel": lambda: self.b.ravel(), "split_with_sizes": lambda: self.b.split_with_sizes([2, 2])[0],
         "hsplit": lambda: self.b.hsplit(2)[0]}[self.spelling]().mul_(0.5)
        return y1 + x @ self.b


def test_writes_through_every_spelling_of_a_view_are_seen():
    """`b.T.mul_(0.5)` between two reads of `b`: views the mutation analysis did not know (getattr T/mT,
    .data, ravel, split_with_sizes, hsplit) hid the write, and both matmuls shared one cast of `b` made
    before it ([2, 2, 2, 2] instead of [1.5, ...])."""
    x = torch.ones(1, 4)
    for spelling in ("T", "mT", "data", "ravel", "split_with_sizes", "hsplit"):
        want = _HalvedBuffer(spelling)(x)
        got = fp16(_HalvedBuffer(spelling))(x)
        torch.testing.assert_close(got, want, **FP16_TOL)


def test_a_weight_scaled_through_data_in_forward_is_cast_after_the_write():
    """Inference with cached parameter casts: `self.lin.weight.data.mul_(2)` (dynamo's _get_data_attr) was
    not seen as a write to the weight, so the cached cast was one call stale."""
    torch.manual_seed(2)
    eager = nn.Linear(4, 4)
    compiled_model = copy.deepcopy(eager)

    def step(model):
        def forward(x):
            model.weight.data.mul_(2)
            return model(x)
        return forward
    run = fp16(step(compiled_model))
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 4)
            torch.testing.assert_close(run(x), step(eager)(x), **FP16_TOL)


class _WrittenBetweenReads(nn.Module):
    """A buffer read by a matmul, written in place by `spelling`, read again (fp16 shares one cast of a
    value nothing writes: a write the analysis misses leaves the second read with the old value)."""

    def __init__(self, spelling):
        super().__init__()
        self.register_buffer("b", torch.eye(4) * 2)
        self.spelling = spelling

    def forward(self, x):
        y1 = x @ self.b
        write = {
            "foreach": lambda b: torch._foreach_mul_([b], 0.5),
            "aten overload": lambda b: torch.ops.aten.mul_.Tensor(b, 0.5),
            "inplace=True": lambda b: F.hardtanh(b, -1.0, 1.0, inplace=True),
            "out tuple": lambda b: torch.sort(-b, dim=-1, out=(b, torch.empty(4, 4, dtype=torch.long))),
            "no-op float()": lambda b: b.float().mul_(0.5),
            "no-op type_as": lambda b: b.type_as(x).mul_(0.5),
        }[self.spelling]
        write(self.b)
        return y1 + x @ self.b


def test_every_spelling_of_a_write_is_seen():
    """The second mutation sweep (2026-12-06): foreach ops (a list), explicit aten overloads
    (`mul_.Tensor`), `inplace=True` functions, tuple `out=`, and a write through a cast that changes
    nothing (`b.float()` of fp32 `b` is `b` in eager) were not seen as writes under precision="fp16"."""
    x = torch.ones(1, 4)
    for spelling in ("foreach", "aten overload", "inplace=True", "out tuple", "no-op float()", "no-op type_as"):
        eager, compiled = _WrittenBetweenReads(spelling), _WrittenBetweenReads(spelling)
        run = fp16(compiled)
        for _ in range(2):
            torch.testing.assert_close(run(x), eager(x), **FP16_TOL, msg=spelling)
        torch.testing.assert_close(compiled.b, eager.b, **FP16_TOL, msg=spelling)


def _cast_then_write(a, w):
    s = a @ w
    s.float().sub_(100)  # s itself, in eager: the write lands in s
    return s


def _running_stats(x, w, rm, rv):
    y1 = x @ w
    F.batch_norm(x, rm, rv, training=True)
    return y1 + rm.sum() + rv.sum()


def test_writes_through_no_op_casts_and_batch_norm_statistics():
    torch.manual_seed(3)
    a, w = torch.randn(4, 8), torch.randn(8, 8)
    torch.testing.assert_close(fp16(_cast_then_write)(a, w), _cast_then_write(a, w), **FP16_TOL)
    x = torch.randn(6, 8)
    stats_eager, stats_fxopt = (torch.zeros(8), torch.ones(8)), (torch.zeros(8), torch.ones(8))
    run = fp16(_running_stats)
    for _ in range(2):
        torch.testing.assert_close(run(x, w, *stats_fxopt), _running_stats(x, w, *stats_eager), **FP16_TOL)
    for got, want in zip(stats_fxopt, stats_eager):
        torch.testing.assert_close(got, want, **FP16_TOL)


def _gpt2_where(x, w, keep):
    s = x @ w
    s = torch.where(keep, s, torch.full([], torch.finfo(s.dtype).min, dtype=s.dtype))
    return s.softmax(-1)


def _aten_masked_fill_(x, w, drop):
    s = x @ w
    torch.ops.aten.masked_fill_.Scalar(s, drop, torch.finfo(torch.float32).min)
    return s.softmax(-1)


def _aten_index_put_(x, w, idx, y):
    s = x @ w
    torch.ops.aten.index_put_.default(s, [idx], y)
    return s


def test_fills_made_in_the_graph_and_aten_overloads_keep_fp32():
    """HF GPT-2's `where(keep, s, full([], finfo(float32).min))`, `index_fill`, and explicit aten overloads of
    masked_fill_/index_put_: the fill became -inf in fp16 (a row masked everywhere NaN instead of eager's
    average) or index_put raised (Half vs Float)."""
    torch.manual_seed(4)
    x, w = torch.randn(4, 8), torch.randn(8, 8) / 3
    keep = torch.ones(4, 8, dtype=torch.bool)
    keep[0] = False  # row 0 masked everywhere: eager gives the average, 1/8
    y, idx = torch.full((2, 8), 100.0), torch.tensor([0, 2])
    cases = ((_gpt2_where, (x, w, keep)), (_aten_masked_fill_, (x, w, ~keep)), (_aten_index_put_, (x, w, idx, y)),
             (lambda x, w, i: (x @ w).index_fill(0, i, -1e9).softmax(0), (x, w, idx)))
    for fn, args in cases:
        got = fp16(fn)(*args)
        assert not got.isnan().any()
        torch.testing.assert_close(got, fn(*args), **FP16_TOL)


def test_outputs_that_are_views_of_one_low_precision_value_still_alias():
    """`y = lin(x); return y, y.t(), y[1]` under precision=: each output was cast back on its own, three
    separate fp32 tensors, so a write to one no longer showed in the others (eager, autocast and fxopt
    without precision return views of one tensor). The value is now cast once where it is made."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)

    def f(x):
        y = lin(x)
        return y, y.t(), y[1]

    x = torch.randn(4, 8)
    with torch.no_grad():
        a, b, c = fp16(f)(x)
        expected = lin(x)
        torch.testing.assert_close(a, expected, **FP16_TOL)
        assert a.dtype == b.dtype == c.dtype == torch.float32
        assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()
        a[1, 2] = 100.0
        assert b[2, 1].item() == 100.0 and c[2].item() == 100.0


def test_setitem_of_a_low_precision_value_into_an_fp32_tensor():
    """`buf[idx] = lin(x)` (Python's setitem with a tensor index: index_put) raised "Index put requires
    the source and destination dtypes match" under precision=; the explicit index_put_ spelling worked."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    idx = torch.tensor([0, 2, 5, 7])

    def f(x):
        buf = torch.zeros(8, 8)
        buf[idx] = lin(x)
        return buf * 2

    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(fp16(f)(x), f(x), **FP16_TOL)
