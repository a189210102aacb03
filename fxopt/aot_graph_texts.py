"""aot_autograd without the graph texts nobody reads: skipped inside fxopt's compiles, kept where a log wants them.

On every training compile aot_autograd prints its joint, forward and backward graphs as text
(`GraphModule.print_readable`, graph_compile._log_joint_graph and _log_fw_bw_graphs). The texts feed
two readers only: the structured trace (TORCH_TRACE, tlparse) and the AOTAutograd cache entry, which
Inductor's path fills and fxopt's never does (`aot_module_simplified` leaves `cache_info` unset).
Printing a 24-block GPT-2 stack's three graphs took 0.21 s of its first call on the CPU machine
(benchmarks/results/2026-12-06-cpu-b.md), on the main thread, before fxopt's own compile starts.

`skipping_graph_texts()` marks the calling thread for the length of one fxopt compile; while it is
marked, the two logging steps return no text unless the structured trace is on, the graph's artifact
log (TORCH_LOGS=aot_graphs / aot_joint_graph) is enabled, or an AOT cache entry is being made: then
they run as torch wrote them. Other threads (an Inductor compile beside fxopt's) are never affected.
Where torch lacks either function (a future refactor), nothing is wrapped and the texts are printed.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading

_marked = threading.local()


@contextlib.contextmanager
def skipping_graph_texts():
    """Inside: aot_autograd's graph texts are skipped on this thread where no log reads them."""
    _install()
    before = getattr(_marked, "on", False)
    _marked.on = True
    try:
        yield
    finally:
        _marked.on = before


def _texts_wanted(logger: logging.Logger, aot_config) -> bool:
    return (_trace_on() or logger.isEnabledFor(logging.INFO)
            or getattr(aot_config, "cache_info", None) is not None)


def _trace_on() -> bool:
    """Whether the structured trace writes: torch always installs a LazyTraceHandler, which opens its
    file on the first event where TORCH_TRACE named a folder (or a Meta job's /logs was found: dynamo's
    first events come before aot_autograd's) and otherwise never writes; any other handler is a reader."""
    from torch._logging._internal import trace_log
    return any(type(h).__name__ != "LazyTraceHandler" or getattr(h, "root_dir", None) is not None
               or getattr(h, "stream", None) is not None for h in trace_log.handlers)


def _skippable(log_step, logger: logging.Logger, no_text):
    @functools.wraps(log_step)
    def log(*args, **kwargs):
        aot_config = kwargs.get("aot_config", args[-1] if args else None)
        if getattr(_marked, "on", False) and not _texts_wanted(logger, aot_config):
            return no_text
        return log_step(*args, **kwargs)
    log._fxopt_skippable = True
    return log


@functools.lru_cache(maxsize=None)
def _install() -> bool:
    """Wrap the two logging steps once per process; False where torch has not got them."""
    try:
        from torch._functorch._aot_autograd import graph_compile
        steps = {"_log_joint_graph": (graph_compile.aot_joint_log, None),
                 "_log_fw_bw_graphs": (graph_compile.aot_graphs_log, (None, None))}
        found = {name: getattr(graph_compile, name) for name in steps}
    except (ImportError, AttributeError):
        return False
    for name, (logger, no_text) in steps.items():
        if not getattr(found[name], "_fxopt_skippable", False):
            setattr(graph_compile, name, _skippable(found[name], logger, no_text))
    return True
