"""Allocator behaviour of one call (the memory-planning issue): allocation requests, peak, and
fragmentation (reserved - allocated after the call), eager vs Inductor vs fxopt vs fxopt with the
arena applied (memory_plan="apply").

    PYTHONPATH=. python -m benchmarks.allocator_stats --workloads gpt_block,gpt_block_train,softmax

The measured call follows WARM_CALLS calls, so a CUDA-graph workload's call is a replay (both compilers
capture at their third call or earlier). CUDA only: the counts come from torch.cuda.memory_stats()
("allocation.all.allocated": requests served by the caching allocator; "segment.all.allocated":
cudaMalloc calls).
"""
from __future__ import annotations

import argparse
import gc

import torch

from . import measure, workloads

VARIANTS = (("eager", {}), ("inductor", {}), ("fxopt", {}), ("fxopt", {"memory_plan": "apply"}))


WARM_CALLS = 4  # before the measured call: compiled, caches filled, CUDA graphs (both compilers) captured


def one_call_stats(call, grad) -> dict:
    with grad:
        for _ in range(WARM_CALLS):
            call()
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_stats()
        out = call()
        torch.cuda.synchronize()
        after = torch.cuda.memory_stats()
    del out
    gc.collect()
    return {
        "allocs": after["allocation.all.allocated"] - before["allocation.all.allocated"],
        "cuda_mallocs": after["segment.all.allocated"] - before["segment.all.allocated"],
        "peak_mib": (after["allocated_bytes.all.peak"] - before["allocated_bytes.all.current"]) / 2**20,
        "frag_mib": (torch.cuda.memory_reserved() - torch.cuda.memory_allocated()) / 2**20,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.allocator_stats", description=__doc__.splitlines()[0])
    p.add_argument("--workloads", required=True)
    p.add_argument("--dtype", default="bf16", choices=sorted(measure.DTYPES))
    args = p.parse_args(argv)
    print(f"{'workload':20s} {'backend':16s} {'allocs':>7s} {'cudaMalloc':>10s} {'peak_MiB':>9s} {'reserved-allocated_MiB':>23s}")
    for w in workloads.get(args.workloads):
        for backend, options in VARIANTS:
            torch._dynamo.reset()
            gc.collect()
            torch.cuda.empty_cache()
            torch.manual_seed(0)
            fn, inputs = w.make("cuda", measure.DTYPES[args.dtype], False)
            measure.FXOPT_OPTIONS.clear()
            measure.FXOPT_OPTIONS.update(options)
            compiled = measure.compile_for(backend, fn, w)
            s = one_call_stats(lambda: compiled(*inputs), measure.grad_mode(w))
            name = backend + ("+apply" if options else "")
            print(f"{w.name:20s} {name:16s} {s['allocs']:7d} {s['cuda_mallocs']:10d} {s['peak_mib']:9.1f} {s['frag_mib']:23.1f}")
            fn = inputs = compiled = None  # freed before the next variant allocates
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
