"""Cleanup folds chains of views that end where they started (autograd's t(t(w)) in every Linear's
backward): the wrapper makes fewer dispatcher calls, results and gradients stay eager's."""
import torch
import torch.nn as nn

import fxopt


def _linear_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


def test_transpose_of_transpose_is_folded_in_the_backward_and_gradients_match():
    model, ref = _linear_mlp(), _linear_mlp()
    x = torch.randn(4, 16, dtype=torch.float64)
    model, ref = model.double(), ref.double()
    rep = fxopt.explain(model, x.requires_grad_())
    folded = sum(p.stats.get("view_chains_folded", 0) for p in rep.passes)
    assert folded >= 2, [(p.name, p.stats) for p in rep.passes]
    compiled = torch.compile(model, backend="fxopt")
    xa, xb = (x.detach().clone().requires_grad_() for _ in range(2))
    compiled(xa).square().sum().backward()
    ref(xb).square().sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
