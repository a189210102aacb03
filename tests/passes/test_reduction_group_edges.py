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
