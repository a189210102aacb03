"""Where a compiled step's host time goes, line by line, with little overhead: every thread's Python
stack sampled from a daemon thread while the step runs in a loop.

    PYTHONPATH=. python -m benchmarks.host_sample --workloads gpt_block_train [--seconds 3] [--top 25]

cProfile (benchmarks/host_profile.py) traces every call and so inflates the cost of small Python
functions several times over; a sampler leaves them at their size. The sampler thread reads the
stacks when the interpreter switches threads (the switch interval is set to 20 us for the run), so a
sample lands where Python runs or where a C call releases the GIL. The backward runs on autograd's
device thread, which is why all threads are sampled, not only the main one.

Two tables: samples by the line of a generated wrapper (`call` of a file fxopt wrote) that was
running, with the line's text, and samples by innermost frame.
"""
from __future__ import annotations

import argparse
import collections
import linecache
import os
import sys
import threading
import time

from . import measure
from .host_profile import warm_workloads, workload_arguments


def is_wrapper(code) -> bool:
    """A generated wrapper's `call` (fxopt's module cache names its files fx_<hash of the source>.py)."""
    return code.co_name == "call" and os.path.basename(code.co_filename).startswith("fx_")


class StackSampler:
    def __init__(self, interval: float = 0.0002):
        self.interval = interval
        self.by_line: collections.Counter = collections.Counter()
        self.by_leaf: collections.Counter = collections.Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="stack-sampler")

    def __enter__(self):
        self._old = sys.getswitchinterval()
        sys.setswitchinterval(2e-5)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._old)

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            for ident, frame in sys._current_frames().items():
                if ident == me or _idle(frame):
                    continue
                self.samples += 1
                leaf = frame.f_code
                self.by_leaf[(os.path.basename(leaf.co_filename), leaf.co_name, frame.f_lineno)] += 1
                f = frame
                while f is not None and not is_wrapper(f.f_code):
                    f = f.f_back
                if f is not None:
                    self.by_line[(f.f_code.co_filename, f.f_lineno)] += 1


def _idle(frame) -> bool:
    """A thread parked in a wait (the autograd device thread between backwards, pool workers)."""
    name = frame.f_code.co_name
    return name in ("wait", "_wait_for_tstate_lock", "get", "select", "_worker", "worker") and frame.f_back is None \
        or name in ("wait", "_wait_for_tstate_lock")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_sample", description=__doc__.splitlines()[0])
    workload_arguments(p)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    for w, compiled, inputs, device in warm_workloads(args.workloads, args.backend, args.dtype):
        with measure.grad_mode(w):
            calls, t0 = 0, time.perf_counter()
            with StackSampler() as s:
                while time.perf_counter() - t0 < args.seconds:
                    compiled(*inputs)
                    measure.sync(device)  # the GPU idle at each call's start: its host time is its own
                    calls += 1
        print(f"== {w.name} via {args.backend}: {calls} calls, {s.samples} samples "
              f"({s.samples / calls:.1f} per call)")
        print(f"-- by generated wrapper line ({sum(s.by_line.values())} samples inside a wrapper)")
        for (file, line), n in s.by_line.most_common(args.top):
            text = linecache.getline(file, line).strip()
            print(f"  {100 * n / s.samples:5.1f}%  {os.path.basename(file)[:16]}:{line:<4d} {text[:110]}")
        print("-- by innermost frame")
        for (file, name, line), n in s.by_leaf.most_common(args.top):
            print(f"  {100 * n / s.samples:5.1f}%  {file}:{name}:{line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
