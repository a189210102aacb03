"""codegen/warm_ops.py: each distinct call of fxopt's own ops in a graph (attention, cross-entropy) is run
once at compile time on scratch tensors of its exact layout, so its kernels compile beside the
generated ones instead of at the first call. Here on the CPU (the calls run the interpreted kernels);
the compile-time precompile itself only runs for CUDA graphs (its effect on the first call is measured
in benchmarks/results/2026-12-02-h200-e.md)."""
import torch

import fxopt
from fxopt.codegen import direct_calls
from fxopt.codegen.warm_ops import scratch_like, warm_calls


def test_scratch_has_the_layout_of_the_value():
    base = torch.randn(2, 8, 12)
    view = base[:, :, 4:8].transpose(1, 2)  # strides (96, 1, 12), storage offset 4
    s = scratch_like(view)
    assert (s.shape, s.stride(), s.storage_offset(), s.dtype) == (view.shape, view.stride(), 4, view.dtype)
    idx = scratch_like(torch.ones(5, dtype=torch.int64))
    assert idx.dtype == torch.int64 and not idx.any()  # integer scratch is zeros: indices stay in range
    assert scratch_like(torch.tensor(3.0)).item() == 1.0  # a 0-d scale is a valid scale


def _graphs():
    """Two identical causal attention calls, trained: forward and backward graphs."""
    def attend(q, k, v):
        t = q.shape[-2]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=q.device), diagonal=1)
        return torch.softmax((q @ k.transpose(-2, -1) / 4).masked_fill(mask, float("-inf")), -1) @ v

    def f(q, k, v):
        return attend(attend(q, k, v), k, v)
    q, k, v = (torch.randn(1, 2, 16, 16, requires_grad=True) for _ in range(3))
    rep = fxopt.explain(f, q, k, v)
    return {g.name: rep.graph(after="cleanup_after_fuse", graph=g.name) for g in rep.graphs}


def test_each_distinct_attention_call_is_run_once_on_scratch_of_its_layout(monkeypatch):
    graphs = _graphs()
    seen, done = [], []
    real = direct_calls.flash_attention
    monkeypatch.setattr(direct_calls, "flash_attention", lambda *a: seen.append(a) or done.append(real(*a)))
    calls = warm_calls(graphs["forward"])
    assert len(calls) == 1  # the two calls have the same layouts and arguments: one warm-up serves both
    node = next(n for n in graphs["forward"].graph.nodes if "flash_attention" in str(n.target))
    calls[0]()
    assert len(done) == 1  # the interpreted kernels ran on the scratch (a failure is only logged)
    (args,) = seen
    for a, n in zip(args, node.args):
        if isinstance(a, torch.Tensor):
            val = n.meta["val"]
            assert (a.shape, a.stride(), a.dtype) == (val.shape, val.stride(), val.dtype)
        else:
            assert a == n
    assert len(warm_calls(graphs["backward"])) == 1


def test_calls_whose_scratch_would_not_fit_are_left_to_their_first_call():
    graphs = _graphs()
    assert warm_calls(graphs["forward"], free_bytes=1024) == []  # a quarter of 1 KiB holds no q, k, v
