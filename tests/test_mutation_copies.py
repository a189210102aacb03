"""Copies next to in-place writes (the mutation sweep of 2026-12-06). Cleanup drops a clone or cast whose
result is its input exactly; it dropped them where that is wrong: a returned *view* of the copy (the
output then aliased the caller's input), and a copy of a storage the graph writes later (the input
mutation epilogue's `copy_` ran before a reader of the copy: snapshots, buffer swaps, `prev[:] = cur`).
Each against eager (outputs, mutated inputs, aliasing)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from helpers import compile_fxopt


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


VIEWS_OF_A_CLONE = {
    "t": lambda x: x.clone().t(),
    "slice": lambda x: x.clone()[1:],
    "view": lambda x: x.clone().view(-1),
    "split": lambda x: x.clone().split(1),
    "t_ in place": lambda x: x.clone().t_(),
    "detach().clone() then a view": lambda x: x.detach().clone()[:, 1:],
}


@pytest.mark.parametrize("case", sorted(VIEWS_OF_A_CLONE))
def test_a_returned_view_of_a_clone_does_not_alias_the_input(case, device):
    fn = VIEWS_OF_A_CLONE[case]
    x = torch.arange(6.0, device=device).reshape(2, 3)
    out = compile_fxopt(fn)(x)
    outs = out if isinstance(out, tuple) else (out,)
    for o, e in zip(outs, fn(x) if isinstance(out, tuple) else (fn(x),)):
        torch.testing.assert_close(o, e)
        assert not _shares_storage(o, x)
        o.zero_()
    torch.testing.assert_close(x, torch.arange(6.0, device=device).reshape(2, 3))


def _snapshot_then_scale(x):
    old = x.clone()
    x.mul_(2)
    return old[1:], old * 1


def _swap(a, b):
    t = a.clone()
    a.copy_(b)
    b.copy_(t)


def _back_up_then_step(prev, cur, x):
    old = cur.clone()
    cur.add_(x)
    prev.copy_(old)


def test_a_snapshot_of_an_input_keeps_its_values_after_the_input_is_written(device):
    x = torch.arange(1.0, 7.0, device=device)
    want_x, want = x.clone(), _snapshot_then_scale(x.clone())
    got = compile_fxopt(_snapshot_then_scale)(x)
    want_x.mul_(2)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(x, want_x)


def test_swapping_and_backing_up_inputs_through_a_clone(device):
    a, b = torch.tensor([1.0, 2.0], device=device), torch.tensor([3.0, 4.0], device=device)
    compile_fxopt(_swap)(a, b)
    assert a.tolist() == [3.0, 4.0] and b.tolist() == [1.0, 2.0]
    prev, cur = torch.zeros(2, device=device), torch.tensor([10.0, 20.0], device=device)
    compile_fxopt(_back_up_then_step)(prev, cur, torch.ones(2, device=device))
    assert prev.tolist() == [10.0, 20.0] and cur.tolist() == [11.0, 21.0]


class _History(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cur", torch.zeros(2))
        self.register_buffer("prev", torch.zeros(2))

    def forward(self, x):
        self.prev[:] = self.cur  # (no clone written: the functional copy becomes one)
        self.cur.add_(x)
        return self.prev + 0


def test_a_buffer_copied_into_another_before_it_is_updated(device):
    eager, compiled = _History().to(device), _History().to(device)
    step = compile_fxopt(compiled)
    for _ in range(3):
        x = torch.ones(2, device=device)
        torch.testing.assert_close(step(x), eager(x))
    torch.testing.assert_close(compiled.prev, eager.prev)
    torch.testing.assert_close(compiled.cur, eager.cur)


def test_a_returned_view_of_a_tensor_literal_is_not_the_graphs_constant(device):
    def fn(x):
        c = torch.tensor([1.0, 2.0, 3.0], device=x.device)
        return x + c, c[1:]
    step = compile_fxopt(fn)
    _, tail = step(torch.ones(3, device=device))
    tail.zero_()  # the caller owns its outputs
    again, tail = step(torch.ones(3, device=device))
    assert again.tolist() == [2.0, 3.0, 4.0] and tail.tolist() == [2.0, 3.0]
