"""Python's cyclic garbage collector paused while fxopt compiles a graph.

A compile builds and drops hundreds of thousands of objects (fx nodes, fake tensors, sympy
expressions), and every so many allocations the collector walks all of the process's tracked objects:
torch's modules, dynamo's graph, aot_autograd's traces. For a 24-block GPT-2 stack that is about 560,000
objects per full pass. Its training step's first call on the CPU machine spent 1.9-2.1 s in full
collections; pausing them during fxopt's backend call (aot_autograd and fxopt's own compile) saved
0.85-0.94 s of that (benchmarks/results/2026-12-07-cpu.md). What the compile leaves unreachable is collected by the
first collection after it, as it would have been. Once torch.compile has been handed fxopt's backend,
the pause also covers each whole dynamo compile, its tracing included (pause_dynamo_compiles): on an H100
host that left no full collection in the stack's first call, against seven taking 2.34 s
(benchmarks/results/2026-12-07-h100-b.md). The young collection after the pause still walks what the compile
kept (about 0.9 s there). gc.freeze() would skip that walk, but it would keep the compile's cyclic garbage
(dynamo's tracing state, possibly a real tensor) for good, so the collector gets it.

The collector is process-wide, so the pause is counted: it starts when the first compile enters and
ends when the last one leaves, on any thread. A collector someone else disabled stays disabled, and one
someone enabled meanwhile is left alone. FXOPT_COMPILE_GC_PAUSE=0 leaves the collector alone.
"""
from __future__ import annotations

import functools
import gc

from .counted_override import CountedOverride
from .options import Environment


def _disable() -> bool:
    """True when this disabled the collector (it was running, and FXOPT_COMPILE_GC_PAUSE is not 0)."""
    if gc.isenabled() and Environment.read().compile_gc_pause:
        gc.disable()
        return True
    return False


def _enable(paused: bool) -> None:
    if paused and not gc.isenabled():
        gc.enable()


collector_paused = CountedOverride(_disable, _enable)  # `with collector_paused():` runs a block without it


def pausing_collector(compile_fn):
    """`compile_fn` run with the collector paused (unless FXOPT_COMPILE_GC_PAUSE=0)."""
    @functools.wraps(compile_fn)
    def compile_paused(*args, **kwargs):
        with collector_paused():
            return compile_fn(*args, **kwargs)
    return compile_paused


_started = 0  # dynamo compiles whose start callback entered the pause (an end without one, as when the
# callbacks were registered mid-compile, leaves nothing)


def _dynamo_compile_started(*_args) -> None:
    global _started
    collector_paused.enter()
    _started += 1


def _dynamo_compile_ended(*_args) -> None:
    global _started
    if _started:
        _started -= 1
        collector_paused.leave()


def pause_dynamo_compiles() -> bool:
    """From now on in this process, pause the collector over each whole dynamo compile, not only
    fxopt's part of it: dynamo's tracing comes before any backend is called, and it is where most of the
    full collections left in a first call happen (three of four for the 24-block stack on the CPU
    machine, benchmarks/results/2026-12-07-cpu-b.md). Called when torch.compile is handed fxopt's backend
    (`backend="fxopt"` or `fxopt.backend(...)`), through dynamo's compile start/end callbacks (one pair
    per outermost compile, the end run however it ends), so it covers any dynamo compile in the process
    from then on. torch._dynamo.reset() drops the callbacks; fxopt's next compile registers them again.
    Returns whether they are registered (False on a torch without them)."""
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:
        return False
    if _dynamo_compile_started not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_dynamo_compile_started)
        callback_handler.register_end_callback(_dynamo_compile_ended)
    return True
