"""Compile kernels for a GPU on a machine without one: `python kernels/<name>.py --compile-for cuda:90`
(the files explain and FXOPT_DUMP write, codegen/harness.py) compiles each launch for that target with
Triton's own compiler (ptxas ships with Triton) and launches nothing; inside `compiling_launches(target)`
every launch of fxopt's own kernels (attention, cross-entropy: interpreter_guard.launcher) does the same.

Why: on a machine without a GPU the kernels run in Triton's interpreter, which accepts code the GPU
compiler refuses (types it would not unify, calls it cannot inline). This checks the compile without
the GPU; the numbers still come from the interpreter or the GPU.
"""
from __future__ import annotations

import contextlib
import functools

from . import interpreter_guard
from .compile_worker import use_offline_driver


def parse_target(text: str) -> tuple[str, int, int]:
    """'cuda:90' -> ("cuda", 90, 32): Triton's GPUTarget (backend, compute capability, warp size)."""
    backend, _, arch = text.partition(":")
    if backend != "cuda" or not arch.isdigit():
        raise ValueError(f"fxopt: --compile-for takes cuda:<compute capability>, e.g. cuda:90 (an H100/H200), "
                         f"not {text!r}")
    return backend, int(arch), 32


class CompileOnly:
    """Stands in for a kernel: `kernel[grid](*args)` compiles it for those arguments, without a launch."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return functools.partial(self.fn.warmup, grid=grid)


def compile_only(target: str, namespace: dict, names: list[str]) -> None:
    """Make Triton compile for `target` offline and every launch of `names` in `namespace` a compile."""
    use_offline_driver(*parse_target(target))
    for name in names:
        namespace[name] = CompileOnly(namespace[name])


@contextlib.contextmanager
def compiling_launches(target: str):
    """Inside, each fxopt kernel launch (CPU tensors are fine: only their dtypes and alignment count)
    compiles the kernel for `target` instead of running it. Triton must have been imported with
    TRITON_INTERPRET=0. The outputs are left unwritten."""
    from triton.runtime.driver import driver

    saved = driver._active
    use_offline_driver(*parse_target(target))
    interpreter_guard.compile_only = CompileOnly
    try:
        yield
    finally:
        interpreter_guard.compile_only = None
        driver._active = saved
