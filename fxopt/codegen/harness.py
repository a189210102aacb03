"""A generated kernel as a file that runs on its own: imports, the kernel, and a small launch harness.

    python kernels/fused_mul_add_0.py     # random inputs of the compiled shapes, one launch, a summary
    python kernels/fused_mul_add_0.py --compile-for cuda:90   # compile for that GPU, no GPU needed

On a machine without a GPU the harness runs the kernel in the Triton interpreter (kernels built for
CUDA that call libdevice need the GPU), or, with --compile-for, compiles it for a GPU without launching
it (codegen/offline_compile.py).
"""
from __future__ import annotations

import torch

from ..analysis.symbolic import hint
from .kernel import Kernel

HEADER = '''# fxopt kernel {name} ({kind}): {ops}
import os
import sys

import torch

COMPILE_FOR = sys.argv[sys.argv.index("--compile-for") + 1] if "--compile-for" in sys.argv[:-1] else None
if COMPILE_FOR:
    os.environ["TRITON_INTERPRET"] = "0"  # Triton's compiler, for that GPU (no GPU needed)
elif not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # run on CPU tensors in the Triton interpreter
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra import libdevice  # noqa: E402,F401

from fxopt.codegen.wrapper_runtime import cdiv, next_power_of_2, whole_row_block  # noqa: E402,F401

'''

MAIN = '''

def _tensor(size, stride, dtype, device):
    """Random values laid out with the compiled strides (broadcast strides of 0 included)."""
    span = 1 + sum((s - 1) * st for s, st in zip(size, stride)) if all(size) else 0
    base = torch.randn(span) if dtype.is_floating_point else torch.randint(0, 2, (span,))
    return base.to(dtype).to(device).as_strided(size, stride)


if __name__ == "__main__":
    if COMPILE_FOR:  # each launch below compiles its kernel for that GPU instead of running it
        from fxopt.codegen.offline_compile import compile_only
        compile_only(COMPILE_FOR, globals(), {names})
    device = "cuda" if torch.cuda.is_available() and not COMPILE_FOR else "cpu"
    inputs = [_tensor(*spec, device) if isinstance(spec, tuple) else spec for spec in INPUTS]
    scratch = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in WORKSPACES]
    outputs = [torch.empty_strided(size, stride, dtype=dtype, device=device) for size, stride, dtype in OUTPUTS]
{setup}{launches}
    if COMPILE_FOR:
        print(f"compiled {{', '.join({names})}} for {{COMPILE_FOR}}")
    for i, o in enumerate([] if COMPILE_FOR else outputs):
        print(f"output {{i}}: {{o.dtype}}{{list(o.shape)}} sum={{o.double().sum().item():.6g}}")
'''


def _specs(vals) -> str:
    """(size, stride, dtype) per tensor at its example sizes; a SymInt input as its example value."""
    def one(v):
        if not isinstance(v, torch.Tensor):
            return str(hint(v))
        return f"({tuple(hint(s) for s in v.shape)}, {tuple(hint(s) for s in v.stride())}, {v.dtype})"
    return "[" + ", ".join(one(v) for v in vals) + "]"


def standalone_source(k: Kernel) -> str:
    launches = []
    stages = [s for s in (k.prologue, k, k.epilogue) if s is not None]
    for stage in stages:
        launches.append(f"    {stage.name}[{stage.grid_source()}](*inputs, *scratch, *outputs"
                        f"{stage.launch_suffix()})")
    symbols = "".join(f"{name} = {value}  # size symbol: its example value\n" for name, value in k.symbols.items())
    setup = "".join(f"    {line}\n" for line in k.setup)
    body = (HEADER.format(name=k.name, kind=k.kind, ops=", ".join(k.ops)) + k.full_source()
            + f"\n\n{symbols}INPUTS = {_specs(k.inputs)}\nOUTPUTS = {_specs(k.outputs)}\n"
            + f"WORKSPACES = {[(shape, dtype) for shape, dtype in k.workspaces]}\n"
            + MAIN.format(launches="\n".join(launches), setup=setup, names=[stage.name for stage in stages]))
    return body
