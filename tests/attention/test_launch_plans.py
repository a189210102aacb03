"""attention/launch_plans.py: launch decisions are kept per input layout, decided afresh when any fact
they read changes, and never kept for inputs the checks reject."""
import pytest
import torch

from fxopt.attention import flash_forward as forward_module
from fxopt.attention.flash_forward import flash_forward
from fxopt.attention.launch_plans import layout_key, planned
from fxopt.attention.reference import attention


def test_layout_key_reads_shape_strides_dtype_device_and_alignment():
    x = torch.empty(2, 3, 8, 16)
    assert layout_key((x, None)) == ((x.shape, x.stride(), x.dtype, x.device, 0), None)
    assert layout_key((x,)) != layout_key((x.transpose(1, 2),))  # strides
    assert layout_key((x,)) != layout_key((x.half(),))  # dtype
    flat = torch.empty(2 * 3 * 8 * 16 + 1)
    assert layout_key((flat[:-1].view(2, 3, 8, 16),)) != layout_key((flat[1:].view(2, 3, 8, 16),))  # 4 bytes off


def test_a_decision_is_made_once_per_layout():
    calls = []
    plan = planned(lambda tensors, flag: calls.append(flag) or len(calls))
    a, b = torch.empty(4, 4), torch.empty(4, 4)
    assert plan((a,), True) == plan((b,), True) == 1  # same layout, another tensor: kept
    assert plan((a.t().contiguous().t(),), True) == 2  # new strides
    assert plan((a,), False) == 3  # new fact
    assert calls == [True, True, False]


def test_rejected_inputs_raise_on_every_call():
    def decide(tensors, scale):
        raise ValueError("bad")
    plan = planned(decide)
    for _ in range(2):
        with pytest.raises(ValueError, match="bad"):
            plan((torch.empty(2),), 1.0)
    assert not plan.cache
    with pytest.raises(ValueError, match="bad"):
        plan(("not a tensor",), 1.0)  # not keyable: decided (and rejected) directly
    with pytest.raises(ValueError, match="bad"):
        plan((torch.empty(2),), [1.0])  # unhashable fact


def test_flash_forward_reuses_its_plan_and_stays_exact(monkeypatch):
    forward_module._forward_plan.cache.clear()
    decided = []
    real = forward_module.forward_config
    monkeypatch.setattr(forward_module, "forward_config", lambda *a, **k: decided.append(a) or real(*a, **k))
    q, k, v = (torch.randn(1, 2, 24, 16) for _ in range(3))
    for causal in (True, True, False):
        out, _ = flash_forward(q, k, v, scale=0.25, causal=causal)
        torch.testing.assert_close(out.double(), attention(q.double(), k.double(), v.double(), scale=0.25,
                                                           causal=causal)[0], rtol=1e-5, atol=1e-5)
    assert len(decided) == 2  # causal twice from one plan, then non-causal
    with pytest.raises(ValueError, match="head_dim"):
        flash_forward(q[..., :8], k[..., :8], v[..., :8], scale=0.25, causal=True)
