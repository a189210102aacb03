"""Compile a CUDA graph's Triton kernels before its first call, all at once: the first call would
otherwise compile them one after another as it reaches each launch (a GPT-2 block's attention kernel
alone is 0.5 s on the H200 host's critical path, benchmarks/results/2026-12-04-h200.md)."""
from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..errors import FxoptError
from ..options import Environment
from . import compile_pool
from .compile_worker import preload, warm_launcher
from .gil_handoff import quick_handoff
from .kernel import Kernel
from .own_op_compiles import backward_compiles, before_autograd_compiles, own_op_compiles
from .static_launch import static_refusal
from .wrapper_text import KERNELS_END

log = logging.getLogger("fxopt")


def precompile(gm, module, todo: list[Kernel], source: str, cache, workers: int,
               background: bool = False) -> Future | None:
    """Compile every kernel now, so the first call does not compile them one after another: the
    wrapper's kernels and those the graph's fxopt ops will launch (codegen/own_op_compiles.py), on a
    thread pool (Triton's backend passes release the GIL). With FXOPT_COMPILE_WORKERS, in worker
    processes first (codegen/compile_pool.py): this process then loads each kernel as soon as its
    worker is done (the load finds the workers' cache entry, or compiles the kernel if a worker could not).
    background=True returns at once with the compiles' future (the caller waits for it before the
    graph's first call): a training step's forward and backward graphs compile their kernels together."""
    def warm(k: Kernel):
        if k.name in waits:
            waits[k.name]()
        wait_for_keys()
        try:
            with _on(device):  # a pool thread starts on device 0: Triton compiles for the current device
                getattr(module, k.name).warmup(*k.warmup_args(), grid=k.grid_tuple(), **k.options(),
                                               **k.constexprs)
        except Exception as exc:
            raise FxoptError(f"fxopt: Triton could not compile kernel {k.name}: {exc}\n{k.source}") from exc

    waits, finish, own_ops, ahead = {}, lambda: None, [], []
    wait_for_driver()  # the stand-in calls below reach Triton's driver
    if workers:
        waits, finish = _compile_in_workers(gm, module, todo, source, cache, workers)
    else:
        own_ops, ahead = own_op_compiles(gm), backward_compiles(gm)
    device = _graph_device(gm)
    for fn, spec in ahead:
        _compile_ahead(fn, spec, device)
    # the own ops' kernels first: the longest compiles (attention's: 0.5-0.7 s each and a C launcher
    # build, against 0.2-0.5 s for a generated kernel) must not wait behind a full pool
    tasks = [functools.partial(_preload_own_op, fn, spec, device) for fn, spec in own_ops]
    tasks += [functools.partial(warm, k) for k in todo]

    def run_all():
        # in the foreground the main thread only waits, and pool threads back from ptxas and MLIR take the
        # GIL sooner; in the background it compiles the backward graph, which a short interval starved
        # (1.1 s more for a GPT-2 training step's first call, benchmarks/results/2026-12-04-h200-f.md)
        with (contextlib.nullcontext() if background else quick_handoff()):
            if len(tasks) <= 1:
                for task in tasks:
                    task()
            else:
                with ThreadPoolExecutor(max_workers=min(8, len(tasks))) as pool:
                    list(pool.map(lambda task: task(), tasks))
            finish()

    if background:
        return _background_pool().submit(run_all)
    run_all()
    return None


@functools.lru_cache(maxsize=None)
def _background_pool() -> ThreadPoolExecutor:
    """Runs background precompiles: two at once (a training step's forward and backward graphs)."""
    return ThreadPoolExecutor(max_workers=2, thread_name_prefix="fxopt-precompile")


# The backward graph's own-op compiles predicted from its forward graph (own_op_compiles.backward_compiles),
# started when the forward graph precompiles and not waited for there: {(JITFunction, specialisation):
# its future}. The backward graph's precompile waits for one it asks for again instead of compiling it twice.
_ahead: dict = {}
_ahead_lock = threading.RLock()  # a future done at once runs its callback under it


@functools.lru_cache(maxsize=None)
def _ahead_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=4, thread_name_prefix="fxopt-backward-ahead")


def _compile_ahead(fn, spec: str, device: int) -> None:
    with _ahead_lock:
        if (fn, spec) not in _ahead:
            _ahead[fn, spec] = future = _ahead_pool().submit(_preload, fn, spec, device)
            future.add_done_callback(lambda _: _forget(fn, spec, future))


def start_own_op_compiles(gm, example_inputs) -> int:
    """Start compiling the kernels of a torch-level graph's fused ops (attention, cross-entropy) before
    aot_autograd traces it, on the pool of the predicted backward compiles: the ATen graph's precompile
    then waits for them (`_preload_own_op`) instead of starting them after aot_autograd, the post-grad
    passes and codegen. Returns how many started (0 for CPU graphs)."""
    cuda = [t for t in example_inputs if isinstance(t, torch.Tensor) and t.is_cuda]
    if not cuda:
        return 0
    training = torch.is_grad_enabled() and any(t.requires_grad for t in cuda)
    wait_for_driver()
    try:
        found = before_autograd_compiles(gm, training)
    except Exception as exc:  # the ATen graph's precompile asks for them, as it would have
        log.debug("fxopt: no early own-op compiles: %s", exc)
        return 0
    for fn, spec in found:
        _compile_ahead(fn, spec, cuda[0].device.index or 0)
    return len(found)


def _forget(fn, spec: str, future) -> None:
    """Done: the kernel is in its JITFunction's cache now, which the backward's stand-in calls find."""
    with _ahead_lock:
        if _ahead.get((fn, spec)) is future:
            del _ahead[fn, spec]


def _preload_own_op(fn, spec: str, device: int) -> None:
    """_preload, or wait for the same compile already started ahead (a predicted backward kernel)."""
    with _ahead_lock:
        started = _ahead.pop((fn, spec), None)
    if started is not None:
        started.result()
    else:
        _preload(fn, spec, device)


def _preload(fn, spec: str, device: int) -> None:
    """Compile one of an fxopt op's kernels for the specialisation its stand-in call asked for, and
    Triton's launcher for it where torch's C launcher cannot take it (TMA descriptors); a failure is
    left to the op's first launch, which compiles as it would have anyway."""
    wait_for_keys()
    try:
        with _on(device):
            kernel = preload(fn, spec)  # a TMA kernel's launcher is built beside its compile
            if not (Environment.read().static_launch and static_refusal(kernel) is None):
                warm_launcher(kernel)  # else torch's C launcher takes it: Triton's is never built
    except Exception as exc:
        log.debug("fxopt: precompiling %s failed (it compiles at its first launch): %s", fn.fn.__name__, exc)


def _on(device: int):
    """The graph's GPU current on this thread (pool threads start on device 0: on rank 1 of a
    two-GPU job the kernels were compiled for the wrong GPU, then again at the first call)."""
    return torch.cuda.device(device) if torch.cuda.is_available() else contextlib.nullcontext()


def _graph_device(gm) -> int:
    vals = (n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder")
    return next((v.device.index or 0 for v in vals if getattr(v, "is_cuda", False)), 0)


def _compile_in_workers(gm, module, todo: list[Kernel], source: str, cache, workers: int):
    """Send `todo` and the graph's own-op compiles to the compile workers. Returns ({kernel name: wait
    for its worker}, finish: wait for the rest and log what the workers did). The workers load the
    wrapper's kernel part (codegen/wrapper_text.py), written to fxopt's cache beside the wrapper."""
    try:
        pool = compile_pool.pool_for(compile_pool.current_target(), workers)
    except Exception as exc:  # no driver, no target: this process compiles, as without workers
        log.debug("fxopt: no compile workers: %s", exc)
        pool = None
    if pool is None:
        return {}, lambda: None
    path = cache.path_for(source[:source.index(KERNELS_END)]) if todo else ""
    jobs = {}
    for k in todo:
        fn = getattr(module, k.name)
        fn = getattr(fn, "fn", fn)  # the JITFunction inside FastKernel
        if fn.__module__ != module.__name__:
            continue  # another wrapper's kernel of the same program (compile._KERNELS): a worker would compile this
            # wrapper's text of it, which the shared JITFunction never looks up
        spec = compile_pool.specialization(fn, *k.warmup_args(), grid=k.grid_tuple(), **k.options(), **k.constexprs)
        if spec is not None:
            jobs[k.name] = pool.submit(path, fn.__module__, k.name, spec)
    for i, (fn, spec) in enumerate(own_op_compiles(gm)):  # attention and cross-entropy kernels, by module name
        jobs[f"{fn.fn.__name__}#{i}"] = pool.submit("", fn.fn.__module__, fn.fn.__name__, spec)
    start = time.perf_counter()

    def finish():
        replies = [(name.split("#")[0], job.result()) for name, job in jobs.items()]
        for name, reply in replies:
            if not reply["ok"]:
                log.info("fxopt: compile worker could not compile %s (compiling it here): %s", name, reply["error"])
        log.info("fxopt: %d kernels compiled in %d workers (ready %.2f s after start): longest %.2f s, "
                 "all done %.2f s after sending", len(replies), len(pool.ready_after), max(pool.ready_after, default=0.0),
                 max((r["seconds"] for _, r in replies), default=0.0), time.perf_counter() - start)

    return {name: job.result for name, job in jobs.items()}, finish


_keys_warmed = threading.Event()  # the threads below were started
_keys_ready = threading.Event()  # ... and the keys are in Triton's caches
_driver_done = threading.Event()  # ... and Triton's driver is built
_warm_lock = threading.Lock()
KEYS_WAIT_S = 30.0  # a compile waits at most this long for the keys thread, then computes them itself


def warm_compile_keys(example_inputs) -> None:
    """Compute, on threads while dynamo and aot_autograd trace, what every Triton compile of this
    process needs first and computes once: `triton_key()` (a SHA-256 of Triton's sources and its
    shared library: 0.39 s on this repo's CI machine), the backend's hash (`ptxas --version`) and the
    driver's C utilities (a host compiler run with a cold cache: 0.26-0.36 s). Left to the precompile
    pool, every pool thread computed the key at once (Triton's lru_cache does not lock), each kernel's
    "compile" spending ~0.4 s there even on a cache hit; and the driver, built after the key on one
    thread, was still building when the graph's first stand-in call needed it, so the calling thread
    built it a second time (benchmarks/results/2026-12-04-h200.md, 2026-12-04-h200-b.md).
    Both threads run with a short GIL switch interval (codegen/gil_handoff.py): beside the tracing
    main thread the key's 1 MiB reads each waited up to 5 ms for the GIL (2.4 s on the H200 host), so
    the graph's compiles started before the keys were ready and computed them again; now they wait
    for this thread (`wait_for_keys`). Usually started earlier, by `warm_before_tracing`."""
    if any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs):
        _start_warm_threads()


def warm_before_tracing() -> bool:
    """Start warm_compile_keys' threads when torch.compile is handed fxopt's backend (`fxopt.backend()`,
    or the entry point `backend="fxopt"` loads), before dynamo traces, if this process can compile for
    a GPU: started at the graph's arrival they had ~0.5 s less to finish before the first stand-in
    call and compile needed them. Measured on an H100 (GPT-2 block inference, three cold first calls
    each, benchmarks/results/2026-12-05-h100.md): 2.44-2.91 s against 2.51-3.01 s started late, inside
    the noise. On a machine with a GPU that compiles only CPU graphs this costs one thread's half
    second of CPU, once per process."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or not torch.cuda.is_available():
        return False
    _start_warm_threads()
    return True


def _start_warm_threads() -> None:
    with _warm_lock:
        if _keys_warmed.is_set():
            return
        _keys_warmed.set()
    threading.Thread(target=_driver_ready, daemon=True, name="fxopt-compile-driver").start()
    threading.Thread(target=_keys_thread, daemon=True, name="fxopt-compile-keys").start()


def wait_for_keys() -> None:
    """Before a compile: wait for the keys thread if one was started (a thread computing the key
    itself repeats the hash: Triton's lru_cache does not lock)."""
    if _keys_warmed.is_set():
        _keys_ready.wait(KEYS_WAIT_S)


def wait_for_driver() -> None:
    """Before a stand-in call (it reaches Triton's driver): wait for the driver thread if one was
    started, instead of building the driver a second time (Triton's lazy driver does not lock)."""
    if _keys_warmed.is_set():
        _driver_done.wait(KEYS_WAIT_S)


def _driver_ready() -> None:
    try:
        with quick_handoff():  # the host compiler runs in a subprocess
            compile_pool.current_target()
    except Exception as exc:  # no driver: the first compile says so, as it would have
        log.debug("fxopt: Triton's driver not warmed: %s", exc)
    finally:
        _driver_done.set()


def _keys_thread() -> None:
    try:
        with quick_handoff():
            _compute_keys()
            importlib.import_module("triton.compiler.code_generator")  # every compile's first import
    except Exception as exc:  # a compile computes them, as it would have
        log.debug("fxopt: Triton's keys not warmed: %s", exc)
    finally:
        _keys_ready.set()


def _compute_keys(target: tuple | None = None) -> None:
    """The keys; the target from Triton's driver (warmed by its own thread, found ready by now)."""
    for module in ("triton.runtime.cache", "triton.compiler.compiler"):  # where Triton versions keep it
        key = getattr(importlib.import_module(module), "triton_key", None)
        if key is not None:
            key()
            break
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend

        make_backend(GPUTarget(*(target or compile_pool.current_target()))).hash()
    except Exception as exc:  # the first compile computes it, as it would have
        log.debug("fxopt: backend hash not warmed: %s", exc)
