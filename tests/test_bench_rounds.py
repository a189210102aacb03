"""benchmarks.run --rounds: backends timed in turn (the first one rotating), medians and ranges reported."""
from types import SimpleNamespace

import pytest
import torch

from benchmarks import measure, run


def test_rounds_alternate_backends_and_report_the_median(monkeypatch):
    order, times = [], {"a": iter([5.0, 1.0, 3.0]), "b": iter([4.0, 2.0, 6.0])}
    monkeypatch.setattr(measure, "bench_ms", lambda call, *rest: (order.append(call), next(times[call]))[1])
    rows = []
    for b in ("a", "b"):
        row = {"workload": "w", "backend": b}
        run.set_time(row, [next(times[b])], min_bytes=10**6, flops=None, copy_gbs=None)
        rows.append(row)
    w = SimpleNamespace(training=False, kind="model")
    args = SimpleNamespace(rounds=3, device="cpu", warmup=1, rep=1)
    run.more_rounds(w, rows, {"a": "a", "b": "b"}, args, None, 10**6, None)
    assert order == ["b", "a", "a", "b"]  # round 2 starts with b, round 3 with a
    assert [r["median_ms"] for r in rows] == [3.0, 4.0]
    assert [r["ms_range"] for r in rows] == ["1.000-5.000", "2.000-6.000"]
    assert rows[0]["gbs"] == 10**6 / 3.0 / 1e6


def test_loss_curve_script_compares_three_curves_on_the_cpu():
    """benchmarks.loss_curve (issue 6's 200-step comparison, run on a GPU): two steps here, every curve
    finite and training, fxopt within bf16's reach of autocast."""
    from benchmarks import loss_curve
    c = loss_curve.curves(steps=2, lr=1e-3, device="cpu")
    assert set(c) == {"fxopt", "autocast", "fp32"} and all(len(v) == 2 for v in c.values())
    assert loss_curve.worst_relative(c["fxopt"], c["fp32"]) < 0.02
    assert loss_curve.worst_relative(c["fxopt"], c["autocast"]) < 0.02


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter truncates bf16 casts (the GPU rounds)")
def test_bf16_training_follows_autocast_for_200_steps_on_cuda():
    """Issue 6: a tiny GPT trained 200 AdamW steps with precision="bf16" follows torch.autocast's loss
    curve within 1% at every step (on the H200: 0.53%, where autocast strays 0.44% from fp32)."""
    from benchmarks import loss_curve
    c = loss_curve.curves(steps=200, lr=1e-3, device="cuda")
    assert c["fxopt"][-1] < 0.25 * c["fxopt"][0]  # it trained
    assert loss_curve.worst_relative(c["fxopt"], c["autocast"]) < 0.01
