"""Everyday module code through backend="fxopt" equals eager: conv+batchnorm (train and eval), embedding
with an in-place relu, cat/stack, group norm, integer/float mixes, strided slices."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.bn = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)

    def forward(self, x):
        return F.relu(self.bn(self.c(x))).mean((2, 3))


class Emb(nn.Module):
    def __init__(self):
        super().__init__()
        self.e, self.lin = nn.Embedding(20, 8), nn.Linear(8, 4)

    def forward(self, i):
        return F.log_softmax(self.lin(self.e(i).relu_()), -1)


def cat_stack(x, y):
    return torch.cat([x.sin(), y.cos()], 0).t() * 2 + torch.stack([x, y]).sum(0).sum()


def group_norm(x):
    return F.group_norm(x, 2) * torch.sigmoid(x)


def int_mix(x, i):
    return torch.where(i > 2, x * i, x - i).float().cumsum(-1) + (i % 3)


def slices(x):
    return x[:, 1::2] * x[:, ::2] + x[1:, :1].mean()


CASES = {
    "convbn_train": lambda: (ConvBN().train(), (torch.randn(2, 3, 10, 10),)),
    "convbn_eval": lambda: (ConvBN().eval(), (torch.randn(2, 3, 10, 10),)),
    "embedding_inplace": lambda: (Emb(), (torch.randint(0, 20, (3, 5)),)),
    "cat_stack": lambda: (cat_stack, (torch.randn(4, 5), torch.randn(4, 5))),
    "group_norm": lambda: (group_norm, (torch.randn(2, 4, 6),)),
    "int_mix": lambda: (int_mix, (torch.randn(3, 7), torch.randint(0, 6, (3, 7)))),
    "slices": lambda: (slices, (torch.randn(5, 8),)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_module_matches_eager(case):
    torch.manual_seed(0)
    fn, args = CASES[case]()
    ref_fn = copy.deepcopy(fn) if isinstance(fn, nn.Module) else fn
    out = torch.compile(fn, backend="fxopt")(*args)
    ref = ref_fn(*args)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if isinstance(fn, nn.Module) and fn.training and hasattr(fn, "bn"):  # running stats updated alike
        torch.testing.assert_close(fn.bn.running_mean, ref_fn.bn.running_mean, rtol=1e-5, atol=1e-6)
