"""Roofline counts against hand-computed values."""
import torch

import fxopt
from fxopt.analysis.roofline import Ceilings


def test_matmul_and_pointwise_counts():
    m, k, n = 16, 32, 8

    def f(a, b, bias):
        return torch.relu(a @ b + bias) * 2.0

    a, b, bias = torch.randn(m, k), torch.randn(k, n), torch.randn(n)
    rep = fxopt.explain(f, a, b, bias)
    rows = {r.kind: r for r in rep.roofline}
    mm = next(r for r in rep.roofline if r.kind == "matmul")
    assert mm.flops == 2 * m * n * k + (m * n if "addmm" in mm.name else 0)
    pw = next(r for r in rep.roofline if r.kind == "pointwise")
    ops = len(rep.kernels[0].ops)
    assert pw.flops == ops * m * n
    assert pw.bytes >= 4 * m * n * 2  # reads the product once, writes the result once
    assert pw.bound == "memory" and rows
    c = Ceilings()
    assert abs(mm.seconds - max(mm.bytes / c.bytes_per_s, mm.flops / c.matmul_flops_per_s)) < 1e-15


def test_reduction_counts_one_flop_per_reduced_element():
    x = torch.randn(12, 40)
    rep = fxopt.explain(lambda x: torch.softmax(x, -1), x)
    (row,) = [r for r in rep.roofline if r.kind == "reduction"]
    n_pointwise = sum(1 for op in rep.kernels[0].ops if op not in ("aten.amax.default", "aten.sum.dim_IntList"))
    assert row.flops == (2 + n_pointwise) * x.numel()
    assert row.bytes == 2 * x.numel() * 4
    assert "roofline" in str(rep)


def test_convolution_flops():
    conv = torch.nn.Conv2d(3, 8, 3, bias=False)
    x = torch.randn(2, 3, 10, 10)
    rep = fxopt.explain(conv, x)
    row = next(r for r in rep.roofline if r.kind == "matmul")
    assert row.flops == 2 * (2 * 8 * 8 * 8) * 3 * 3 * 3
