"""Python's full garbage collections in a cold first call, by phase: before fxopt's compile (dynamo's
tracing), inside it (aot_autograd and fxopt's passes, where fxopt pauses the collector), after it (the
first run and the kernels it waits for).

A full (generation 2) collection walks every tracked object in the process; on a GPU host the process
holds more of them (CUDA, more of torch imported), so each costs more than on the CPU machine. This tells
how much of a first call they take and where, with fxopt's pause (fxopt/gc_pause.py: over each whole
dynamo compile; `--fxopt-only`: inside fxopt's backend call only, as before 2026-12-07) or off:

    T=$(mktemp -d); TORCHINDUCTOR_CACHE_DIR=$T/i TRITON_CACHE_DIR=$T/t FXOPT_CACHE_DIR=$T/f \\
        [FXOPT_COMPILE_GC_PAUSE=0] python -m benchmarks.gc_first_call gpt_stack_train [--backend inductor] \\
        [--fxopt-only]

Run each in a fresh process with empty caches (as the runner's first-call column is).
"""
from __future__ import annotations

import argparse
import gc
import importlib
import sys
import time


from . import measure
from .first_call_profile import made_workload, workload_arguments


class CollectionLog:
    """(start, seconds, generation) of every collection, from gc.callbacks."""

    def __init__(self):
        self.events: list[tuple[float, float, int]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.events.append((self._start, time.perf_counter() - self._start, info["generation"]))


def compile_windows(windows: list) -> None:
    """Record (start, end) of every fxopt.backend.compile_dynamo_graph call (fxopt's whole backend call)."""
    mod = importlib.import_module("fxopt.backend")  # the module (`fxopt.backend` the attribute is a function)
    original = mod.compile_dynamo_graph

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            windows.append((start, time.perf_counter()))
    mod.compile_dynamo_graph = timed


def phase_of(t: float, windows: list) -> str:
    if not windows:
        return "the whole call"
    if any(a <= t <= b for a, b in windows):
        return "inside fxopt's compile"
    return "before it (dynamo)" if t < windows[0][0] else "after it (first run)"


def pause_in_fxopt_only() -> None:
    """The pause as it was before it covered dynamo's tracing: only inside fxopt's backend call."""
    for name in ("fxopt.gc_pause", "fxopt.backend"):
        importlib.import_module(name).pause_dynamo_compiles = lambda: False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gc_first_call", description=__doc__.splitlines()[0])
    workload_arguments(ap)
    ap.add_argument("--fxopt-only", action="store_true",
                    help="pause the collector inside fxopt's backend call only, not over dynamo's tracing")
    args = ap.parse_args(argv)
    import fxopt  # noqa: F401  (imported before the clock, as a user's program would)
    windows: list = []
    if args.fxopt_only:
        pause_in_fxopt_only()
    if args.backend == "fxopt":
        compile_windows(windows)
    w, device, fn, inputs = made_workload(args)
    log = CollectionLog()
    gc.callbacks.append(log)
    with measure.grad_mode(w):
        t0 = time.perf_counter()
        measure.runnable(w, args.backend, fn, fresh=True)(*inputs)
        measure.sync(device)
        wall = time.perf_counter() - t0
    gc.callbacks.remove(log)
    full = [(s, d) for s, d, g in log.events if g == 2 and s >= t0]
    young = [d for s, d, g in log.events if g < 2 and s >= t0]
    print(f"first call of {args.workload} on {args.backend} ({device}): {wall:.2f} s; "
          f"tracked objects after it: {len(gc.get_objects()):,}")
    print(f"full collections: {len(full)} taking {sum(d for _, d in full):.2f} s; "
          f"younger ones: {len(young)} taking {sum(young):.2f} s")
    by_phase: dict[str, list[float]] = {}
    for s, d in full:
        by_phase.setdefault(phase_of(s, windows), []).append(d)
    for phase, ds in by_phase.items():
        print(f"  {phase:24s} {len(ds):3d} full collections, {sum(ds):.2f} s (longest {max(ds):.2f} s)")
    for a, b in windows:
        print(f"  fxopt's compile: {a - t0:.2f} s to {b - t0:.2f} s after the call began ({b - a:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
