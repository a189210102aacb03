"""Compile one ATen graph: post-grad passes, codegen, load; the fw/bw compiler aot_autograd calls."""
from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings

import torch
import torch.fx as fx
from torch.autograd import forward_ad

from . import pipeline, torch_references
from .aot import donated_backward_inputs
from .codegen.cache import module_cache
from .codegen.harness import standalone_source
from .codegen.precompile import precompile
from .codegen.wrapper_runtime import batched
from .codegen.fast_launch import FastKernel
from .codegen.interpreter_guard import GuardedKernel
from .codegen.wrapper_layouts import launch_checks
from .codegen.kernel import Kernel
from .codegen.kernel_identity import kernel_identity
from .codegen.combined_casts import generate_combined_casts_kernel
from .codegen.triton_pointwise import generate_pointwise_kernel
from .codegen.triton_reduction import generate_reduction_kernel
from .codegen.wrapper import generate_wrapper
from .analysis.liveness import peak_headroom
from .analysis.roofline import roofline
from .analysis.symbolic import (graph_symbols, guard_texts, has_symbolic_shapes, hint, shape_env_of,
                                symbolic_unsupported_reason)
from .errors import node_error
from .gc_pause import pausing_collector
from .graph_svg import graph_svg
from .memory.plan_report import memory_plan
from .memory.size_plans import size_plans
from .options import Environment, Options, backward_with_forward
from .pass_manager import PassContext, PassManager, PassRecord, count_nodes
from .passes.combine_casts import CASTS_PREFIX
from .passes.fuse import FUSED_PREFIX
from .passes.fuse_reductions import REDUCTION_PREFIX
from .printing import graph_to_text
from .report import GraphReport, KernelRecord, Report
from .verify import graph_dtypes, verifier_for

log = logging.getLogger("fxopt")
_KERNELS: dict[tuple, object] = {}  # (kernel_identity, target) -> loaded JITFunction, shared by wrappers
_warned_eager = False


def configure_logging(level: str | None) -> None:
    """FXOPT_LOG=info|debug: print fxopt's log lines to stderr (one handler, added once)."""
    if not level:
        return
    log.setLevel(level.upper())
    if not any(getattr(h, "_fxopt", False) for h in log.handlers):
        handler = logging.StreamHandler()
        handler._fxopt = True
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)


def choose_target(gm: fx.GraphModule, env: Environment) -> str:
    """cuda when the graph holds CUDA tensors; on CPU the interpreter if TRITON_INTERPRET=1, else eager."""
    devices = {n.meta["val"].device.type for n in gm.graph.nodes
               if isinstance(n.meta.get("val"), torch.Tensor)}
    if "cuda" in devices:
        return "cuda"
    return "interpret" if env.interpret else "eager"


def check_devices(gm: fx.GraphModule) -> None:
    """Mixed devices in one op are a user error: name the node and the fix."""
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        devs = {}
        for a in n.all_input_nodes:
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                devs.setdefault(str(v.device), a.name)
        if len(devs) > 1:
            listing = ", ".join(f"'{name}' on {d}" for d, name in devs.items())
            raise node_error(n, f"mixes devices: {listing}",
                             "move these tensors to one device before calling the model")


def _kernel_name(gm: fx.GraphModule, index: int) -> str:
    ops = [n.target.__name__.split(".")[0] for n in gm.graph.nodes
           if n.op == "call_function" and hasattr(n.target, "__name__") and not n.target.is_view]
    short = "_".join(dict.fromkeys(ops))  # unique, in order
    short = "_".join(short.split("_")[:4]) or "copy"
    short = short.replace("dim_IntList", "").replace("__", "_").strip("_")
    return f"fused_{short}_{index}"


@pausing_collector
def compile_aten_graph(gm: fx.GraphModule, example_inputs, *, options: Options, graph_name: str,
                       report: Report, on_done=None):
    """Run the post-grad pipeline on an ATen graph and return the boxed callable aot_autograd wants.
    The cyclic garbage collector is paused meanwhile (a backward compiled at its first call is outside
    compile_dynamo_graph's pause)."""
    env = Environment.read()
    configure_logging(env.log_level)
    start = time.perf_counter()
    check_devices(gm)
    target = choose_target(gm, env)
    inspect = options.keep_graphs or bool(options.dump_dir or env.dump_dir)  # printing graphs costs compile time
    ctx = PassContext(options=options, env=env, graph_name=graph_name, target=target, inspect=inspect,
                      donated=donated_backward_inputs(gm) if graph_name == "backward" else frozenset())
    record = GraphReport(name=graph_name, target=target,
                         captured_text=graph_to_text(gm, "captured") if inspect else "")
    symbols, shape_env, plans = [], None, None
    opaque = _wrapper_cannot_call(gm)
    if opaque is not None:
        return _run_as_aten(gm, record, report, on_done, start, opaque)
    if has_symbolic_shapes(gm):  # dynamic shapes: sizes are sympy expressions of dynamo's symbols
        reason = symbolic_unsupported_reason(gm)
        if reason is not None:
            return _run_as_aten(gm, record, report, on_done, start, "symbolic (dynamic) shapes: " + reason)
        symbols, shape_env = graph_symbols(gm), shape_env_of(gm)
        record.symbols = {s.name: hint(s, shape_env) for s in symbols}
        guards_before = len(shape_env.guards)
    verify = options.verify and not symbols
    if options.verify and symbols:
        record.notes.append("verify=True is skipped for symbolic shapes (it runs the graph on example tensors)")
    rtol = options.verify_tolerance_for(graph_dtypes(gm))
    verifier, unverified = verifier_for(gm, example_inputs, rtol, graph_name) if verify else (None, None)
    if unverified:
        record.notes.append(unverified)
    gm, records, snapshots = PassManager(pipeline.post_grad_passes(options), verifier).run(gm, ctx)
    record.passes, record.snapshots = records, snapshots
    if options.memory_plan and symbols:  # one concrete plan per distinct size, made at its first call
        plans = record.size_plans = size_plans(gm, options.memory_plan == "apply", symbols)
        record.memory_plan = plans.plan(tuple(record.symbols.values()))
    elif options.memory_plan:
        record.memory_plan = memory_plan(gm, applied=options.memory_plan == "apply")

    kernel_target = "cuda" if target == "cuda" else "interpret"
    kernels: dict[str, Kernel] = {}
    headroom = peak_headroom(gm)  # where a reduction's scratch would raise the graph's peak
    for node in gm.graph.nodes:
        if node.op == "call_module" and str(node.target).startswith(FUSED_PREFIX):
            sub = gm.get_submodule(node.target)
            if str(node.target).startswith(CASTS_PREFIX):
                k = generate_combined_casts_kernel(sub, f"cast_inputs_{len(kernels)}")
            elif str(node.target).startswith(REDUCTION_PREFIX):
                k = generate_reduction_kernel(sub, _kernel_name(sub, len(kernels)), kernel_target,
                                              headroom.get(node.name))
            else:
                k = generate_pointwise_kernel(sub, _kernel_name(sub, len(kernels)), kernel_target)
            kernels[node.target] = k
            record.kernels.append(KernelRecord(k.name, k.kind, k.ops, k.full_source(), graph_name,
                                               k.notes.get("reduction") or k.notes.get("combined"),
                                               standalone_source(k) if inspect else ""))
    kernel_names = {sub_name: k.name for sub_name, k in kernels.items()}
    record.roofline = roofline(gm, kernel_names)
    if inspect:
        record.graph_svg = graph_svg(gm, kernel_names)
    mode = "eager" if target == "eager" else "triton"
    filename = "wrapper.py" if graph_name in ("forward", "inference") else f"wrapper_{graph_name}.py"
    applied = record.memory_plan if options.memory_plan == "apply" else None
    if applied is not None and plans is not None:
        applied = plans.template()  # symbolic byte counts; offsets come from PLANS per call
    record.wrapper_source = generate_wrapper(gm, kernels, graph_name, mode, filename, options.profile,
                                             plan=applied, poison=applied is not None and env.poison_freed,
                                             reuse=bool(options.memory_plan))
    if applied is not None and plans is not None:  # the file also runs on its own (dumps): it rebuilds PLANS
        record.wrapper_source = plans.in_wrapper(record.wrapper_source)
    # a training step's graphs compile their kernels in the background, the forward's while the
    # backward graph is made and compiled (backend.py compiles it with the forward), each waited for
    # at its graph's first call; explain() (keep_graphs) times them in the foreground
    background = (graph_name in ("forward", "backward") and not options.keep_graphs
                  and backward_with_forward(options, env, example_inputs))
    call = _load(gm, kernels, record, env, mode, plans, background)
    if options.profile:
        from .profile import attach_timer  # here, not at the top: profile.py compiles through backend.py
        attach_timer(call, record)
    call = _aten_where_kernels_cannot_run(call, gm)
    record.fallbacks = list(ctx.notes)
    if symbols:
        record.guards = guard_texts(shape_env, symbols)
        if len(shape_env.guards) > guards_before:  # fxopt asked a size question: the graph was narrowed
            record.notes.append("compiling added size guards: " + "; ".join(
                str(g.expr) for g in shape_env.guards[guards_before:]))
        record.notes.append("symbolic sizes " + ", ".join(f"{k} (example {v})" for k, v in record.symbols.items())
                            + "; guards: " + ("; ".join(record.guards) or "none"))
    record.compile_seconds = time.perf_counter() - start
    if verifier is not None:
        err = verifier.check_callable(call)
        record.passes.append(PassRecord("codegen", 0.0, count_nodes(gm), count_nodes(gm), {}, graph_name,
                                        False, record.wrapper_source, err))
    if mode == "eager":
        _warn_eager_once()
    report.graphs.append(record)
    planned = record.memory_plan.planned_bytes if record.memory_plan else 0
    log.info("fxopt: compiled %s graph in %.3fs: %d kernels, %d fallbacks, %.2f MiB planned", graph_name,
             record.compile_seconds, len(record.kernels), len(record.fallbacks), planned / 2**20)
    if on_done is not None:
        on_done(report)
    return call


def _aten_where_kernels_cannot_run(call, gm: fx.GraphModule):
    """The fused graph run as ATen ops (each fused group is an fx submodule of them) where Triton kernels
    cannot serve a call: batched gradients in a backward (autograd.grad(is_grads_batched=True),
    jacobian(vectorize=True): legacy vmap's BatchedTensors, which the launcher cannot read), any graph
    inside a functorch transform (torch.func's wrapped tensors), or under a forward-mode AD level (dual
    tensors: a kernel's result would carry no tangent, and the caller would get None for it). fxopt's own
    ops in it run their torch-op references (torch_references.py): their custom ops have no forward-AD or
    batching rules either."""
    tangents = tuple(i for i, n in enumerate(gm.graph.find_nodes(op="placeholder")) if n.name.startswith("tangents"))
    aten: list = []  # built at the first call that needs it

    def run(args):
        if (forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active()
                or any(isinstance(args[i], torch.Tensor) and batched(args[i]) for i in tangents)):
            if not aten:
                aten.append(torch_references.reference_graph(gm) or gm)
            with torch_references.torch_ops_only():
                return aten[0](*args)
        return call(args)
    run._boxed_call = True
    return run



def _run_as_aten(gm: fx.GraphModule, record: GraphReport, report: Report, on_done, start: float, why: str):
    """A graph fxopt cannot serve (a symbolic size it cannot express, an op the wrapper cannot call): run
    the ATen graph as it is, every node listed in the fallbacks with the reason."""
    from torch._functorch.aot_autograd import make_boxed_func

    reason = f"the graph runs as ATen ops, unfused: {why}"
    record.notes.append(reason)
    record.fallbacks = [(n.name, reason) for n in gm.graph.nodes if n.op == "call_function"]
    record.wrapper_source = (f"# not generated: {reason}\n# (the ATen graph fxopt ran instead, as fx prints it)\n"
                             f"{gm.code}\n\nif __name__ == \"__main__\":\n"
                             f"    raise SystemExit({('fxopt: ' + reason)!r})\n")
    record.compile_seconds = time.perf_counter() - start
    report.graphs.append(record)
    log.info("fxopt: %s graph: %s", record.name, reason)
    if on_done is not None:
        on_done(report)
    return make_boxed_func(gm.forward)


def _wrapper_cannot_call(gm: fx.GraphModule) -> str | None:
    """Higher-order ops (checkpointed RNG replay: run_and_save_rng_state) take ops as arguments, which
    the wrapper does not print yet."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator):
            return f"node '{n.name}' calls the higher-order op {n.target.name()}, which the wrapper cannot emit yet"
    return None


def _load(gm: fx.GraphModule, kernels: dict[str, Kernel], record: GraphReport, env: Environment, mode,
          plans=None, background: bool = False):
    cache = module_cache(env.cache_dir)
    hits = cache.hits
    with _triton_interpreter(record.target == "interpret"):
        module = cache.load(record.wrapper_source)
    record.cache = {"hits": cache.hits - hits, "misses": 1 - (cache.hits - hits)}
    checks = launch_checks(gm, kernels, Kernel.launched) if mode == "triton" else {}
    for k in _launched(kernels):  # one JITFunction per distinct kernel (same up to names), so Triton compiles it once
        if mode == "triton":
            key = (kernel_identity(k.source), record.target)  # an interpreted kernel never serves CUDA
            fn = _KERNELS.setdefault(key, getattr(module, k.name))
            # each launch site its own FastKernel: what it re-checks per launch depends on where its
            # arguments come from (codegen/wrapper_layouts.launch_checks)
            fn = GuardedKernel(fn) if record.target == "interpret" else FastKernel(fn, checked=checks[k.name])
            setattr(module, k.name, fn)
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            setattr(module, node.name, getattr(gm, node.target))
        if node.op == "call_module" and mode == "eager":
            setattr(module, f"subgraph_{node.target}", gm.get_submodule(node.target))
    module.PLANS = plans  # symbolic graphs with an applied plan: the per-size plans
    pending = None
    if mode == "triton" and record.target == "cuda":
        start = time.perf_counter()

        def timed(_=None):
            record.triton_compile_seconds = time.perf_counter() - start

        with _triton_interpreter(False):  # a process-wide TRITON_INTERPRET=1 (CPU tests) must not reach nvcc-side compiles
            pending = precompile(gm, module, _distinct_compiles(module, _launched(kernels)), record.wrapper_source,
                                 cache, env.compile_workers, background)
        if pending is None:
            timed()
        else:
            pending.add_done_callback(timed)
    call = module.call if pending is None else _after(pending, module.call)
    call._boxed_call = True
    return call


def _after(pending, call):
    """`call`, each call first waiting for the kernels compiling in the background (at once once they
    are done; a compile error raises at every call, as it would have raised at compile time)."""
    def call_compiled(args):
        pending.result()
        return call(args)
    return call_compiled


def _distinct_compiles(module, launched: list[Kernel]) -> list[Kernel]:
    """The kernels to compile ahead: one per JITFunction and specialisation (the 24 blocks of a model
    share each block kernel's JITFunction: one compile, not 24); symbolic kernels compile at their
    first call."""
    seen, todo = set(), []
    for k in launched:
        fn = getattr(module, k.name)
        key = (id(getattr(fn, "fn", fn)), repr(k.warmup_args()), repr(k.constexprs), repr(k.options()))
        if not k.symbolic and key not in seen:
            seen.add(key)
            todo.append(k)
    return todo


def _launched(kernels: dict[str, Kernel]) -> list[Kernel]:
    """Every Triton function the wrapper launches (split reductions launch a prologue kernel too, column
    partials kept in an output a fix-up after; a symbolic row's kernel has a persistent alternative)."""
    return [p for k in kernels.values() for p in k.launched()]


@contextlib.contextmanager
def _triton_interpreter(on: bool):
    """triton.jit picks interpreter or compiler when a kernel is defined: CUDA graphs always compile
    for real, CPU graphs use the interpreter, whatever TRITON_INTERPRET says for the process."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


def _warn_eager_once() -> None:
    global _warned_eager
    if not _warned_eager:
        _warned_eager = True
        warnings.warn("fxopt: CPU tensors and TRITON_INTERPRET is not set: fused groups run as eager PyTorch "
                      "subgraphs (correct, not fast). Set TRITON_INTERPRET=1 to run the generated Triton "
                      "kernels in the interpreter.", stacklevel=3)
