"""Reduction groups over square shapes, where a row scalar and a full-shape broadcast have the same sizes
(a correctness sweep found each giving wrong values or a codegen crash): a reduction without keepdim
read by a full-shape op broadcasts along the row, not per row; a transpose of a [N, N] row scalar is
not a rename; a column sum viewed as row scalars is not a row value. Forward and gradients against
eager in float64."""
import pytest
import torch

from tests.helpers import compile_fxopt

CASES = {
    "sum_no_keepdim_times_x": ((4, 4), lambda x: x.sum(1) * x),
    "x_minus_mean": ((3, 3), lambda x: x - x.mean(1)),
    "x_over_sum": ((4, 4), lambda x: x / x.sum(1)),
    "where_above_amin": ((4, 4), lambda x: torch.where(x > x.amin(1), x, 0.0)),
    "keepdim_plus_no_keepdim": ((4, 4), lambda x: x.sum(1, keepdim=True) + x.sum(1)),
    "middle_dim_3d": ((2, 2, 5), lambda x: x.sum(1) + x),
    "two_dims_3d": ((3, 3, 3), lambda x: x.sum((1, 2)) + x),
    "transposed_row_scalar": ((3, 3, 3), lambda x: x.amax(-1).t() + x.sum(-1)),
    "permuted_row_scalar": ((3, 3, 2), lambda x: x.amax(-1).permute(1, 0) * x.sum(-1)),
    "softmax_like_backward": ((4, 4), lambda x: (x - x.amax(1)).exp().sum(1)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_square_reduction_groups_match_eager(case, device):
    shape, fn = CASES[case]
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(len(case))).to(device)
    x.requires_grad_()
    got = compile_fxopt(fn)(x)
    (g,) = torch.autograd.grad(got.square().sum(), x)
    x64 = x.detach().double().requires_grad_()
    want = fn(x64)
    (g64,) = torch.autograd.grad(want.square().sum(), x64)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g.double(), g64, rtol=1e-4, atol=1e-4)


def test_a_column_sum_summed_again_beside_a_row_sum():
    """A column sum whose result is reduced again (`x.sum(0).sum()`, `x.sum(0).softmax(0)`, and for one row
    `x.sum(0, keepdim=True).sum(0)`, whose shapes look like a column sum of the rows) in a graph with a row
    reduction of the same x: the second reduction is not part of the row kernel's column epilogue (a
    sweep found codegen crashing with KeyErrors), and a kernel reading another kernel's column sum reads
    it as an input."""
    cases = [lambda x: (x.sum(0, keepdim=True).sum(0), x.sum(1, keepdim=True)),
             lambda x: (x.sum(0).sum(), x * x.sum(1, keepdim=True)),
             lambda x: (x * x.sum(1, keepdim=True), x.sum(0).softmax(0)),
             lambda x: ((x.sum(0, keepdim=True) > 0.1).float().sum(0), x.sum(1)),
             lambda x: (x.sum(0, keepdim=True) / x.sum(0, keepdim=True).sum(0, keepdim=True),
                        x / x.sum(1, keepdim=True))]
    for rows in (1, 3):
        x = torch.randn(rows, 5)
        for fn in cases:
            torch._dynamo.reset()
            for got, want in zip(compile_fxopt(fn)(x), fn(x.double())):
                torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-6)


def test_variance_of_a_data_dependent_selection():
    """var over `y[y > t]` (an unbacked size, with capture_dynamic_output_shape_ops): the decomposition's
    max(count - correction, 0) guarded on the unbacked count and compilation failed."""
    def fn(x):
        y = x.exp()
        return y[y > 1.5].var()

    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        got = compile_fxopt(fn)(x)
    torch.testing.assert_close(got.double(), fn(x.double()), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["expand", "view", "unsqueeze"])
def test_a_returned_view_of_a_reduction_aliases_its_base(case):
    """`y = x.sum(1, keepdim=True); return y.expand(5, 6), y`: the view was stored by the kernel as a
    separate output, so a caller's y.mul_(-3) no longer showed in it (eager's outputs alias)."""
    fn = {"expand": lambda x: (lambda y: (y.expand(5, 6), y))(x.sum(1, keepdim=True)),
          "view": lambda x: (lambda y: (y.view(5), y))(x.sum(1, keepdim=True) * 2),
          "unsqueeze": lambda x: (lambda y: (y.unsqueeze(0), y))(x.amax(1))}[case]
    x = torch.randn(5, 6)
    v, y = compile_fxopt(fn)(x)
    ve, ye = fn(x)
    torch.testing.assert_close(v, ve)
    y.mul_(-3)
    ye.mul_(-3)
    torch.testing.assert_close(v, ve)
    assert v.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()


SELECTIONS_OF_NORMALISED_ROWS = {
    "softmax(x).amax(0)": lambda x: torch.softmax(x, -1).amax(0),
    "(e / e.sum(-1)).amax(0)": lambda x: (lambda e: (e / e.sum(-1, keepdim=True)).amax(0))(x.exp()),
    "softmax(x).amin(0)": lambda x: torch.softmax(x, -1).amin(0),
}


@pytest.mark.parametrize("case", sorted(SELECTIONS_OF_NORMALISED_ROWS))
def test_a_column_selection_of_normalised_rows_has_finite_gradients(case, device):
    """amax's backward sends the gradient where input == amax. The row kernel computed the softmax as
    exp * (1/sum) and the column amax's copy of the chain (or the backward's recompute) as exp / sum: an
    ulp apart, no element equalled the result and the gradient was 0/0 = NaN (92-104 of 104 elements;
    the fuzzer of 2026-12-06). Every kernel now divides by a per-row value the same way."""
    fn = SELECTIONS_OF_NORMALISED_ROWS[case]
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        x, w = torch.randn(8, 13, generator=g).to(device), torch.randn(13, generator=g).to(device)
        leaf = x.clone().requires_grad_()
        torch._dynamo.reset()
        got, = torch.autograd.grad((compile_fxopt(fn)(leaf) * w).sum(), leaf)
        ref = x.double().requires_grad_()
        want, = torch.autograd.grad((fn(ref) * w.double()).sum(), ref)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)

