"""The backward graph compiled autograd hands fxopt (what DDP's python reducer runs under): it takes
sizes as SymInt inputs, and a static-shape row kernel with column sums can read one as a value
(`mean`'s element count in the loss gradient). Gradients must equal eager's."""
import copy

import torch
import torch.nn as nn
from torch._dynamo import compiled_autograd

import fxopt


class Block(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.lin, self.norm = nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x):  # the loss's gradient reaches the norm's backward directly (a GPT's final norm)
        return self.norm(self.lin(x) + x)


def test_compiled_autograd_backward_through_fxopt_matches_eager():
    torch.manual_seed(0)
    model, x, target = Block(), torch.randn(2, 32, 64), torch.randn(2, 32, 64)
    ref = copy.deepcopy(model)
    (ref(x) - target).square().mean().backward()
    torch._dynamo.reset()
    backend = fxopt.backend()
    enable = getattr(compiled_autograd, "_enable", None) or compiled_autograd.enable
    compiled = torch.compile(model, backend=backend)
    for _ in range(2):  # the second step reuses the compiled backward
        model.zero_grad(set_to_none=True)
        with enable(torch.compile(backend=backend)):
            (compiled(x) - target).square().mean().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
