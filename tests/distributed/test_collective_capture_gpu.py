"""CUDA graphs with NCCL collectives inside (`cudagraphs=True`, fxopt/cudagraph_checks.collective_refusal):
a compiled function that all-gathers and all-reduces is captured once and replayed, and every call
equals eager. One process per GPU (up to two), one NCCL group: on a single GPU the group has one rank
(NCCL then copies, but the capture and the replay go through the same communicator calls).
GPU only; the refusal rules themselves are checked on the CPU in test_collectives.py."""
from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or not dist.is_available() or not dist.is_nccl_available(),
    reason="needs a GPU and NCCL")]


def _gather_and_reduce(x):
    import torch.distributed._functional_collectives as funcol
    y = torch.sigmoid(x) * 2
    gathered = funcol.all_gather_tensor(y + 1, 0, dist.group.WORLD)
    reduced = funcol.all_reduce(torch.sin(x) * 3 + y, "sum", dist.group.WORLD)
    return gathered * 2, reduced + 1


def _job(rank: int) -> dict:
    from helpers import CountingBackend
    backend = CountingBackend(cudagraphs=True)
    fn = torch.compile(_gather_and_reduce, backend=backend, dynamic=False)
    diffs = []
    for i in range(6):  # 2 warm-up calls, the capture, then replays, each on new values
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(100 * rank + i)).cuda()
        got, want = fn(x), _gather_and_reduce(x)
        diffs.append(max((g - w).abs().max().item() for g, w in zip(got, want)))
    notes = [n for g in backend.report.graphs for n in g.notes if n.startswith("cudagraphs")]
    return {"diffs": diffs, "notes": notes}


def _worker(rank, world, port, queue):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TRITON_INTERPRET="0")
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
        try:
            queue.put((rank, _job(rank)))
        finally:
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 (reported to the test, never a hang)
        queue.put((rank, {"error": traceback.format_exc()[-4000:]}))


def test_nccl_collectives_are_captured_into_the_cuda_graph_and_replayed():
    world = min(2, torch.cuda.device_count())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    for rank, r in results.items():
        assert "error" not in r, r.get("error")
        assert max(r["diffs"]) < 1e-5, (rank, r["diffs"])
        assert any("captured 1 graph" in n for n in r["notes"]), (rank, r["notes"])
        assert not any("refused" in n for n in r["notes"]), (rank, r["notes"])
