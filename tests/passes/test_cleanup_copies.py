"""Cleanup turns a functional copy into a tensor of the same shape and dtype (DDP's python reducer
copies each gradient that way) into a contiguous clone, which fuses into the kernel beside it; a copy
that changes dtype or broadcasts stays a copy. Results against eager in float64."""
import torch

import fxopt

aten = torch.ops.aten


def _into_row_major(x):
    gt = x.t()  # a transposed source: the copy changes the layout, not the values
    c = aten.copy.default(torch.empty(gt.shape, dtype=x.dtype), gt)
    return c / 2, aten.copy.default(torch.empty(gt.shape, dtype=x.dtype), gt)


def test_a_copy_into_a_fresh_row_major_tensor_fuses_as_a_clone():
    x = torch.randn(6, 4, dtype=torch.float64)
    rep = fxopt.explain(_into_row_major, x)
    src = rep.graphs[0].wrapper_source
    assert "aten.copy" not in src and "clone" in src, src
    assert sum(p.stats.get("copies_as_clones", 0) for p in rep.passes) == 2
    x_before = x.clone()
    halved, copied = torch.compile(_into_row_major, backend="fxopt", dynamic=False)(x)
    torch.testing.assert_close(halved, x.t() / 2, rtol=0, atol=0)
    torch.testing.assert_close(copied, x.t(), rtol=0, atol=0)
    assert halved.is_contiguous() and copied.is_contiguous()  # the destination's layout
    assert copied.data_ptr() != x.data_ptr() and torch.equal(x, x_before)  # a copy of its own, x untouched


def _cast_and_broadcast(x, row):
    wide = aten.copy.default(torch.empty(x.shape, dtype=torch.float64), x)  # dtype change
    spread = aten.copy.default(torch.empty(x.shape, dtype=x.dtype), row)  # broadcast
    return wide * 3, spread + 1


def test_a_copy_that_casts_or_broadcasts_keeps_eager_values():
    x, row = torch.randn(5, 4), torch.randn(4)
    rep = fxopt.explain(_cast_and_broadcast, x, row)
    assert sum(p.stats.get("copies_as_clones", 0) for p in rep.passes) == 0
    wide, spread = torch.compile(_cast_and_broadcast, backend="fxopt", dynamic=False)(x, row)
    assert wide.dtype == torch.float64
    torch.testing.assert_close(wide, x.double() * 3, rtol=0, atol=0)
    torch.testing.assert_close(spread, row.expand(5, 4) + 1)
