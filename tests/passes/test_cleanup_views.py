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


def test_wrapper_calls_views_as_tensor_methods():
    """The views left in a wrapper are Tensor methods (`x.view(...)`), not OpOverload calls, and the
    wrapper still computes eager's gradients (the test above)."""
    model = _linear_mlp().double()
    rep = fxopt.explain(model, torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True))
    sources = [g.wrapper_source for g in rep.graphs]
    assert any(".view([" in s or ".t()" in s or ".permute([" in s for s in sources)
    assert not any(f"aten.{op}.default(" in s for s in sources for op in ("view", "permute", "t", "expand", "mm", "addmm"))
    assert any("torch.addmm(" in s or "torch.mm(" in s for s in sources)  # the matmuls, as torch functions
