"""Getting the graphs the backend sees, for explain() and optimize(), from a module or function.

Capture goes through dynamo exactly as torch.compile does (a recording backend that runs the graph
eagerly), so explain() reports on the very graphs `backend="fxopt"` would compile. The model runs
once, eagerly, during capture.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .backend import before_tracing, compile_dynamo_graph
from .options import Options
from .report import Report


def capture(model, inputs, on_graph=None) -> list[tuple[fx.GraphModule, list]]:
    """The (graph, example inputs) pairs dynamo hands a backend for model(*inputs); `on_graph(gm,
    example_inputs)` is called for each inside dynamo's backend call, where its tracing context (the shape
    environment of data-dependent sizes and `.item()` values) is still current."""
    graphs: list[tuple[fx.GraphModule, list]] = []

    def recording_backend(gm: fx.GraphModule, example_inputs):
        graphs.append((gm, list(example_inputs)))
        if on_graph is not None:
            on_graph(gm, list(example_inputs))
        return gm.forward

    before_tracing()
    compiled = torch.compile(model, backend=recording_backend, dynamic=False)
    compiled(*inputs)
    if not graphs:
        raise RuntimeError("fxopt: dynamo captured no graph from this model (was it already compiled, or does "
                           "it contain no tensor operations?)")
    return graphs


def explain(model, *inputs, **options) -> Report:
    """Compile `model` for `inputs` through the fxopt pipeline and report every step.

    Forward graphs are compiled for the inputs given; backward graphs too when any input or parameter
    requires grad (aot_autograd compiles both)."""
    opts = Options.from_kwargs(**options).replace(keep_graphs=True)
    report = Report()
    failed: list[BaseException] = []

    def compile_now(gm, example_inputs):  # inside dynamo's call (a graph with `.item()` needs its context)
        if failed:
            return
        try:
            compile_dynamo_graph(gm, example_inputs, opts, report)
        except Exception as e:  # raised as itself below, not wrapped in dynamo's BackendCompilerFailed
            failed.append(e)

    capture(model, inputs, on_graph=compile_now)
    if failed:
        raise failed[0]
    return report


def optimize(model, *inputs, **options):
    """A compiled callable for `model`, compiled now for `inputs` (first call cost paid here).

    It is torch.compile with the fxopt backend and fullgraph=True, so dynamo's guards stay in place: a
    call with other shapes recompiles instead of running code built for the wrong shapes."""
    report = Report()
    opts = Options.from_kwargs(**options)

    def fxopt_optimize(gm, example_inputs):
        return compile_dynamo_graph(gm, example_inputs, opts, report)

    before_tracing()
    compiled = torch.compile(model, backend=fxopt_optimize, fullgraph=True, dynamic=False)
    compiled(*inputs)
    compiled.report = report
    return compiled
