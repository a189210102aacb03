"""Column partials kept in the row output's own last rows: a row kernel with column sums and no workspace.

with_column_sums' row kernel leaves one fp32 partial row per program (and per column sum) for the
combine kernel. At 264 programs x 4096 columns that workspace is 4 MiB beside a backward whose outputs
are dx [N, M] and dw [M]: the one allocation that put RMSNorm backward's peak above Inductor's (132.1 vs
128.6 MiB at 16384 x 4096 bf16, benchmarks/results/2026-12-01-h200-j.md). The partials fit in memory the
kernel fills anyway: each program's last `reserve` row blocks of a row output. There the program
computes those rows like the others (their inputs count in the column sums) but does not store that
output; it stores its partials in their place. Then

1. the combine kernel reads each program's partials from there (the same fixed order: deterministic);
2. a fix-up kernel (one program per reserved block) recomputes the reserved rows and stores the output
   over the consumed partials. The row kernel read those rows' inputs last, so they are mostly still
   in L2.

Three launches instead of two and no workspace: the call's peak is its outputs. Taken when the sizes
are static, a row output is row-major with the reduced dims innermost (a reserved block is one
contiguous span of it), whole row blocks (no ragged block to run past the end), every program owns
at least `reserve` blocks, and the spans stay aligned for the partials' dtype. Row kernels never
write in place (liveness.inplace_pairs pairs only pointwise kernels), so the fix-up reads intact inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..analysis.symbolic import is_symbolic, row_major_strides
from .dtypes import TL_DTYPE
from .kernel import Kernel


@dataclass(frozen=True)
class Hosting:
    out: int  # index of the row output that holds the partials
    reserve: int  # row blocks per program held back for them (the program's last ones)
    steps: int  # row blocks per program (XSTEPS)
    blocks: int  # row blocks in all
    span: int  # partial elements per row block of the output (XBLOCK * rnumel * out itemsize / acc itemsize)
    acc: object  # the partials' torch dtype

    def keep_line(self, wide: bool) -> str:
        pid = "tl.program_id(0).to(tl.int64)" if wide else "tl.program_id(0)"
        return (f"held = ({pid} * XSTEPS + tl.minimum(XSTEPS, {self.blocks} - {pid} * XSTEPS) - {self.reserve})"
                f" * XBLOCK  # this program's rows from here on hold its column partials")

    def rows_body(self, em, row_body: list[str]) -> list[str]:
        """The row kernel's per-step lines with the host output's store skipped on reserved blocks."""
        plain, kept = em._store(self.out), em._store(self.out, " & (xindex < held)")
        return [kept if line == plain else line for line in row_body]

    def partial_stores(self, cols, sum_of) -> list[str]:
        """Each column sum's partial row stored in the program's reserved span of the host output."""
        lines = [f"hosted = out_ptr{self.out}.to(tl.pointer_type({TL_DTYPE[self.acc]}), bitcast=True)"
                 f" + held // XBLOCK * {self.span}"]
        lines += [f"tl.store(hosted + ({k} * rnumel + rindex), {sum_of(n)}[None, :], rmask)" for k, n in enumerate(cols)]
        return lines

    def combine_address(self, k: int) -> str:
        """Where the combine kernel finds program `gindex`'s partials of column sum k."""
        return (f"out_ptr{self.out}.to(tl.pointer_type({TL_DTYPE[self.acc]}), bitcast=True) + "
                f"((tl.minimum((gindex + 1) * {self.steps}, {self.blocks}) - {self.reserve}) * {self.span}"
                f" + {k} * rnumel + rindex)")

    def fixup(self, em, prelude: list[str], row_body: list[str], rows: Kernel) -> Kernel:
        """The kernel that stores the host output on the reserved blocks, after the combine kernel."""
        others = {em._store(j) for j, (o, _) in enumerate(em.outs) if j != self.out}
        body = [line for line in row_body if not line.startswith("colacc_") and line not in others]
        first = (f"xoffset = (tl.minimum((tl.program_id(0) // {self.reserve} + 1) * XSTEPS, {self.blocks})"
                 f" - {self.reserve} + tl.program_id(0) % {self.reserve}) * XBLOCK")
        name = f"{em.name}_fixup"
        kind = f"persistent, the {self.reserve} reserved row block(s) per program of the row kernel"
        source = em._function(name, kind, [first] + prelude[1:] + body, ["in", "out"],
                              ["xnumel", "rnumel", "XSTEPS", *[s.name for s in em.syms]], list(rows.constexprs))
        return Kernel(name, "reduction", source, em.ops, rows.grid * self.reserve, rows.int_args, rows.constexprs,
                      rows.num_warps, symbols=rows.symbols, maxnreg=rows.maxnreg, **em.io_meta())


def hosting_plan(em, cols, acc_dtype: dict, xblock: int, steps: int, programs: int) -> Hosting | None:
    """Where the partials of this row kernel can live inside one of its row outputs (the module
    docstring's conditions), or None: the kernel keeps its workspace."""
    accs = {acc_dtype[n] for n in cols}
    if len(accs) != 1 or is_symbolic(em.xnumel) or is_symbolic(em.rnumel) or em.xnumel % xblock:
        return None
    acc = accs.pop()
    nd, nr = len(em.S), len(em.D)
    if tuple(em.D) != tuple(range(nd - nr, nd)):
        return None  # the reduced dims are not the innermost: a row block is not one span
    blocks = em.xnumel // xblock
    last = blocks - (programs - 1) * steps  # the last program's blocks
    row_major = tuple(row_major_strides(em.S))
    for j, (o, st) in enumerate(em.outs):
        if o in em.column_values or not em.is_row.get(o) or tuple(st) != row_major:
            continue
        size, asize = o.meta["val"].element_size(), acc.itemsize
        if (em.rnumel * size) % asize:
            continue  # a span would not start on a partial's alignment
        reserve = -(-len(cols) * asize // (xblock * size))
        if em.xnumel * em.rnumel * size // asize >= 2**31:
            return None  # the combine kernel's int32 offsets would overflow
        if reserve <= last and reserve < steps:
            return Hosting(j, reserve, steps, blocks, xblock * em.rnumel * size // asize, acc)
    return None
