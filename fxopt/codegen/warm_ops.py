"""fxopt's hand-written kernels (attention, cross-entropy) compiled beside the generated ones.

Triton compiles a kernel at its first launch. compile._precompile compiles the generated kernels at
compile time, several at once; fxopt's own ops used to compile theirs at the wrapper's first call, one
after another on the caller's thread: on the H200 0.4-0.6 s for the attention forward and 1.1-1.6 s for
the backward's three kernels of a GPT-2 or Llama training step, a seventh of its cold first call
(benchmarks/results/2026-12-02-h200-e.md). Each call of an own op in a graph is run once here, at
compile time in the same thread pool, on scratch tensors with the call's sizes, strides, storage
offsets and dtypes: its kernels compile with the specialisations the real call will ask for, and its
launch decisions (attention/launch_plans.py) are made and kept. Float scratch is uninitialised (no
kernel addresses memory by it), integer scratch zeros (class indices in range); what the call returns
is dropped.

Not warmed (they compile at their first call, as before): calls with symbolic sizes, calls whose
scratch would take more than WARM_BYTES_LIMIT or a quarter of the device's free memory, and any call
while a CUDA graph is being captured (nothing may launch then). A warm call that fails is ignored:
the real call raises whatever it raises, with its own message.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable

import torch
import torch.fx as fx

from . import direct_calls
from .wrapper import own_op_callee

log = logging.getLogger("fxopt")
WARM_BYTES_LIMIT = 1 << 30


def _static(val) -> bool:
    return all(isinstance(s, int) for s in (*val.shape, *val.stride(), val.storage_offset()))


def _span_bytes(val: torch.Tensor) -> int:
    if any(s == 0 for s in val.shape):
        return 0
    span = 1 + val.storage_offset() + sum((s - 1) * abs(st) for s, st in zip(val.shape, val.stride()))
    return span * val.element_size()


def scratch_like(val: torch.Tensor) -> torch.Tensor:
    """A tensor with `val`'s sizes, strides, storage offset, dtype and device: uninitialised floats
    (kernels address nothing by them), zeros for integers and bools (class indices stay in range), and
    1 for a 0-d tensor (a runtime scale read from one is a valid scale)."""
    if val.dim() == 0:
        return torch.ones((), dtype=val.dtype, device=val.device)
    make = torch.empty if val.dtype.is_floating_point else torch.zeros
    base = make(_span_bytes(val) // val.element_size(), dtype=val.dtype, device=val.device)
    return base.as_strided(val.shape, val.stride(), val.storage_offset())


def _layout(val) -> tuple:
    return (tuple(val.shape), tuple(val.stride()), val.storage_offset(), val.dtype, str(val.device))


def warm_calls(gm: fx.GraphModule, free_bytes: int | None = None) -> list[Callable[[], None]]:
    """One callable per distinct call of fxopt's own ops in `gm` (same op, layouts and arguments),
    each running it once on scratch tensors. free_bytes: the device's free memory (None: no limit
    but WARM_BYTES_LIMIT)."""
    limit = WARM_BYTES_LIMIT if free_bytes is None else min(WARM_BYTES_LIMIT, free_bytes // 4)
    calls, seen = [], set()
    for n in gm.graph.nodes:
        name = own_op_callee(n)
        if name is None:
            continue
        args = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in n.args]
        kwargs = {k: a.meta.get("val") if isinstance(a, fx.Node) else a for k, a in n.kwargs.items()}
        nodes = [a for a in (*n.args, *n.kwargs.values()) if isinstance(a, fx.Node)]
        tensors = [a.meta.get("val") for a in nodes]
        if not all(isinstance(t, torch.Tensor) and _static(t) for t in tensors):
            continue  # a symbolic size or a value that is not a tensor: it compiles at its first call
        if sum(_span_bytes(t) for t in tensors) > limit:
            continue
        key = (name, tuple(map(_key, args)), tuple((k, _key(v)) for k, v in kwargs.items()))
        if key in seen:
            continue
        seen.add(key)
        calls.append(_warm(getattr(direct_calls, name), args, kwargs, n.name))
    return calls


def _key(v):
    return _layout(v) if isinstance(v, torch.Tensor) else v


def _warm(fn: Callable, args: list, kwargs: dict, node: str) -> Callable[[], None]:
    devices = [v.device for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.is_cuda]

    def run() -> None:
        try:
            with torch.cuda.device(devices[0]) if devices else contextlib.nullcontext():
                fn(*[_real(v) for v in args], **{k: _real(v) for k, v in kwargs.items()})
                if devices:
                    torch.cuda.current_stream().synchronize()  # the scratch is freed after its use
        except Exception as exc:  # the real call will raise it, with its own message
            log.debug("fxopt: warming %s at compile time failed: %s", node, exc)
    return run


def _real(v):
    return scratch_like(v) if isinstance(v, torch.Tensor) else v
