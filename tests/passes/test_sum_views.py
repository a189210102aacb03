"""passes/sum_views.py: a sum over dim 0 of a view that flattens leading dims is rewritten as a sum over
those dims of the original, so a Linear's bias gradient after a norm's backward is summed by the norm's
row kernel. Structure on fake tensors; gradients through torch.compile in the interpreter."""
import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import fxopt
from fxopt.options import Environment, Options
from fxopt.pass_manager import PassContext
from fxopt.passes.sum_views import SumsThroughViews

aten = torch.ops.aten


def _rewrite(fn, *shapes):
    with FakeTensorMode():
        gm = make_fx(fn)(*[torch.empty(s) for s in shapes])
    result = SumsThroughViews()(gm, PassContext(Options(), Environment(), target="interpret"))
    sums = [n for n in result.gm.graph.nodes if n.target is aten.sum.dim_IntList]
    return result, sums


def _row_value(x):
    """A value computed from a reduction over x's last dim (as a norm backward's dx is)."""
    return (x - x.mean(-1, keepdim=True)) * 3


@pytest.mark.parametrize("keepdim", [False, True])
def test_a_bias_gradient_of_a_row_value_sums_the_unflattened_tensor(keepdim):
    if keepdim:
        fn = lambda x: _row_value(x).view(-1, 8).sum(0, keepdim=True).view(8)  # noqa: E731
    else:
        fn = lambda x: _row_value(x).view(-1, 8).sum(0)  # noqa: E731
    result, sums = _rewrite(fn, (2, 3, 8))
    assert result.stats == {"rewritten": 1}
    s = [n for n in sums if list(n.args[1]) == [0, 1]]
    assert len(s) == 1 and tuple(s[0].args[0].meta["val"].shape) == (2, 3, 8)
    assert tuple(s[0].meta["val"].shape) == (8,)
    assert not any(n.target is aten.view.default for n in result.gm.graph.nodes)


@pytest.mark.parametrize("fn", [
    lambda x: _row_value(x).view(2, 24).sum(0),  # flattens trailing dims, not leading ones
    lambda x: _row_value(x).view(-1, 8).sum(1),  # not dim 0
    lambda x: _row_value(x).view(-1, 8).sum(0, keepdim=True) * 2,  # keepdim read as [1, 8]
    lambda x: (x * 2).view(-1, 8).sum(0),  # not a row kernel's value: stays a sum of the 2-D view
])
def test_other_sums_are_left_alone(fn):
    result, _ = _rewrite(fn, (2, 3, 8))
    assert result.stats == {"rewritten": 0}


class LinearNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.norm = nn.Linear(32, 32), nn.LayerNorm(32)

    def forward(self, x):
        return self.norm(self.proj(x)) * 2


def test_the_norm_backward_sums_the_bias_gradient_and_gradients_match():
    torch.manual_seed(0)
    model, x = LinearNorm(), torch.randn(2, 6, 32, requires_grad=True)
    rep = fxopt.explain(lambda x: model(x).square().sum(), x)
    backward = [g for g in rep.graphs if g.name == "backward"][0].wrapper_source
    standalone_sums = [line for line in backward.splitlines() if line.startswith("def fused_sum")]
    assert not standalone_sums, standalone_sums  # the row kernel sums the bias gradient from registers
    without = fxopt.explain(lambda x: model(x).square().sum(), x, skip_passes=("sums_through_views",))
    assert "def fused_sum" in [g for g in without.graphs if g.name == "backward"][0].wrapper_source

    compiled = torch.compile(lambda x: model(x).square().sum(), backend="fxopt")
    compiled(x).backward()
    got = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model64, x64 = LinearNorm().double(), x.detach().double().requires_grad_()
    model64.load_state_dict(model.state_dict())
    model64(x64).square().sum().backward()
    for g, want in zip(got, [p.grad for p in model64.parameters()] + [x64.grad]):
        torch.testing.assert_close(g.double(), want, rtol=1e-4, atol=1e-4)


def test_skip_passes_names_are_checked():
    with pytest.raises(ValueError, match="sums_through_views"):
        Options(skip_passes=("no_such_pass",))
