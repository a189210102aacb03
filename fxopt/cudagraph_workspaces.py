"""cuBLAS workspaces freed under captured graphs: when anyone clears them, fxopt's graphs are retired.

A captured matmul keeps using the cuBLAS workspace of the stream it was captured on: the graph holds
its address, not the memory. `torch._C._cuda_clearCublasWorkspaces()` frees every workspace, and
Inductor's CUDA-graph trees call it before and after each of their warm-ups and recordings. The
freed block returns to the pool it came from (fxopt allocates it inside a capture, into the graphs'
pool: cudagraphs.CudaGraphs), where a later capture may allocate over it, or, once that pool's
callable is gone, to the device: a graph replayed after that reads or writes memory it does not own.
On the H200, Inductor's reduce-overhead block and two fxopt callables (static and dynamic shapes) in
one process ended in "an illegal memory access" (benchmarks/results/2026-12-01-h200-i.md).

So the clear is watched: `watch(callable)` registers a graphed callable, and a clear marks every
registered one; each retires its graphs at its own next call, before anything of its runs or
captures again, and captures anew after the usual warm-up (a fresh workspace, allocated inside the
new capture). Marking only, inside the clear: no CUDA work happens in someone else's code path.
"""
from __future__ import annotations

import weakref

import torch

_WATCHED: weakref.WeakSet = weakref.WeakSet()


def watch(graphed) -> None:
    """Mark `graphed` (an object with a `workspaces_cleared` flag) whenever cuBLAS's workspaces are cleared."""
    _install()
    _WATCHED.add(graphed)


def cleared() -> None:
    """What a clear does for fxopt: mark every watched callable (tests call it directly)."""
    for graphed in list(_WATCHED):
        graphed.workspaces_cleared = True


def _install() -> None:
    """Wrap torch's clear once per process (absent on builds without CUDA: nothing to watch there)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None or getattr(clear, "_fxopt_watched", False):
        return

    def clearing(*args, **kwargs):
        cleared()
        return clear(*args, **kwargs)

    clearing._fxopt_watched = True
    torch._C._cuda_clearCublasWorkspaces = clearing
