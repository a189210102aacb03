"""aot_autograd as dynamo's own backend helper runs it, without the Inductor import that helper makes.

torch._dynamo.backends.common.aot_autograd runs aot_module_simplified inside
torch._inductor.debug.enable_aot_logging; importing that module imports Inductor's scheduler, IR and
compile workers: about a second of a cold first call (more where torch has no bytecode cache), for
debug logging fxopt does not use. What fxopt needs from the helper is done here:
- dynamo's counters["aot_autograd"]: DDP's graph splitter compares its compiles with them (without
  them a split graph's backward fails: "expected same # of fw and bw compiles");
- list, tuple and dict inputs flattened (dynamo's flatten_graph_inputs);
- the backward compiler, the backward graph it returns and the compiled forward hidden from dynamo
  (torch._dynamo.disable), so dynamo never traces fxopt's own code or wrappers.
And one thing the helper does not do: the graph texts aot_autograd prints for its logs and its cache
are skipped where neither reads them (aot_graph_texts.py).
"""
from __future__ import annotations

import functools

import torch
from torch._dynamo.utils import counters, flatten_graph_inputs
from torch._functorch.aot_autograd import aot_module_simplified

from .aot_graph_texts import skipping_graph_texts

__all__ = ["aot_compile"]

try:  # dynamo asks for a fresh trace (a float input specialised): not a failed compile
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis as _Restart
except ImportError:  # pragma: no cover - torch without it
    _Restart = ()


def aot_compile(gm: torch.fx.GraphModule, example_inputs, **aot_options):
    """aot_module_simplified(gm, example_inputs, **aot_options) with the helper's bookkeeping (module
    docstring); aot_options must name bw_compiler."""
    if any(isinstance(x, (list, tuple, dict)) for x in example_inputs):
        return flatten_graph_inputs(gm, example_inputs, functools.partial(aot_compile, **aot_options))
    counters["aot_autograd"]["total"] += 1
    aot_options = {**aot_options, "bw_compiler": _hidden_from_dynamo(aot_options["bw_compiler"])}
    try:
        with skipping_graph_texts():  # texts of the graphs that only a log or a cache reads
            compiled = aot_module_simplified(gm, example_inputs, **aot_options)
    except _Restart:
        raise
    except Exception:
        counters["aot_autograd"]["not_ok"] += 1
        raise
    counters["aot_autograd"]["ok"] += 1
    return torch._dynamo.disable(compiled)


def _hidden_from_dynamo(bw_compiler):
    """The backward compiler, untraced, returning an untraced backward graph (it runs inside autograd's
    backward, where dynamo would otherwise try to capture it)."""
    def compile_backward(*args, **kwargs):
        return torch._dynamo.disable(torch._dynamo.disable(bw_compiler)(*args, **kwargs))
    return compile_backward


def donated_backward_inputs(gm: torch.fx.GraphModule) -> frozenset[str]:
    """The backward graph's placeholders aot_autograd lets the backward consume ("donated buffers": saved
    tensors made by the forward, no view of an input, of a returned value or of another saved tensor),
    by name; empty outside a backward compile or where torch tracks none.

    torch pairs them with a check at each backward call: a backward compiled with donated buffers refuses
    `retain_graph=True` / `create_graph=True`, whose second use would read consumed tensors. That check is
    right for a compiler that consumes them unconditionally; fxopt asks per call instead (the one op that
    consumes one, losses/cross_entropy_op.cross_entropy_backward_over_logits, writes over its input only
    in a backward that frees its saved tensors). So the list is emptied here: with it, a backward that
    compiles with its forward (fxopt on CUDA, before any backward call says whether it retains the
    graph) refused every `retain_graph=True` that torch's lazy compile would have accepted."""
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    idxs = getattr(meta, "bw_donated_idxs", None)
    if not idxs:
        return frozenset()
    placeholders = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    names = frozenset(placeholders[i] for i in idxs if 0 <= i < len(placeholders))
    idxs.clear()  # the same list object is the inner metadata's (aot_autograd shares it)
    return names
