"""Where a benchmark workload's fxopt time goes: fxopt.profile over the workload's own function and inputs.

    PYTHONPATH=. python -m benchmarks.profile_workload --workloads gpt_block_train,llama_block_mixed [--quick] [--dynamic]

Each workload is compiled with the options the runner gives fxopt (precision for a mixed workload,
plus --fxopt-option KEY=VALUE), and fxopt.profile prints each kernel and ATen call with its measured
time and % of its roofline, sorted by time (CUDA events on a GPU; wall clock on a CPU).
"""
from __future__ import annotations

import argparse

import torch

import fxopt

from . import measure, workloads


def _detached(fn):
    def detached(*args):
        return tuple(t.detach() for t in workloads.tensors(fn(*args)))
    return detached


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_workload", description=__doc__.splitlines()[0])
    p.add_argument("--workloads", required=True, help="comma-separated workload names")
    p.add_argument("--dtype", default="bf16", choices=sorted(measure.DTYPES))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--top", type=int, default=25, help="rows to print, slowest first (default 25)")
    p.add_argument("--fxopt-option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--inductor", action="store_true",
                   help="also list fxopt's and Inductor's GPU kernels per call (torch.profiler)")
    p.add_argument("--dynamic", action="store_true", help="compile with dynamic=True (symbolic sizes), fxopt "
                   "and (with --inductor) Inductor")
    args = p.parse_args(argv)
    measure.DYNAMIC[0] = True if args.dynamic else None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    extra = dict(measure.parse_fxopt_option(o) for o in args.fxopt_option)
    for w in workloads.get(args.workloads):
        torch._dynamo.reset()
        torch.manual_seed(0)
        fn, inputs = w.make(device, measure.DTYPES[args.dtype], args.quick)
        options = {**({"precision": w.precision} if w.precision else {}), **extra}
        if w.training:  # fn runs its own backward; its outputs must not send profile() into a second one
            fn = _detached(fn)
        with measure.grad_mode(w):
            prof = fxopt.profile(fn, *inputs, repeat=args.repeat, dynamic=args.dynamic, **options)
        rows = sorted(prof.rows, key=lambda r: -r.seconds)[:args.top]
        print(f"== {w.name} ({device}, options {options})")
        print("\n".join(str(prof).splitlines()[:4]))
        for r in rows:
            pct = f"{r.percent_of_roofline:5.1f}%" if r.percent_of_roofline is not None else "    - "
            print(f"  {r.graph:12s} {r.name[:44]:44s} {r.kind:10s} x{r.calls:<3d} {r.seconds * 1e3:8.4f} ms  {pct}")
        if args.inductor and device == "cuda":
            for backend in ("fxopt", "inductor"):
                _gpu_kernels(w, fn, inputs, args.repeat, args.top, backend)
    return 0


def _gpu_kernels(w, fn, inputs, repeat: int, top: int, backend: str) -> None:
    """A backend's GPU kernels for the call, by GPU time per call (torch.profiler: no host gaps counted,
    unlike the CUDA events around each region above), for comparing fxopt with Inductor."""
    from torch.profiler import ProfilerActivity, profile
    compiled = measure.compile_for(backend, fn, w)
    with measure.grad_mode(w):
        for _ in range(3):
            compiled(*inputs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(repeat):
                compiled(*inputs)
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events) / repeat / 1e3
    print(f"== {w.name} through {backend}: {total:.4f} ms of GPU kernels per call")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:top]:
        print(f"  {e.key[:60]:60s} x{e.count // repeat:<3d} {e.device_time_total / repeat / 1e3:8.4f} ms")


if __name__ == "__main__":
    raise SystemExit(main())
