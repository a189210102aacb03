"""Python's cyclic garbage collector paused while fxopt compiles a graph.

A compile builds and drops hundreds of thousands of objects (fx nodes, fake tensors, sympy
expressions), and every so many allocations the collector walks all of the process's tracked objects:
torch's modules, dynamo's graph, aot_autograd's traces. For a 24-block GPT-2 stack that is about 560,000
objects per full pass. Its training step's first call on the CPU machine spent 2.3 s in collections, about
0.8-1.0 s of them inside fxopt's backend call (aot_autograd and fxopt's own compile), which the pause
removes (benchmarks/results/2026-12-07-cpu.md). What the compile leaves unreachable is collected by the
first collection after it, as it would have been.

The collector is process-wide, so the pause is counted: it starts when the first compile enters and
ends when the last one leaves, on any thread. A collector someone else disabled stays disabled, and one
someone enabled meanwhile is left alone. FXOPT_COMPILE_GC_PAUSE=0 leaves the collector alone.
"""
from __future__ import annotations

import contextlib
import gc
import threading

_lock = threading.Lock()
_active = 0
_paused = False  # this module disabled the collector (it was enabled when the first compile entered)


@contextlib.contextmanager
def collector_paused(enabled: bool = True):
    """Run the block with the cyclic collector disabled (enabled=False: leave it as it is)."""
    global _active, _paused
    if not enabled:
        yield
        return
    with _lock:
        if _active == 0 and gc.isenabled():
            gc.disable()
            _paused = True
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                if _paused and not gc.isenabled():
                    gc.enable()
                _paused = False
