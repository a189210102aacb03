"""Compile a graph's Triton kernels in worker processes, all at once, before the parent loads them.

Triton's front end holds the GIL, so the thread pool that compiles a graph's kernels runs much of
them one at a time. Experimental and off by default: on the H200 host it did not shorten a cold first
call (benchmarks/results/2026-12-04-h200.md has the timelines).
Here each kernel's specialisation is taken from Triton itself (its `jit_cache_hook` sees the
arguments a warmup would compile for, and the hook stops the compile), sent to a worker
(codegen/compile_worker.py), and compiled there into Triton's cache; the parent's own warmup then
finds the cache entry and only loads the binary. The workers start when the first CUDA graph reaches
fxopt's backend, so their start-up overlaps dynamo's and aot_autograd's tracing.

The workers only warm a cache: a kernel a worker could not compile, or compiled under another key,
is compiled by the parent as before, with the parent's error if it fails there too.
FXOPT_COMPILE_WORKERS=N turns them on with N workers (default 0: off).
Each worker is a process of its own (Python and Triton, about 100 MiB of host memory, no GPU context).
"""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

log = logging.getLogger("fxopt")
WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_worker.py")
_POOLS: dict[tuple, "CompilePool"] = {}
_lock = threading.Lock()
_capture_lock = threading.Lock()


KERNEL_MODULES = ("fxopt.attention.flash_forward", "fxopt.attention.flash_forward_tma",
                  "fxopt.attention.flash_backward", "fxopt.attention.flash_backward_tma",
                  "fxopt.attention.flash_decode", "fxopt.losses.cross_entropy_kernels")


class CompilePool:
    """N worker processes; the first `module_workers` of them import fxopt's own kernel modules
    (KERNEL_MODULES: attention, cross-entropy) and take the requests for those (path ""), the others
    take generated wrappers' kernels. Each
    request's reply completes its Future."""

    def __init__(self, n: int, target: tuple, module_workers: int = 0):
        self.target = target
        self._queues = (queue.Queue(), queue.Queue())  # (wrapper kernels, attention kernels)
        self._ids = iter(range(1 << 62))
        self.started, self.ready_after = time.perf_counter(), []  # seconds from start to each worker's ready line
        self.module_workers = module_workers
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        root = os.path.dirname(os.path.dirname(os.path.dirname(WORKER_SCRIPT)))  # the folder holding fxopt
        self._procs = []
        for i in range(n):
            argv = [sys.executable, WORKER_SCRIPT, json.dumps(list(target))]
            if i < module_workers:
                argv += [root, ",".join(KERNEL_MODULES)]
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            self._procs.append(proc)
            threading.Thread(target=self._serve, args=(proc, self._queues[i < module_workers]), daemon=True,
                             name="fxopt-compile").start()

    def submit(self, path: str, module: str, name: str, spec: str) -> Future:
        """Compile kernel `name` of the file `path`, loaded as module `module` (the parent's name for
        it); with path "", of the importable module `module`."""
        future: Future = Future()
        request = {"id": next(self._ids), "path": path, "module": module, "name": name, "spec": spec,
                   "target": list(self.target)}
        if not path and not self.module_workers:
            future.set_result({"id": request["id"], "ok": False, "seconds": 0.0,
                               "error": "no compile worker imports fxopt's kernel modules"})
        else:
            self._queues[not path].put((request, future))
        return future

    def _serve(self, proc: subprocess.Popen, requests: queue.Queue) -> None:
        """Hand this worker one request at a time; once it has died, fail what it would have taken
        (the parent compiles those kernels itself), so no Future waits forever."""
        alive = bool(proc.stdout.readline())  # the worker's ready line
        self.ready_after.append(time.perf_counter() - self.started)
        while True:
            request, future = requests.get()
            if request is None:
                return
            if alive:
                try:
                    proc.stdin.write(json.dumps(request) + "\n")
                    proc.stdin.flush()
                    line = proc.stdout.readline()
                except OSError:
                    line = ""
                alive = bool(line)
                if alive:
                    future.set_result(json.loads(line))
                    continue
            future.set_result({"id": request["id"], "ok": False, "seconds": 0.0,
                               "error": f"compile worker {proc.pid} exited (status {proc.poll()})"})

    def close(self) -> None:
        for i in range(len(self._procs)):
            self._queues[i < self.module_workers].put((None, None))
        for proc in self._procs:
            try:
                proc.stdin.close()  # the worker's loop ends at EOF
                proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()


def supported() -> bool:
    """The two Triton facilities the workers rely on (both in 3.6 and later)."""
    try:
        from triton import knobs
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    return hasattr(JITFunction, "preload") and hasattr(knobs.runtime, "jit_cache_hook")


def current_target() -> tuple:
    from triton.runtime.driver import driver

    t = driver.active.get_current_target()
    return (t.backend, t.arch, t.warp_size)


def pool_for(target: tuple, n: int) -> CompilePool | None:
    """The `n` workers compiling for `target`, started on first use; None when n is 0 or this Triton
    lacks what they need (the first call's `n` holds for the process)."""
    with _lock:
        if target not in _POOLS:
            if n == 0 or not supported():
                return None
            _POOLS[target] = CompilePool(n, target, module_workers=2 if n >= 4 else 0)
            log.debug("fxopt: started %d compile workers for %s", n, target)
        return _POOLS[target]


def prestart(example_inputs, n: int) -> None:
    """Start the workers for the current CUDA device while tracing goes on (n = 0: none)."""
    import torch

    if n == 0 or not any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs):
        return
    try:
        pool_for(current_target(), n)
    except Exception as exc:  # the kernels compile in this process, as without workers
        log.info("fxopt: compile workers not started: %s", exc)


@contextlib.contextmanager
def capturing():
    """Inside, a Triton compile on this thread is recorded as (JITFunction, serialised specialisation)
    and skipped (the launch that asked for it returns without running); compiles on other threads go
    on as usual. Yields the list of recorded compiles."""
    from triton import knobs

    captured: list = []
    me = threading.get_ident()
    with _capture_lock:  # one capture at a time: each restores the hook it found
        previous = knobs.runtime.jit_cache_hook

        def hook(**kw):
            if threading.get_ident() == me and "specialization_data" in kw.get("compile", {}):
                captured.append((kw["fn"].jit_function, kw["compile"]["specialization_data"]))
                return True  # Triton skips this compile
            return previous(**kw) if previous is not None else None

        knobs.runtime.jit_cache_hook = hook
        try:
            yield captured
        finally:
            knobs.runtime.jit_cache_hook = previous


def specialization(fn, *args, **kwargs) -> str | None:
    """Triton's serialised specialisation of `fn.warmup(*args, **kwargs)`, without compiling it (None
    if this Triton did not hand it to the hook, or `fn` is already compiled for these arguments)."""
    with capturing() as captured:
        fn.warmup(*args, **kwargs)
    return next((spec for f, spec in captured if f is fn), None)


@atexit.register
def _shutdown() -> None:
    for pool in _POOLS.values():
        pool.close()
