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
