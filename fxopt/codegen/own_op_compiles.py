"""The Triton compiles fxopt's own ops (attention, cross-entropy) will ask for, found while their graph
compiles, so the precompile pool (or the compile workers) can do them before the first call, instead of
each first launch doing its own one after another.

An own op's kernels are chosen at run time from its inputs' layouts (tile configs, TMA or not,
decode or not), so the way to know which it compiles is to run it: each fxopt-op node of a CUDA graph
is called, as the wrapper will call it (codegen/direct_calls.py), on stand-in tensors with the node's
shapes, strides and dtypes, inside `compile_pool.capturing()`, which records every compile and skips
it (its launch does not run). The stand-ins are views of one scratch buffer, so this borrows one
input's worth of device memory for a moment, and the outputs the op allocates, up to STAND_IN_LIMIT.
Nodes whose values cannot be stood in for (symbolic sizes, a runtime scale tensor whose value picks
the path, too large) compile at their first launch.
"""
from __future__ import annotations

import logging

import torch
import torch.fx as fx
from torch.utils._python_dispatch import _disable_current_modes

from . import compile_pool, direct_calls
from .wrapper import own_op_callee

log = logging.getLogger("fxopt")
# Most device memory a node's stand-in call may take for its inputs and the outputs it allocates (also
# at most a quarter of what is free): a cross-entropy over a 128K vocabulary would borrow 8 GiB, kept
# reserved by the caching allocator afterwards; such a node's kernels compile at its first launch.
STAND_IN_LIMIT = 1 << 30


def own_op_compiles(gm: fx.GraphModule) -> list[tuple[object, str]]:
    """(JITFunction, serialised specialisation) of every kernel compile the graph's fxopt ops would do."""
    found = []
    for n in gm.graph.nodes:
        callee = own_op_callee(n) if n.op == "call_function" else None
        if callee is None:
            continue
        # The forward graph of a training step compiles inside aot_autograd's fake mode: real tensors
        # only with the dispatch modes set aside.
        with _disable_current_modes(), compile_pool.capturing() as captured:
            stand_ins = _stand_ins(n)
            if stand_ins is None:
                log.debug("fxopt: %s (%s) has no stand-ins: its kernels compile at its first launch", n.name, callee)
                continue
            try:
                getattr(direct_calls, callee)(*stand_ins[0], **stand_ins[1])
            except Exception as exc:  # what was captured before stays useful; the rest compiles at launch
                log.debug("fxopt: stand-in call of %s stopped: %s", n.name, exc)
        log.debug("fxopt: stand-in call of %s (%s) asked for %s", n.name, callee,
                  [fn.fn.__name__ for fn, _ in captured] or "no compile")
        found.extend(captured)
    return found


def _stand_ins(n: fx.Node):
    """(args, kwargs) for `n` with every tensor a view of one shared buffer; None if a value cannot be
    stood in for."""
    tensors = [a.meta.get("val") for a in n.all_input_nodes]
    if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
        return None
    if any(t.dim() == 0 for t in tensors):  # a runtime scalar (scale_by): its value picks the path
        return None
    if any(isinstance(s, torch.SymInt) for t in tensors for s in (*t.shape, *t.stride())):
        return None
    extent = max(_extent_bytes(t) for t in tensors)
    needed = extent + sum(t.numel() * t.element_size() for t in _tensors(n.meta.get("val")))
    if needed > min(STAND_IN_LIMIT, torch.cuda.mem_get_info(tensors[0].device)[0] // 4):
        log.debug("fxopt: %s: %d MiB of stand-ins is too much to borrow at compile time", n.name, needed >> 20)
        return None
    buffer = torch.empty(extent + 16, dtype=torch.uint8, device=tensors[0].device)
    views = {a: _view(buffer, a.meta["val"]) for a in n.all_input_nodes}
    return fx.node.map_arg(n.args, views.get), fx.node.map_arg(n.kwargs, views.get)


def _tensors(val) -> list[torch.Tensor]:
    """The tensors of a node's value (a tensor, or a tuple of them and other things)."""
    if isinstance(val, torch.Tensor):
        return [val]
    return [t for t in val if isinstance(t, torch.Tensor)] if isinstance(val, (tuple, list)) else []


def _extent_bytes(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))) * t.element_size()


def _view(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`like`'s sizes, strides and 16-byte misalignment (the TMA kernels need aligned pointers: a view
    starting mid-buffer must ask for the kernel the real call will) over `buffer` (16 bytes spare)."""
    size = like.element_size()
    n = len(buffer) // size
    offset = int(like.storage_offset()) % max(1, 16 // size)
    return buffer[:n * size].view(like.dtype).as_strided(like.shape, like.stride(), offset)
