"""CUDA graphs on the GPU, memory (marked `gpu`, names contain "cuda"): what the graphs hold against the
general allocator: warm-ups in the shared pool, saved activations lent to the backward. The rest of
the GPU behaviour is in test_cudagraphs_gpu.py, whose autouse checks apply here too.
"""
from __future__ import annotations

import gc

import pytest
import torch

import fxopt
from fxopt import cudagraphs
from test_cudagraphs import boxed, graphed
from test_cudagraphs_gpu import MLP, _fresh_warnings, _random_ops_still_work  # noqa: F401 (autouse fixtures)

gpu = pytest.mark.gpu


@gpu
def test_cuda_graphs_warm_up_in_the_pool_is_not_held_twice(monkeypatch):
    """Warm-ups allocate from the shared pool before its first capture, so the capture reuses what
    they freed: the memory reserved after warm-up, capture and replays is lower by at least one of
    the function's 64 MiB intermediates than with warm-ups in the general allocator."""
    n = 16 * 2**20  # 64 MiB of float32
    held = {}
    for in_pool in (False, True):
        monkeypatch.setattr(cudagraphs, "WARMUP_IN_POOL", in_pool)
        x = torch.randn(n, device="cuda")
        ref = ((x.double() * 2).sin() * x.double()).sum(0, keepdim=True).float()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        g, record = graphed(boxed(lambda t: ((t * 2).sin() * t).sum(0, keepdim=True)), backend=cudagraphs.CudaGraphs())
        for _ in range(5):
            torch.testing.assert_close(g([x])[0], ref, rtol=1e-3, atol=1e-1)
        torch.cuda.synchronize()
        held[in_pool] = torch.cuda.memory_reserved() - before
        assert g.captures == 1 and g.refused is None, record.notes
        del g, record, x
        gc.collect()
    assert held[True] + n * 4 <= held[False], {k: v / 2**20 for k, v in held.items()}


@gpu
def test_cuda_graphs_lending_lowers_the_peak_of_a_training_step(monkeypatch):
    """Saved activations lent instead of copied out (and again into the backward's static inputs):
    a steady-state step's peak is lower than with LEND_SAVED off, by at least the saved bytes."""
    peaks = {}
    for lend in (False, True):
        monkeypatch.setattr(cudagraphs, "LEND_SAVED", lend)
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = MLP(256).cuda()
        compiled = torch.compile(model, backend=fxopt.backend(cudagraphs=True))
        x = torch.randn(16, 128, 256, device="cuda")
        for step in range(6):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            loss = compiled(x).square().mean()
            loss.backward()
            del loss
            torch.cuda.synchronize()
            peaks[lend] = torch.cuda.max_memory_allocated() - base
            model.zero_grad(set_to_none=False)
    saved = 16 * 128 * 256 * 4 * 4  # at least the [16, 128, 1024] fp32 hidden activation
    assert peaks[True] + saved <= peaks[False], peaks
