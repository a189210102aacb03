"""Launch compiled Triton kernels without re-deriving what the first launch already knows.

`kernel[grid](*args, **constexprs)` makes Triton bind the arguments, compute each one's
specialisation (16-byte alignment of pointers, ints divisible by 16 or equal to 1), hash them into a
cache key and look the compiled kernel up: about 50-70 us of Python per launch on the H200 machine
(triton 3.6), more than most fused kernels of a small batch take on the GPU. A wrapper launches the
same kernel with the same kinds of arguments on every call, so `FastKernel` keeps the compiled
kernel of the first launch together with the specialisation it was compiled for, and later launches
that have that same specialisation go straight to its launcher (`CompiledKernel.run`, what Triton's
own `JITFunction.run` ends with). Anything else takes Triton's path, which stays correct:
  - an argument whose specialisation differs (a misaligned input view, a size that became 1);
  - launch hooks installed (profilers read `launch_metadata`, computed only on Triton's path);
  - a Triton without the `CompiledKernel.run` signature of 3.3 and later (checked at the first launch).
The specialisation is recomputed on every call (a pointer modulo 16 and two int tests per argument,
about 0.3 us each), so a fast launch never runs a kernel compiled for other arguments. A generated
wrapper's launch site says which positions can change at all (`checked`, from
codegen/wrapper_layouts.launch_checks: graph inputs and size expressions; its own buffers are aligned
and its literal ints fixed by construction), and only those are re-checked: most sites check none.

A fast launch goes through torch's C launcher where it can take the kernel (codegen/static_launch.py:
no Python between the wrapper and cuLaunchKernel), else through Triton's `CompiledKernel.run`. The
first launch of such a kernel goes through torch's launcher too: the kernel is compiled with
`JITFunction.warmup`, which skips building Triton's own launcher (a C file through the host compiler,
0.25 s per kernel signature with a cold cache: 15 of them were 4.8 s of a GPT-2 training step's first
call, benchmarks/results/2026-12-02-h200-f.md).
`FXOPT_STATIC_LAUNCH=0` keeps every launch on Triton's launcher (to compare, or to rule it out).
"""
from __future__ import annotations

import weakref

import torch
from torch import Tensor

from ..options import Environment
from .static_launch import StaticLaunch, picker, plan_static_launch, static_launcher_available

try:  # triton >= 3.4 keeps the launch hooks in knobs; older ones on CompiledKernel
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older triton
    _knobs = None


def hooks_installed() -> bool:
    """Launch hooks (a profiler) need the launch metadata that only Triton's own path computes.
    Runs on every launch, so a plain loop over the two hooks (a generator cost ~1 us here): each is None
    or (triton >= 3.5) a HookChain whose `calls` list is empty when no hook is installed."""
    runtime = _RUNTIME
    if runtime is None:
        return True
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and (not hasattr(hook, "calls") or hook.calls):
            return True
    return False


_RUNTIME = getattr(_knobs, "runtime", None)


def launch_target() -> tuple[int, int]:
    """The device and raw CUDA stream a launch goes to (the capturing stream inside a CUDA graph
    capture), read the way Triton's own launcher reads them: two C calls, where
    torch.cuda.current_stream() builds a Stream object through device-index normalisation (about 25 us
    per launch on the H200 host)."""
    device = _current_device()
    return device, _raw_stream(device)


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device = getattr(torch._C, "_cuda_getDevice", None)
if _raw_stream is None or _current_device is None:  # pragma: no cover - a torch without these
    def launch_target() -> tuple[int, int]:  # noqa: F811
        stream = torch.cuda.current_stream()
        return stream.device.index, stream.cuda_stream


def specialisation(args) -> tuple:
    """What Triton specialises a launch on, per argument: a pointer's dtype and 16-byte alignment; a
    tensor descriptor's dtype and tile; an int's divisibility by 16, being 1, and whether it fits in
    32 bits; the type of anything else. (Runs on every launch: one plain loop, ints tested first, no
    global lookups inside it: about 0.25 us per argument.)"""
    key = []
    append = key.append
    for a in args:
        if type(a) is int:  # not bool: Triton types True as a constexpr-like i1
            append((not a & 15, a == 1, -2147483648 <= a < 2147483648))
        elif isinstance(a, Tensor):
            append((a.dtype, not a.data_ptr() & 15))
        elif hasattr(a, "block_shape") and hasattr(a, "base"):  # a TMA TensorDescriptor: compiled for its tile
            append(("desc", a.base.dtype, tuple(a.block_shape), getattr(a, "padding", None)))
        else:
            append(type(a))
    return tuple(key)


class FastKernel:
    """A JITFunction launched as `kernel[grid](*args, **constexprs_and_options)`, faster after the first
    launch of each specialisation (up to MAX_VARIANTS of them are remembered)."""

    MAX_VARIANTS = 16

    def __init__(self, fn, checked: tuple[int, ...] | None = None):
        self.fn = fn
        # the arguments a launch re-checks: all of them, or those `checked` names (a wrapper's site)
        self._checked = None if checked is None else picker(checked)
        ALL.add(self)
        self._names = list(fn.arg_names)
        # (device, specialisation, keyword arguments) -> (CompiledKernel, its constexpr arguments in
        # order, its StaticLaunch or None)
        self._compiled: dict[tuple, tuple] = {}
        self._static = Environment.read().static_launch  # FXOPT_STATIC_LAUNCH, read when the kernel is loaded
        self.triton_launches = 0  # launches through Triton's JITFunction (binding, cache lookup)
        self.fast_launches = 0  # launches that skipped Triton's binding (tests read it)
        self.static_launches = 0  # ... of which went through torch's C launcher
        self.static_refused: str | None = None  # why the last kernel compiled keeps Triton's launcher

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def __getattr__(self, name):  # warmup, arg_names, ... from the JITFunction
        return getattr(self.fn, name)

    def _launch(self, grid, args, kwargs):
        device, stream = launch_target()
        # constexprs and options (num_warps, ...) are part of the key; so is the device, since a loaded
        # kernel belongs to one device's context
        pick = self._checked
        key = (device, specialisation(args if pick is None else pick(args)), tuple(kwargs.items()))
        entry = self._compiled.get(key)
        if entry is not None and not hooks_installed():
            compiled, rest, static = entry
            g = (*grid, 1, 1)
            self.fast_launches += 1
            if static is not None:
                static.launch(g[0], g[1], g[2], stream, args)
                self.static_launches += 1
            else:
                compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, None,
                             None, None, *args, *rest)
            return compiled
        remember = len(self._compiled) < self.MAX_VARIANTS
        # compile without launching where torch's C launcher may take the kernel: Triton builds its own
        # launcher (a C file through the host compiler, ~0.2-0.3 s per kernel signature with a cold
        # cache) only when a kernel launches through it
        warm = remember and self._static and _STATIC_POSSIBLE and type(grid) is tuple and not hooks_installed()
        if warm:
            kernel = self.fn.warmup(*args, grid=grid, **kwargs)
            if kernel is None:  # a capture took the compile (codegen/compile_pool.capturing): nothing runs
                return None
            static = self._static_launch(kernel, len(args), device)
            if static is not None:
                if getattr(kernel, "module", None) is None:  # what ptxas reported, where Triton's attributes keep it
                    kernel.n_regs, kernel.n_spills = static.n_regs, static.n_spills
                self._compiled[key] = (kernel, self._constexprs(args, kwargs), static)
                g = (*grid, 1, 1)
                static.launch(g[0], g[1], g[2], stream, args)
                self.static_launches += 1
                return kernel
        kernel = self.fn[grid](*args, **kwargs)
        if kernel is None:  # (as above)
            return None
        self.triton_launches += 1
        if remember and _launcher_signature_known(kernel):
            # (a warm kernel was refused by the C launcher already: Triton's launcher keeps it)
            static = None if warm else self._static_launch(kernel, len(args), device)
            self._compiled[key] = (kernel, self._constexprs(args, kwargs), static)
        return kernel

    def _constexprs(self, args, kwargs) -> tuple:
        """The constexprs in signature order, fixed for a key (its kwargs are part of it)."""
        return tuple(kwargs[n] for n in self._names[len(args):])

    def _static_launch(self, kernel, n_args: int, device: int) -> StaticLaunch | None:
        if not self._static:
            self.static_refused = "FXOPT_STATIC_LAUNCH=0"
            return None
        plan = plan_static_launch(kernel, n_args, device)
        if isinstance(plan, str):
            self.static_refused = plan
            return None
        return plan


_STATIC_POSSIBLE = static_launcher_available()
ALL: "weakref.WeakSet[FastKernel]" = weakref.WeakSet()  # every FastKernel alive (host_profile counts launches)


def _launcher_signature_known(kernel) -> bool:
    """CompiledKernel.run(gx, gy, gz, stream, function, packed_metadata, launch_metadata, enter, exit,
    *every bound argument) is the launcher call of triton 3.3 and later."""
    return (_knobs is not None and hasattr(kernel, "run") and hasattr(kernel, "function")
            and hasattr(kernel, "packed_metadata"))


_FAST: dict = {}  # JITFunction -> its FastKernel, for kernels launched from library code (attention, losses)


def fast_kernel(fn) -> FastKernel:
    """The one FastKernel of `fn` (kept for the process, as Triton keeps its compiled kernels)."""
    fast = _FAST.get(fn)
    if fast is None:
        fast = _FAST[fn] = FastKernel(fn)
    return fast
