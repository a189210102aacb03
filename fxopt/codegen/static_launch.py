"""Launch a compiled Triton kernel through torch's C launcher instead of Triton's Python one.

Triton's `CompiledKernel.run` goes through `CudaLauncher.__call__` (Python: scratch allocation, hook
checks) and a C argument parser that calls each tensor's `data_ptr()` as a Python method. Torch ships
a C launcher for Triton cubins, `torch._C._StaticCudaLauncher` (what Inductor launches its kernels
with): it reads tensors' pointers directly and calls `cuLaunchKernel`. On the H200 host a Triton launch
cost about twice what Inductor's cost (benchmarks/results/2026-12-01-h200-b.md, cProfile), which made
training steps with many small kernels host-bound.

`plan_static_launch(compiled)` reads what the launcher needs from a kernel Triton compiled (the cubin,
the parameter types left after constant folding, warps, shared memory) and loads the cubin; it returns
None, with the reason, for anything the C launcher cannot take, and the caller keeps Triton's path:
  - no `_StaticCudaLauncher` in this torch (a CPU build) or no cubin (another backend);
  - parameters other than pointers, integers and fp32/fp64 scalars (TMA descriptors; 16-bit scalars);
  - launch attributes (clusters, programmatic dependent launch, cooperative grids) or scratch memory.
"""
from __future__ import annotations

import operator
import os
import tempfile
from dataclasses import dataclass

import torch

_LAUNCHER = getattr(torch._C, "_StaticCudaLauncher", None)

# Triton parameter type -> the launcher's one-letter code ("O": a pointer, read from a tensor or None)
_CODES = {"i8": "b", "i16": "h", "i32": "i", "i64": "l", "u8": "B", "u16": "H", "u32": "I", "u64": "K",
          "fp32": "f", "fp64": "d"}


@dataclass
class StaticLaunch:
    """One loaded cubin and how to call it: `launch(gx, gy, gz, stream, args)` takes the positional
    arguments the kernel was launched with (constexpr keywords excluded) and drops those Triton folded
    into the kernel as constants."""
    function: int
    module: int | None  # kept loaded for the process, as Triton keeps its modules
    num_warps: int
    shared: int
    codes: str
    pick: object  # args -> the tuple the cubin takes (scratch placeholders appended)
    n_regs: int = 0  # registers per thread and spills, as the loader reports them (Triton's own
    n_spills: int = 0  # CompiledKernel learns them only when its launcher loads the kernel)

    def launch(self, gx: int, gy: int, gz: int, stream: int, args: tuple) -> None:
        if gx and gy and gz:  # CUDA refuses an empty grid; Triton's launcher skips it too
            _LAUNCHER._launch_kernel(self.function, gx, gy, gz, self.num_warps, self.shared, self.codes,
                                     self.pick(args), stream)


def parameter_codes(compiled, n_args: int) -> tuple[str, list[int], int] | str:
    """(codes, indices of the positional arguments the cubin takes, scratch placeholders) for a kernel
    launched with `n_args` positional arguments, or the reason it cannot be launched statically."""
    src = getattr(compiled, "src", None)
    signature = getattr(src, "signature", None)
    if not isinstance(signature, dict):
        return "no source signature"
    names = list(signature)
    folded = {k[0] if isinstance(k, tuple) else (names.index(k) if isinstance(k, str) else k)
              for k in getattr(src, "constants", {})}
    codes, keep = [], []
    for i, name in enumerate(names):
        ty = signature[name]
        if ty == "constexpr" or i in folded:
            continue
        if i >= n_args:
            return f"parameter {name} is not positional"
        if isinstance(ty, str) and ty.startswith("*"):
            codes.append("O")
        elif ty in _CODES:
            codes.append(_CODES[ty])
        else:
            return f"parameter {name} of type {ty}"
        keep.append(i)
    meta = compiled.metadata
    scratch = 0
    for attr in ("global_scratch_size", "profile_scratch_size"):
        if hasattr(meta, attr):
            if getattr(meta, attr):
                return f"{attr} {getattr(meta, attr)}"
            scratch += 1  # the cubin takes a (null) scratch pointer
    return "".join(codes) + "O" * scratch, keep, scratch


def picker(positions: tuple[int, ...]):
    """args -> the tuple of args at `positions` (operator.itemgetter, in C; it returns a bare value for
    one position, so that case gets its own)."""
    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        (i,) = positions
        return lambda args: (args[i],)
    return operator.itemgetter(*positions)


def launch_attributes(compiled) -> str | None:
    """Why the C launcher cannot launch this kernel as it was compiled (it sets no launch attributes)."""
    meta = compiled.metadata
    if getattr(meta, "num_ctas", 1) != 1:
        return f"num_ctas {meta.num_ctas}"
    for attr in ("launch_pdl", "launch_cooperative_grid"):
        if getattr(meta, attr, False):
            return attr
    cluster = getattr(meta, "cluster_dims", None)
    if cluster is not None and tuple(cluster) not in ((), (1,), (1, 1, 1)):
        return f"cluster_dims {tuple(cluster)}"
    return None


def static_refusal(compiled) -> str | None:
    """Why the C launcher could not launch `compiled` whatever its arguments are, or None: then
    building Triton's own launcher for it ahead of the first launch (a host compiler run on triton
    3.6) is wasted."""
    why = _kernel_refusal(compiled)
    if why:
        return why
    found = parameter_codes(compiled, len(getattr(getattr(compiled, "src", None), "signature", None) or ()))
    return found if isinstance(found, str) else None


def _kernel_refusal(compiled) -> str | None:
    """What refuses the kernel before its parameters are looked at: no C launcher, no cubin, launch
    attributes."""
    if _LAUNCHER is None:
        return "torch has no _StaticCudaLauncher"
    if "cubin" not in (getattr(compiled, "asm", None) or {}):
        return "no cubin"
    return launch_attributes(compiled)


def static_launcher_available() -> bool:
    """torch ships `_StaticCudaLauncher` (CUDA builds)."""
    return _LAUNCHER is not None


def plan_static_launch(compiled, n_args: int, device: int) -> StaticLaunch | str:
    """A StaticLaunch for `compiled` on `device`, or why Triton's launcher has to keep it."""
    why = _kernel_refusal(compiled)
    if why:
        return why
    found = parameter_codes(compiled, n_args)
    if isinstance(found, str):
        return found
    codes, keep, scratch = found
    tail = (None,) * scratch
    take = (lambda args: args) if keep == list(range(n_args)) else picker(tuple(keep))
    pick = (lambda args: take(args) + tail) if scratch else take
    meta = compiled.metadata
    module, function, n_regs, n_spills = _load(compiled.asm["cubin"], meta.name, meta.shared, device)
    return StaticLaunch(function, module, meta.num_warps, meta.shared, codes, pick, n_regs, n_spills)


def _load(cubin: bytes, name: str, shared: int, device: int) -> tuple[int | None, int, int, int]:
    """Load the cubin (the launcher takes a path; the file is gone once loaded)."""
    fd, path = tempfile.mkstemp(suffix=".cubin", prefix="fxopt_")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        loaded = _LAUNCHER._load_kernel(path, name, shared, device)
    finally:
        os.unlink(path)
    # (module, function, n_regs, n_spills) in newer torch; (function, n_regs, n_spills) before
    return tuple(loaded) if len(loaded) == 4 else (None, *loaded)
