"""Host time per call against GPU time per call: is a workload launch-bound (the host slower than the GPU)?

    PYTHONPATH=. python -m benchmarks.host_time --workloads gpt_block_train,llama_block_mixed [--backends inductor,fxopt]

host_ms: wall time from the call until it returns, the GPU idle and synchronized before each call (so
no queue is full and the number is the host's own work: Python, dispatch, launches; a call that syncs
inside also counts its wait). gpu_ms: the runner's median (CUDA events around back-to-back calls).
A workload whose host_ms is near or above gpu_ms is host-bound: fewer or cheaper launches help it,
faster kernels do not.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from . import measure, workloads


def host_ms(call, calls: int) -> float:
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_time", description=__doc__.splitlines()[0])
    p.add_argument("--workloads", required=True, help="comma-separated workload names")
    p.add_argument("--backends", default="inductor,fxopt")
    p.add_argument("--dtype", default="bf16", choices=sorted(measure.DTYPES))
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--dynamic", action="store_true", help="compile with dynamic=True (symbolic sizes)")
    args = p.parse_args(argv)
    if args.dynamic:
        measure.DYNAMIC[0] = True
    if not torch.cuda.is_available():
        print("host_time needs a CUDA device")
        return 0
    print(f"{'workload':20s} {'backend':9s} {'host_ms':>8s} {'gpu_ms':>8s}  host/gpu")
    for name in args.workloads.split(","):
        w = workloads.WORKLOADS[name]
        fn, inputs = w.make("cuda", measure.DTYPES[args.dtype], False)
        for backend in args.backends.split(","):
            compiled = measure.runnable(w, backend, fn)
            with measure.grad_mode(w):
                call = lambda: compiled(*inputs)  # noqa: E731
                for _ in range(3):
                    call()
                host = host_ms(call, args.calls)
                gpu = measure.bench_ms(call, "cuda", 10, 50)
            print(f"{name:20s} {backend:9s} {host:8.3f} {gpu:8.3f}  {host / gpu:6.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
