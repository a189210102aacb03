"""Wide and deep graphs (sweep of 2026-12-06): a cat of more pieces than a kernel takes stays an ATen
call (210 pieces nested 210 tl.where calls, past Python's parser limit: a SyntaxError at compile)."""
import torch

import fxopt


def test_cat_of_210_tensors_then_a_multiply_equals_eager():
    torch.manual_seed(0)
    xs = [torch.randn(4, 5) for _ in range(210)]

    def f(*a):
        return torch.cat(a, 1) * 2

    torch._dynamo.reset()
    out = torch.compile(f, backend="fxopt")(*xs)
    assert torch.equal(out, f(*xs))
    rep = fxopt.explain(f, *xs)
    assert "cat of 210 tensors stays an ATen call" in str(rep)


def test_long_chain_on_a_broadcast_operand_of_a_row_sum_equals_eager():
    """450 ops on a [5] operand of a [4, 5] row sum: the row group's column-operand test recursed once
    per op and overflowed Python's stack (RecursionError at compile)."""
    def f(x, w):
        for i in range(150):
            w = w * 1.0001 + 0.0001 if i % 2 else w.sin() * 0.5 + 0.6
        return (x * w).sum(1)

    torch.manual_seed(0)
    x, w = torch.randn(4, 5), torch.randn(5)
    torch._dynamo.reset()
    out = torch.compile(f, backend="fxopt")(x, w)
    torch.testing.assert_close(out.double(), f(x.double(), w.double()), rtol=1e-4, atol=1e-4)
