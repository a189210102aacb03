"""Compile generated kernels for a GPU on a machine without one: `python kernels/<name>.py --compile-for
cuda:90` (the files explain and FXOPT_DUMP write, codegen/harness.py) compiles each launch for that
target with Triton's own compiler (ptxas ships with Triton) and launches nothing.

Why: on a machine without a GPU the kernels run in Triton's interpreter, which accepts code the GPU
compiler refuses (types it would not unify, calls it cannot inline). This checks the compile without
the GPU; the numbers still come from the interpreter or the GPU.
"""
from __future__ import annotations

import functools

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
