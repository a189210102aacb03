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
"""
from __future__ import annotations

import functools

import torch
from torch._dynamo.utils import counters, flatten_graph_inputs
from torch._functorch.aot_autograd import aot_module_simplified

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
