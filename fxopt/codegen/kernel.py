"""What codegen hands the wrapper for every generated kernel: its source and how to launch it.

For a graph with symbolic sizes, int_args may be sympy expressions of the size symbols, and grid,
constexpr and num_warps entries may be Python source over them (`cdiv(s0*768, 1024)`): the
wrapper binds the symbols from the call's inputs, so all of these are evaluated at call time."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..analysis.symbolic import is_symbolic, pexpr
from .kernel_identity import kernel_identity


@dataclass
class Kernel:
    name: str
    kind: str  # "pointwise" | "reduction"
    source: str  # the @triton.jit function (and any helpers it calls), no imports
    ops: list[str]  # the ATen ops fused into it, in order
    grid: int | str | tuple  # programs launched: a count (1-D grid) or (axis 0, axis 1) for tiled kernels;
    # str entries are Python source over the size symbols (symbolic graphs)
    int_args: list  # integer arguments after the pointers (xnumel, rnumel, ..., size symbols): int or sympy
    constexprs: dict  # XBLOCK, RBLOCK, ...: int, or Python source chosen per call (symbolic row lengths)
    num_warps: int | str
    outputs: list[torch.Tensor] = field(default_factory=list)  # meta values of the outputs, in order
    input_dtypes: list[torch.dtype] = field(default_factory=list)  # dtypes of the pointer inputs
    inputs: list[torch.Tensor] = field(default_factory=list)  # meta values of the pointer inputs
    notes: dict[str, str] = field(default_factory=dict)  # e.g. {"reduction": "persistent"}
    # split reductions: scratch buffers (shape, dtype) and a kernel that fills them first; both kernels
    # take (inputs..., workspaces..., outputs...)
    workspaces: list[tuple[tuple[int, ...], torch.dtype]] = field(default_factory=list)
    prologue: "Kernel | None" = None
    epilogue: "Kernel | None" = None  # launched after it (column partials kept in an output: its fix-up)
    symbols: dict[str, int] = field(default_factory=dict)  # size symbols it takes -> example values
    setup: list[str] = field(default_factory=list)  # wrapper lines run before the launch (per-call configs)
    # a symbolic row: the persistent kernel launched instead when `alternative_when` (Python source over
    # the size symbols) holds at call time
    alternative: "Kernel | None" = None
    alternative_when: str = ""
    # a register cap per thread (Triton's maxnreg), int or per-call source; None leaves ptxas free
    maxnreg: int | str | None = None

    @property
    def symbolic(self) -> bool:
        return bool(self.symbols)

    def launched(self) -> list["Kernel"]:
        """Every Triton function this kernel launches, in full_source's order."""
        return [k for k in (self.prologue, self, self.epilogue, self.alternative) if k is not None]

    def full_source(self) -> str:
        """Every Triton function this kernel launches (a split reduction's partial kernel first)."""
        return "\n\n".join(k.source for k in self.launched())

    def warmup_args(self) -> list:
        """Arguments for JITFunction.warmup: pointer dtypes, then the real integer arguments."""
        return [*self.input_dtypes, *(dt for _, dt in self.workspaces), *(o.dtype for o in self.outputs),
                *self.int_args]

    def grid_tuple(self) -> tuple[int, ...]:
        """The launch grid as Triton takes it: (n,) or (n0, n1)."""
        return tuple(self.grid) if isinstance(self.grid, tuple) else (self.grid,)

    def grid_source(self) -> str:
        """The launch grid as source: `(n,)` for 1-D kernels, `(n0, n1)` for tiled ones."""
        g = self.grid_tuple()
        return f"({g[0]},)" if len(g) == 1 else f"({', '.join(str(n) for n in g)})"  # str or int entries

    def launch_suffix(self) -> str:
        """The integer and constexpr arguments of a launch, as source."""
        ints = "".join(f", {pexpr(v) if is_symbolic(v) else v}" for v in self.int_args)
        consts = "".join(f", {k}={v}" for k, v in self.constexprs.items())
        cap = "" if self.maxnreg is None else f", maxnreg={self.maxnreg}"
        options = "".join(f", {k}={v}" for k, v in NO_FP_FUSION.items())
        return f"{ints}{consts}, num_warps={self.num_warps}{cap}{options}"

    def options(self) -> dict:
        """Triton's launch options besides the constexprs: num_warps, maxnreg where capped, and no
        contraction of a multiply and an add into one fma (see NO_FP_FUSION)."""
        return {"num_warps": self.num_warps, **({} if self.maxnreg is None else {"maxnreg": self.maxnreg}),
                **NO_FP_FUSION}


# Eager runs every op as its own kernel, so a product is rounded before anything subtracts from it. Fused
# into one kernel, the GPU compiler would contract `x * w - m` into fma(x, w, -m), which skips that rounding:
# where m is the rounded product itself (the row max of softmax(x * w)), fma returns the rounding error
# instead of 0, and exp of it is inf or 0 once |x * w| is large (~1e15 in fp32: log_softmax came out
# +-inf on the H100, eager finite; benchmarks/edge_sweep.py --family rows). Generated kernels are memory
# bound, so the separate multiply and add cost nothing measurable; attention's kernels keep the fma.
NO_FP_FUSION = {"enable_fp_fusion": False}


def kernel_definitions(kernels) -> str:
    """The wrapper's kernel section: each distinct program defined once. A function equal to an earlier one
    up to names (kernel_identity: the 24 blocks of a GPT-2 medium give 24 texts of each block kernel)
    becomes a second name for it, so the module defines, and Triton compiles, one JITFunction for all of
    them: a 24-block stack's backward module defines 12 functions instead of 266.
    Graphs without repeats get the text they always had."""
    first: dict[str, str] = {}
    out = []
    for k in kernels:
        parts = []
        for fn in k.launched():
            same = first.setdefault(kernel_identity(fn.source), fn.name)
            parts.append(fn.source if same == fn.name else f"{fn.name} = {same}  # the same program as {same}")
        out.append("\n" + "\n\n".join(parts) + "\n")
    return "".join(out)
