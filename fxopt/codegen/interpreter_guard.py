"""Keep the Triton interpreter from leaving triton.language patched after a kernel runs.

The interpreter swaps triton.language's builtins for numpy-backed ones while a kernel runs. Library
functions such as tl.sum and tl.max are themselves @triton.jit functions, and when one is called inside
an interpreted kernel, its patches into triton.language.core are never undone (triton 3.6-3.9). A real
GPU compile later in the same process then calls the interpreter's builtins and fails
("'ir.value' object has no attribute 'dtype'"). fxopt launches interpreted kernels through this guard,
which puts back whatever the launch changed.
"""
from __future__ import annotations

import contextlib

import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .fast_launch import fast_kernel


def _patched_namespaces() -> list:
    spaces = [tl, tl.core, tl.math, tl.tensor, tl.core.dtype]
    for name in ("standard", "semantic"):
        if hasattr(tl, name):
            spaces.append(getattr(tl, name))
    return spaces


@contextlib.contextmanager
def restoring_triton_language():
    """Run interpreted kernels inside this; triton.language is put back as it was afterwards."""
    saved = [(space, dict(vars(space))) for space in _patched_namespaces()]
    try:
        yield
    finally:
        for space, attrs in saved:
            for name, value in attrs.items():
                if vars(space).get(name) is not value:
                    setattr(space, name, value)


# Triton's interpreter before 3.7 reads a tensor used as an index (a loop bound computed in the kernel)
# with int() of a one-element array, which numpy 2.4 refuses: say what to install instead of failing there.
_SIZE_ONE_TO_INT = "only 0-dimensional arrays can be converted to Python scalars"
NUMPY_TOO_NEW = ("fxopt: this Triton's interpreter (before triton 3.7) converts one-element numpy arrays with "
                 "int(), which numpy >= 2.4 refuses; to run kernels on the CPU install 'numpy<2.4' or triton >= 3.7")


class GuardedKernel:
    """Launch as `kernel[grid](...)`; triton.language is restored after every launch."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with restoring_triton_language():
                try:
                    return self.fn[grid](*args, **kwargs)
                except Exception as exc:
                    if _SIZE_ONE_TO_INT in str(exc):
                        raise RuntimeError(NUMPY_TOO_NEW) from exc
                    raise
        return launch

    def __getattr__(self, name):
        return getattr(self.fn, name)


compile_only = None  # set inside offline_compile.compiling_launches (its CompileOnly)


def launcher(kernel, grid: tuple, device, who: str):
    """`kernel[grid]` for how triton runs in this process, which is fixed when triton is imported:
    CPU tensors need the interpreter (launches guarded, as above), CUDA tensors the compiler. A
    mismatch is a clear error naming `who` instead of a failure deep inside triton."""
    interpreted = isinstance(kernel, InterpretedFunction)
    if compile_only is not None:  # offline_compile.compiling_launches: compile for its target, no launch
        if interpreted:
            raise ValueError(f"{who}: compiling for a GPU needs triton imported with TRITON_INTERPRET=0")
        return compile_only(kernel)[grid]
    if device.type == "cpu" and not interpreted:
        raise ValueError(f"{who}: cpu tensors run in the Triton interpreter, which needs TRITON_INTERPRET=1 "
                         "set before triton is imported")
    if device.type == "cuda" and interpreted:
        raise ValueError(f"{who}: cuda tensors need the Triton compiler, but triton was imported with "
                         "TRITON_INTERPRET=1 (the interpreter); unset it for GPU runs")
    return GuardedKernel(kernel)[grid] if interpreted else fast_kernel(kernel)[grid]
