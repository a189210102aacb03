"""Column operands in row kernels (passes/fuse_reductions._column_operand): a pointwise op of graph
inputs only, of a shape the row broadcasts from the right (`w.float()`, [M] of [N, M]), is computed
inside the reduction kernel where it is read instead of in a kernel of its own whose [M] result the
row kernel reads back (one allocation and one launch fewer: LayerNorm's backward allocated 4 buffers
to eager's 3). Results against float64 eager, in the interpreter."""
from __future__ import annotations

import pytest
import torch

import fxopt
from tests.codegen.test_reductions import schedule  # noqa: F401 (the fixture forcing each schedule)
from tests.helpers import assert_close_to_reference, compile_fxopt, to64


def _ln_backward(dy, x, mean, rstd, w, b):
    return torch.ops.aten.native_layer_norm_backward(dy, x, [x.shape[-1]], mean, rstd, w, b, [True, True, True])


def _ln_by_hand(x, w, b):
    h = x.float()
    mean = h.mean(-1, keepdim=True)
    var = (h - mean).pow(2).mean(-1, keepdim=True)
    return ((h - mean) * torch.rsqrt(var + 1e-5) * w.float() + b.float()).to(x.dtype)


def _kernels(fn, *args):
    return [k for k in fxopt.explain(fn, *args).kernels if k.graph in ("forward", "inference")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_layer_norm_backward_is_one_kernel_with_the_weight_cast_inside(dtype):
    torch.manual_seed(0)
    n, m = 40, 96  # not square: a [M] operand is not mistaken for a [N] row scalar
    x, w, b = (torch.randn(n, m, dtype=dtype), torch.randn(m, dtype=dtype), torch.randn(m, dtype=dtype))
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [m], w, b, 1e-5)
    args = (torch.randn(n, m, dtype=dtype), x, mean, rstd, w, b)
    kernels = _kernels(_ln_backward, *args)
    assert len(kernels) == 1 and kernels[0].kind == "reduction", [k.name for k in kernels]
    assert_close_to_reference(compile_fxopt(_ln_backward)(*args), _ln_backward(*map(to64, args)), dtype)


def test_long_rows_recompute_the_column_operand_in_each_pass():
    """A looped kernel (rows wider than the registers hold) reads w and b in every pass over the row:
    the cast is recomputed there, at the pass's columns."""
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 9000, dtype=torch.bfloat16), torch.randn(9000, dtype=torch.bfloat16), \
        torch.randn(9000, dtype=torch.bfloat16)
    kernels = _kernels(_ln_by_hand, x, w, b)
    assert len(kernels) == 1 and kernels[0].schedule == "looped", [(k.name, k.schedule) for k in kernels]
    assert_close_to_reference(compile_fxopt(_ln_by_hand)(x, w, b), _ln_by_hand(*map(to64, (x, w, b))),
                              torch.bfloat16)


def test_column_operand_read_outside_the_row_kernel_stays_a_kernel_of_its_own():
    def f(x, w, b):
        return _ln_by_hand(x, w, b), w.float() * 2
    torch.manual_seed(0)
    x, w, b = torch.randn(6, 40, dtype=torch.bfloat16), torch.randn(40, dtype=torch.bfloat16), \
        torch.randn(40, dtype=torch.bfloat16)
    kernels = _kernels(f, x, w, b)
    assert sum(k.kind == "reduction" for k in kernels) == 1 and len(kernels) == 2, [k.name for k in kernels]
    assert_close_to_reference(compile_fxopt(f)(x, w, b), f(*map(to64, (x, w, b))), torch.bfloat16)


def test_square_rows_keep_the_operand_out():
    """At [M, M] a [M] value could be a row scalar ([N], read along rows) or a column operand (read
    along columns): the group takes neither reading, and the result is still right."""
    torch.manual_seed(0)
    x, w, b = torch.randn(32, 32, dtype=torch.bfloat16), torch.randn(32, dtype=torch.bfloat16), \
        torch.randn(32, dtype=torch.bfloat16)
    assert len(_kernels(_ln_by_hand, x, w, b)) > 1
    assert_close_to_reference(compile_fxopt(_ln_by_hand)(x, w, b), _ln_by_hand(*map(to64, (x, w, b))),
                              torch.bfloat16)


def _weighted_row_sum(x, w):
    return (x.float() * w.float()).sum(-1)


def test_every_schedule_computes_the_operand_where_it_reads_it(schedule):
    """Persistent, looped and split (rows cut into chunks, partial sums combined) kernels: the cast
    of w is one of the group's ops in each, and the sums equal float64 eager's."""
    torch.manual_seed(0)
    x, w = torch.randn(7, 37, dtype=torch.bfloat16), torch.randn(37, dtype=torch.bfloat16)
    kernels = _kernels(_weighted_row_sum, x, w)
    assert len(kernels) == 1 and kernels[0].schedule.startswith(schedule), [(k.name, k.schedule) for k in kernels]
    assert_close_to_reference(compile_fxopt(_weighted_row_sum)(x, w), _weighted_row_sum(x.double(), w.double()),
                              torch.float32)
