"""SDPA calls fxopt does not fuse (a head dim outside its kernels' range) run as ATen, forward and
backward, with eager's gradients: torch's decomposition of the CPU flash op returns probabilities where
its backward reads the log-sum-exp, so fxopt must not decompose it (decompositions.py)."""
import pytest
import torch
import torch.nn.functional as F

import fxopt
from helpers import compile_fxopt


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("head_dim", [8, 300])
def test_unfused_sdpa_gradients_equal_eager(head_dim):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, head_dim, dtype=torch.float64, requires_grad=True) for _ in range(3))
    rep = fxopt.explain(_sdpa, q, k, v)
    assert rep.attention and not rep.attention[0].fused, rep.attention
    torch._dynamo.reset()
    out = compile_fxopt(_sdpa)(q, k, v)
    ref = _sdpa(q, k, v)
    torch.testing.assert_close(out, ref)
    go = torch.randn_like(ref)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, (q, k, v), go)):
        torch.testing.assert_close(got, want)
