"""Where fxopt's host time goes: cProfile over repeated calls of a workload, top functions by own time.

    PYTHONPATH=. python -m benchmarks.host_profile --workloads gpt_block_train [--calls 50] [--top 30] [--dynamic]

A workload is host-bound when benchmarks/host_time.py shows host_ms near its gpu_ms: then these are the
lines to make cheaper (Python in the wrapper, launches, dispatcher calls, autograd).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats

import torch

from . import measure, workloads


def launch_paths() -> str:
    """How fxopt's kernels were launched in this process: Triton's JIT path, the fast path through
    Triton's launcher or through torch's C launcher, and why kernels kept Triton's launcher."""
    from fxopt.codegen import fast_launch
    kernels = list(fast_launch.ALL)
    refused: dict[str, int] = {}
    for k in kernels:
        if k.static_refused:
            refused[k.static_refused] = refused.get(k.static_refused, 0) + 1
    total = lambda attr: sum(getattr(k, attr) for k in kernels)  # noqa: E731
    return (f"launch paths: {total('triton_launches')} through Triton's JIT, {total('fast_launches')} fast, of "
            f"which {total('static_launches')} through torch's C launcher; kernels refused by it: {refused or 'none'}")


def workload_arguments(p: argparse.ArgumentParser) -> None:
    """--workloads, --backend, --dtype: what the host profilers (this one, host_sample.py) run."""
    p.add_argument("--workloads", required=True)
    p.add_argument("--backend", default="fxopt")
    p.add_argument("--dtype", default="bf16", choices=sorted(measure.DTYPES))


def warm_workloads(names: str, backend: str, dtype: str):
    """(workload, compiled, inputs, device) per named workload, compiled and called three times (the
    first-call work and the allocator's growth done), the device synchronized."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for w in workloads.get(names):
        fn, inputs = w.make(device, measure.DTYPES[dtype], device == "cpu")
        compiled = measure.runnable(w, backend, fn)
        with measure.grad_mode(w):
            for _ in range(3):
                compiled(*inputs)
        measure.sync(device)
        yield w, compiled, inputs, device


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_profile", description=__doc__.splitlines()[0])
    workload_arguments(p)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--dynamic", action="store_true", help="compile with dynamic=True (symbolic sizes)")
    args = p.parse_args(argv)
    measure.DYNAMIC[0] = args.dynamic
    for w, compiled, inputs, device in warm_workloads(args.workloads, args.backend, args.dtype):
        with measure.grad_mode(w):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                compiled(*inputs)
            measure.sync(device)
            prof.disable()
        stats = pstats.Stats(prof)
        print(f"== {w.name} via {args.backend}: {stats.total_tt / args.calls * 1e3:.3f} ms host per call "
              f"(cProfile's own overhead included); top {args.top} by own time per call")
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:args.top]
        for (file, line, name), (cc, nc, tt, ct, _) in rows:
            where = f"{os.path.basename(file)}:{line}"
            print(f"  {tt / args.calls * 1e3:7.3f} ms own {ct / args.calls * 1e3:7.3f} ms cum  "
                  f"x{nc // args.calls:<4d} {name[:40]:40s} {where[:50]}")
        if args.backend.startswith("fxopt"):
            print("  " + launch_paths())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
