"""Where a cold first call's seconds go: cProfile of one workload's compile + first run, in this process.

Run it with empty compiler caches, as the runner's first-call column does (a fresh process each time):

    T=$(mktemp -d); TORCHINDUCTOR_CACHE_DIR=$T/i TRITON_CACHE_DIR=$T/t FXOPT_CACHE_DIR=$T/f \\
        python -m benchmarks.first_call_profile gpt_block_train [--backend fxopt] [--top 45]

Prints the first call's wall time, the slowest functions by cumulative and by own time, and which
modules were first imported during the call and by whom (`--imports`: e.g. Inductor's lowerings pulled
in by a torch helper). Under the profiler everything is slower (about 1.5x); the shares are what count.
`--timeline` runs without the profiler and prints when each compile step started and ended, on which
thread (cProfile sees only the main thread: it cannot show what overlaps), then Triton's own time per
compile stage of each kernel (benchmarks/compile_stages.py: Python front end, MLIR lowerings, ptxas).
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

from . import compile_stages, measure, workloads
from .thread_sampler import MainThreadSampler


# (module, function) pairs --timeline times; Triton's launcher build is named differently across versions
TIMELINE = [("fxopt.backend", "compile_dynamo_graph"), ("fxopt.backend", "aot_compile"),
            ("fxopt.backend", "compile_aten_graph"), ("fxopt.compile", "precompile"),
            ("fxopt.codegen.precompile", "_compile_in_workers"), ("fxopt.codegen.precompile", "_preload_own_op"), ("triton.compiler", "compile"),
            ("triton.compiler.compiler", "compile"), ("triton.backends.nvidia.compiler", "get_ptxas_version"),
            ("triton.backends.nvidia.driver", "compile_module_from_src"),
            ("triton.backends.nvidia.driver", "compile_module_from_file")]


def install_timeline(events: list) -> None:
    """Wrap each TIMELINE function so every call appends (start, end, name, thread) to `events`."""
    import importlib
    import threading

    for mod_name, fn_name in TIMELINE:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        fn = getattr(mod, fn_name, None)
        if fn is None or getattr(fn, "_timed", False):
            continue

        def timed(*a, __fn=fn, __name=f"{mod_name}.{fn_name}", **kw):
            start = time.perf_counter()
            try:
                return __fn(*a, **kw)
            finally:
                label = __name
                if __name.endswith(".compile") and a:  # which kernel
                    label += f" {getattr(getattr(a[0], 'fn', None), '__name__', '')}"
                events.append((start, time.perf_counter(), label, threading.current_thread().name))

        timed._timed = True
        setattr(mod, fn_name, timed)


def print_timeline(events: list, t0: float) -> None:
    for start, end, name, thread in sorted(events):
        print(f"{start - t0:7.3f} -> {end - t0:7.3f} s  ({end - start:6.3f})  {name}  [{thread}]")


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


def workload_arguments(ap: argparse.ArgumentParser) -> None:
    """The workload and how to compile it: what every first-call probe takes."""
    ap.add_argument("workload")
    ap.add_argument("--backend", default="fxopt", choices=["fxopt", "inductor"])
    ap.add_argument("--dtype", default="bf16", choices=sorted(measure.DTYPES))
    ap.add_argument("--quick", action="store_true", help="the workload's small shapes")


def made_workload(args):
    """(workload, device, function, inputs) of workload_arguments' choices, made and synchronised."""
    w = workloads.get(args.workload)[0]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fn, inputs = w.make(device, measure.DTYPES[args.dtype], args.quick)
    measure.sync(device)
    return w, device, fn, inputs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.first_call_profile", description=__doc__.splitlines()[0])
    workload_arguments(ap)
    ap.add_argument("--top", type=int, default=45)
    ap.add_argument("--imports", default="torch._inductor,torch.ao,torch.export",
                    help="comma-separated module prefixes whose first import is traced ('' for none)")
    ap.add_argument("--timeline", action="store_true", help="no profiler: when each compile step ran, per thread")
    ap.add_argument("--sample-main", action="store_true",
                    help="with --timeline: the main thread's most frequent stack in each 0.2 s of the call")
    args = ap.parse_args(argv)
    events: list = []
    stages: list = []
    if args.timeline:
        install_timeline(events)
        compile_stages.install(stages)
    import fxopt  # noqa: F401  (imported before the clock, as a user's program would)
    w, device, fn, inputs = made_workload(args)
    tracer = ImportTracer(tuple(p for p in args.imports.split(",") if p))
    sys.meta_path.insert(0, tracer)
    profile = cProfile.Profile()
    sampler = MainThreadSampler().start() if args.timeline and args.sample_main else None
    with measure.grad_mode(w):
        t0 = time.perf_counter()
        if not args.timeline:
            profile.enable()
        measure.runnable(w, args.backend, fn, fresh=True)(*inputs)
        measure.sync(device)
        profile.disable()
    how = "with timed compile steps" if args.timeline else "under cProfile"
    print(f"first call of {args.workload} on {args.backend} ({device}): {time.perf_counter() - t0:.2f} s {how}")
    if args.timeline:
        install_timeline(events)  # modules fxopt imported late (its own) are wrapped now, for a second look
        print_timeline(events, t0)
        print(compile_stages.table(stages))
        if sampler is not None:
            sampler.stop()
            print("main thread, most frequent stack per 0.2 s (samples of it / all, innermost frame first):")
            print("\n".join(sampler.slices(t0)))
        return 0
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(args.top // 2)
    print(out.getvalue())
    for g in (g for rep in measure.FXOPT_REPORTS for g in rep.graphs):
        passes = sum(p.seconds for p in g.passes)
        print(f"fxopt {g.name} graph: compiled in {g.compile_seconds:.2f} s: passes {passes:.2f} s, Triton "
              f"{g.triton_compile_seconds:.2f} s ({len(g.kernels)} generated kernels and the own ops' kernels; "
              f"in the background for training graphs: see --timeline)")
    for name, frames in tracer.seen:
        print(f"imported {name} <- {' | '.join(frames)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
