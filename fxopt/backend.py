"""The torch.compile backend: options -> pre-autograd passes -> aot_autograd -> compiled callables.

    f = torch.compile(model, backend="fxopt")                       # via the entry point
    f = torch.compile(model, backend=fxopt.backend(verify=True))    # with options
"""
from __future__ import annotations

import functools
import threading

import torch
import torch.fx as fx
from torch._functorch import config as functorch_config
from torch._functorch.partitioners import min_cut_rematerialization_partition

from . import pipeline
from .codegen import compile_pool
from .codegen.precompile import start_own_op_compiles, warm_before_tracing, warm_compile_keys
from .analysis.symbolic import shape_env_of_value
from .aot import aot_compile
from .buffer_guards import guarded
from .compile import compile_aten_graph
from .cudagraphs import graphed_compiler
from .decompositions import decomposition_table
from .gc_pause import pause_dynamo_compiles, pausing_collector
from .options import Environment, Options, backward_with_forward
from .pass_manager import PassContext, PassManager
from .passes.cse import eliminate_common_subexpressions
from .passes.cached_casts import lift_parameter_casts, with_cached_casts
from .report import Report
from .verify import graph_dtypes, verifier_for

_DUMP_REPORTS: dict[str, Report] = {}  # one accumulating report per dump directory in this process
_lock = threading.Lock()


@pausing_collector
def compile_dynamo_graph(gm: fx.GraphModule, example_inputs, options: Options, report: Report | None = None):
    """Compile one graph dynamo captured; forward and backward go through aot_autograd. Python's cyclic
    garbage collector is paused meanwhile (gc_pause.py), and over later dynamo compiles too (again after a
    torch._dynamo.reset(), which drops the callbacks)."""
    pause_dynamo_compiles()
    env = Environment.read()
    warm_compile_keys(example_inputs)  # CUDA graphs: Triton's per-process keys computed while aot_autograd traces
    compile_pool.prestart(example_inputs, env.compile_workers)  # and the compile workers started (if any)
    dump_dir = options.dump_dir or env.dump_dir
    on_done = None
    if report is None:
        if dump_dir:
            with _lock:
                report = _DUMP_REPORTS.setdefault(dump_dir, Report())
            on_done = lambda rep: rep.save(dump_dir)  # noqa: E731
        else:
            report = Report()
    elif dump_dir:
        on_done = lambda rep: rep.save(dump_dir)  # noqa: E731
    ctx = PassContext(options=options, env=env, graph_name="torch", example_inputs=list(example_inputs),
                      inspect=options.keep_graphs or bool(dump_dir))
    marks = _marks(report)
    pre = pipeline.pre_autograd_passes(options)
    if pre:
        symbolic = options.verify and shape_env_of_value(list(example_inputs)) is not None
        if symbolic:  # (as compile.py does for the ATen graphs)
            report.pre_autograd_notes.append("verify=True is skipped for the torch-level graph under symbolic "
                                             "shapes (it runs the graph on example tensors)")
        rtol = options.verify_tolerance_for(graph_dtypes(gm))
        verifier, unverified = (verifier_for(gm, example_inputs, rtol, "torch-level") if options.verify and not symbolic
                                else (None, None))
        if unverified:
            report.pre_autograd_notes.append(unverified)
        gm, records, _ = PassManager(pre, verifier).run(gm, ctx)
        report.pre_autograd.extend(records)
        report.attention.extend(ctx.attention)
        report.casts.extend(ctx.casts)
        report.pre_autograd_notes.extend(ctx.notes)
    if env.own_ops_early and not env.compile_workers:
        start_own_op_compiles(gm, example_inputs)  # attention's kernels compile while aot_autograd traces
    gm, cached_casts = lift_parameter_casts(gm, ctx)  # inference in bf16/fp16: parameters are cast once, not per call
    # the casts' fake values, not real tensors: aot_autograd would give a real tensor it has not seen
    # symbolic sizes, and a symbolic graph is not fused
    example_inputs = [*example_inputs, *(c.example for c in cached_casts)]
    compiler = functools.partial(compile_aten_graph, options=options, report=report, on_done=on_done)
    if options.cudagraphs:  # forward, backward and inference replay as CUDA graphs, sharing one pool
        compiler = graphed_compiler(compiler, report, options)
    eager_backward = options.keep_graphs or backward_with_forward(options, env, example_inputs)
    try:
        with torch._functorch.config.patch(force_non_lazy_backward_lowering=eager_backward):
            compiled = _aot(gm, example_inputs, compiler)
    except BaseException:  # dynamo restarts the trace (e.g. to specialise a float): this attempt is void
        _roll_back(report, marks)
        raise
    compiled = with_cached_casts(compiled, cached_casts) if cached_casts else compiled
    return guarded(compiled, ctx.input_guards, ctx.unspecialised) if ctx.input_guards else compiled


_REPORT_LISTS = ("graphs", "pre_autograd", "pre_autograd_notes", "attention", "casts")


def _marks(report: Report) -> dict[str, int]:
    return {name: len(getattr(report, name)) for name in _REPORT_LISTS}


def _roll_back(report: Report, marks: dict[str, int]) -> None:
    """Drop what a failed or restarted compile added to the report, so that it lists what runs."""
    for name, length in marks.items():
        del getattr(report, name)[length:]


def _partition(joint: fx.GraphModule, joint_inputs, **kwargs):
    """torch's min-cut partitioner after fxopt's own CSE (passes/cse.py: the partitioner's would import
    Inductor, seconds of a training graph's first call)."""
    if eliminate_common_subexpressions(joint.graph):
        joint.recompile()
    with functorch_config.patch(cse=False):
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


def _aot(gm, example_inputs, compiler):
    """aot_autograd with dynamo's bookkeeping (aot.py: DDP's graph splitter reads its counters; the
    backward compiler and compiled graphs hidden from dynamo; list inputs flattened), without the
    Inductor import dynamo's own helper makes."""
    return aot_compile(
        gm, example_inputs,
        fw_compiler=functools.partial(compiler, graph_name="forward"),
        bw_compiler=functools.partial(compiler, graph_name="backward"),
        inference_compiler=functools.partial(compiler, graph_name="inference"),
        decompositions=decomposition_table(),
        partition_fn=_partition,
        keep_inference_input_mutations=True,
    )


def fxopt_backend(gm: fx.GraphModule, example_inputs, **options):
    """The backend registered as "fxopt" (entry point torch_dynamo_backends). torch.compile hands a
    backend its `options={...}` and `mode=` as keywords: options are fxopt's, modes are Inductor's."""
    mode = options.pop("mode", None)
    if mode not in (None, "default"):
        raise TypeError(f"fxopt: torch.compile(mode={mode!r}) is an Inductor setting; fxopt takes options, e.g. "
                        "torch.compile(m, backend='fxopt', options={'cudagraphs': True}) for what "
                        "'reduce-overhead' does")
    nested = options.pop("options", None) or {}
    return compile_dynamo_graph(gm, example_inputs, Options.from_kwargs(**nested, **options))


def before_tracing() -> None:
    """What starts when torch.compile is handed fxopt's backend, before dynamo traces: Triton's one-time
    set-up on threads (codegen/precompile.warm_before_tracing) and the collector's pause over each dynamo
    compile from now on (gc_pause.pause_dynamo_compiles)."""
    warm_before_tracing()
    pause_dynamo_compiles()


def backend(**options):
    """A configured backend: torch.compile(model, backend=fxopt.backend(precision="bf16")); what comes
    before dynamo's tracing starts now (before_tracing)."""
    opts = Options.from_kwargs(**options)
    before_tracing()

    def fxopt_configured(gm: fx.GraphModule, example_inputs):
        return compile_dynamo_graph(gm, example_inputs, opts)

    fxopt_configured.options = opts
    return fxopt_configured
