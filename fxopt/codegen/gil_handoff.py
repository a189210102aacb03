"""A shorter GIL switch interval while compile threads run beside a busy main thread.

A thread that leaves the GIL for C work (hashing a file, waiting for ptxas or the host compiler)
needs it back after each piece, and while the main thread runs Python (dynamo and aot_autograd
tracing, fxopt's passes) it gets it only when the interpreter's switch interval runs out: 5 ms by
default. Triton's per-process key hashes its ~500 MB shared library in 1 MiB reads, two hand-offs
each: 0.33 s alone on the CI machine, up to 5.9 s beside a busy thread, 0.66 s with a 0.2 ms interval
and the busy thread no slower there (`python -m benchmarks.key_beside_tracing`; on the H200 host one
sample: 2.45 -> 0.69 s, the busy thread 2.18 -> 3.49 s). On the H200 host the key took 2.4 s of a GPT-2
training step's cold first call (benchmarks/results/2026-12-04-h200-f.md).

Only for threads that mostly wait in C while the main thread's own work is not what the first call
waits for: the keys and driver threads during tracing, and a foreground precompile (the main thread
just waits for it). Where the main thread is the critical path and other threads run Python (kernel
front ends compiling in the background while it compiles the backward graph), a short interval hands
them more of the GIL and slowed that first call by 1.1 s.

The interval is process-wide, so it is set only while some compile phase runs (phases are counted,
on any thread) and the previous value is put back after the last one ends, unless someone else
changed it meanwhile. An interval already shorter is left alone. FXOPT_COMPILE_SWITCH_INTERVAL sets
the value (seconds, default 0.0002; 0: leave the interpreter's interval alone).
"""
from __future__ import annotations

import sys

from ..counted_override import CountedOverride
from ..options import Environment


def _shorten() -> tuple[float, float]:
    """(the interval before, the interval the phases run with), the latter set."""
    saved = sys.getswitchinterval()
    wanted = Environment.read().compile_switch_interval
    chosen = wanted if 0 < wanted < saved else saved
    if chosen != saved:
        sys.setswitchinterval(chosen)
    return saved, chosen


def _restore(token: tuple[float, float]) -> None:
    saved, chosen = token
    if abs(sys.getswitchinterval() - chosen) < 2e-6:  # nobody else changed it (it keeps µs)
        sys.setswitchinterval(saved)


# Run a block with the switch interval at most FXOPT_COMPILE_SWITCH_INTERVAL's (0.2 ms: 0.1 ms gave the
# key thread little more and cost the busy thread time).
quick_handoff = CountedOverride(_shorten, _restore)
