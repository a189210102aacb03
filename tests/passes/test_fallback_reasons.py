"""The reason explain gives for an op left to ATen names what really keeps it there."""
import torch
import torch.nn.functional as F

import fxopt


def _reasons(fn, *inputs, **options) -> dict[str, str]:
    return dict(fxopt.explain(fn, *inputs, **options).fallbacks)


def test_attention_kernel_without_dropout_is_not_called_random():
    """ATen's SDPA kernels are tagged random for their dropout; at dropout_p=0 nothing is drawn, so the
    reason must not say the op stays to draw from torch's generator."""
    q = torch.randn(1, 2, 8, 16)
    reasons = _reasons(lambda q: F.scaled_dot_product_attention(q * 2, q, q), q, attention=False)  # (kept ATen)
    sdpa = {n: r for n, r in reasons.items() if "attention" in n}
    assert sdpa and all("SDPA" in r and "random" not in r for r in sdpa.values()), reasons


def test_dropout_is_still_called_random():
    x = torch.randn(4, 8)
    reasons = _reasons(lambda x: F.dropout(x * 2, 0.5, training=True), x)
    assert any("random op" in r for r in reasons.values()), reasons
