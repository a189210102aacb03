"""Attention's launch decisions, made once per input layout and reused on every later call.

Before it launches anything, an attention entry point checks its inputs (shapes, dtypes, devices),
picks the tile config for the head dim, sequence lengths and dtype, and decides whether the TMA
kernels can read the tensors (device capability, alignment of pointers and strides, tiles that fit).
All of that depends only on the tensors' layouts (shape, strides, dtype, device, 16-byte alignment of
the data pointer) and on scale, causal and the caller's config, and a compiled model calls attention
with the same layouts every step: on the H200 host the decisions cost about as much Python as the
launches that follow (cProfile of the GPT-2 training step, benchmarks/results/2026-12-01-h200-c.md).
`planned(decide)` keeps each decision keyed by exactly those facts, so a layout that changes in any of
them is decided afresh, and an input the checks reject is rejected on every call (errors are not
kept).
"""
from __future__ import annotations

from typing import Callable

MAX_PLANS = 64  # distinct layouts kept per entry point (a model has a handful; the cache is cleared past this)


def layout_key(tensors: tuple) -> tuple:
    """Everything about `tensors` a launch decision may read (None stays None)."""
    return tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15)
                 for t in tensors)


def frozen(config: dict | None):
    """A hashable form of a caller's config (None when there is none)."""
    return None if config is None else tuple(sorted(config.items()))


def planned(decide: Callable) -> Callable:
    """`decide(tensors, *facts)` memoised on (layout_key(tensors), *facts). Inputs that are not tensors,
    or facts that cannot be hashed, are decided on every call (the checks then say what is wrong)."""
    cache: dict = {}

    def plan(tensors: tuple, *facts):
        try:
            key = (layout_key(tensors), *facts)
            hit = cache.get(key)
        except (AttributeError, TypeError):
            return decide(tensors, *facts)
        if hit is None:
            hit = decide(tensors, *facts)
            if len(cache) >= MAX_PLANS:
                cache.clear()
            cache[key] = hit
        return hit

    plan.cache = cache
    plan.__doc__ = decide.__doc__
    return plan
