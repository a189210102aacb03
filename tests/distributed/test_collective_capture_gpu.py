"""CUDA graphs with NCCL collectives inside (`cudagraphs=True`, fxopt/cudagraph_checks.collective_refusal):
a compiled function that all-gathers and all-reduces is captured once and replayed, and every call
equals eager. One process per GPU (up to two), one NCCL group: on a single GPU the group has one rank
(NCCL then copies, but the capture and the replay go through the same communicator calls).
GPU only; the refusal rules themselves are checked on the CPU in test_collectives.py."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from .test_two_ranks import _overlap, run_on_two_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or not dist.is_available() or not dist.is_nccl_available(),
    reason="needs a GPU and NCCL")]


def _captured_calls(rank: int, device: str) -> dict:
    from helpers import CountingBackend
    backend = CountingBackend(cudagraphs=True)
    fn = torch.compile(_overlap, backend=backend, dynamic=False)
    diffs = []
    for i in range(6):  # 2 warm-up calls, the capture, then replays, each on new values
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(100 * rank + i)).to(device)
        got, want = fn(x), _overlap(x)
        diffs.append(max((g - w).abs().max().item() for g, w in zip(got, want)))
    notes = [n for g in backend.report.graphs for n in g.notes if n.startswith("cudagraphs")]
    return {"diffs": diffs, "notes": notes}


def test_nccl_collectives_are_captured_into_the_cuda_graph_and_replayed():
    results = run_on_two_ranks(_captured_calls, "cuda", world=min(2, torch.cuda.device_count()))
    for rank, r in results.items():
        assert max(r["diffs"]) < 1e-5, (rank, r["diffs"])
        assert any("captured 1 graph" in n for n in r["notes"]), (rank, r["notes"])
        assert not any("refused" in n for n in r["notes"]), (rank, r["notes"])
