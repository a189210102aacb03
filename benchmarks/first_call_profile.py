"""Where a cold first call's seconds go: cProfile of one workload's compile + first run, in this process.

Run it with empty compiler caches, as the runner's first-call column does (a fresh process each time):

    T=$(mktemp -d); TORCHINDUCTOR_CACHE_DIR=$T/i TRITON_CACHE_DIR=$T/t FXOPT_CACHE_DIR=$T/f \\
        python -m benchmarks.first_call_profile gpt_block_train [--backend fxopt] [--top 45]

Prints the first call's wall time, the slowest functions by cumulative and by own time, and which
modules were first imported during the call and by whom (`--imports`: e.g. Inductor's lowerings pulled
in by a torch helper). Under the profiler everything is slower (about 1.5x); the shares are what count.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
import traceback

import torch

from . import measure, workloads


class ImportTracer:
    """Records the first import of each module matching `prefixes`, with the frames that asked for it."""

    def __init__(self, prefixes: tuple[str, ...]):
        self.prefixes, self.seen = prefixes, []

    def find_spec(self, name, path=None, target=None):
        if name.startswith(self.prefixes) and name not in sys.modules:
            frames = [f"{f.filename.rsplit('site-packages/', 1)[-1]}:{f.lineno}"
                      for f in traceback.extract_stack()[:-1] if "importlib" not in f.filename]
            self.seen.append((name, frames[-6:]))
        return None  # never loads anything itself


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.first_call_profile", description=__doc__.splitlines()[0])
    ap.add_argument("workload")
    ap.add_argument("--backend", default="fxopt", choices=["fxopt", "inductor"])
    ap.add_argument("--dtype", default="bf16", choices=sorted(measure.DTYPES))
    ap.add_argument("--quick", action="store_true", help="the workload's small shapes")
    ap.add_argument("--top", type=int, default=45)
    ap.add_argument("--imports", default="torch._inductor,torch.ao,torch.export",
                    help="comma-separated module prefixes whose first import is traced ('' for none)")
    args = ap.parse_args(argv)
    import fxopt  # noqa: F401  (imported before the clock, as a user's program would)
    w = workloads.get(args.workload)[0]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fn, inputs = w.make(device, measure.DTYPES[args.dtype], args.quick)
    measure.sync(device)
    tracer = ImportTracer(tuple(p for p in args.imports.split(",") if p))
    sys.meta_path.insert(0, tracer)
    profile = cProfile.Profile()
    with measure.grad_mode(w):
        t0 = time.perf_counter()
        profile.enable()
        measure.runnable(w, args.backend, fn, fresh=True)(*inputs)
        measure.sync(device)
        profile.disable()
    print(f"first call of {args.workload} on {args.backend} ({device}): {time.perf_counter() - t0:.2f} s under cProfile")
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(args.top // 2)
    print(out.getvalue())
    for g in (g for rep in measure.FXOPT_REPORTS for g in rep.graphs):
        passes = sum(p.seconds for p in g.passes)
        print(f"fxopt {g.name} graph: compiled in {g.compile_seconds:.2f} s: passes {passes:.2f} s, Triton "
              f"{g.triton_compile_seconds:.2f} s ({len(g.kernels)} kernels; attention kernels compile at their "
              f"first launch)")
    for name, frames in tracer.seen:
        print(f"imported {name} <- {' | '.join(frames)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
