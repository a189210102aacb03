"""Column sums as an epilogue of a persistent row kernel: the weight and bias gradients of LayerNorm and
RMSNorm backward computed while the row kernel has the rows in registers.

passes/fuse_reductions.py puts a sum over every kept dim of the group's shape (`sum(dy * xhat, 0)`)
into the row group that computes its input and marks it (analysis/reductions.COLUMN_SUM). Two kernels:

- the row kernel walks XSTEPS blocks of XBLOCK rows per program (instead of one block), does the
  row work for each, and adds every column sum's input into an fp32 [XBLOCK, RBLOCK] accumulator;
  at the end it stores that program's partial sums, one row of a [programs, M] workspace;
- the combine kernel (one program per RBLOCK columns) adds the programs' partials in a fixed order
  (deterministic, no atomics) and stores the column sums in their output dtype.

So the [N, M] product is neither written nor read back: the backward reads x and dy once, writes dx
once, and touches only programs x M partials besides (COLUMN_PROGRAMS keeps that a few percent).
With a symbolic row count the row kernel always runs COLUMN_PROGRAMS programs and XSTEPS is computed
per call; with a symbolic row length (the fuser takes it when the example's row fits in registers) the
block sizes are computed per call too, the whole row in one block whatever its length.
"""
from __future__ import annotations

import torch.fx as fx

from ..analysis.reductions import COLUMN_SUM
from ..analysis.symbolic import is_symbolic, pexpr, strides, sizes
from .dtypes import TL_DTYPE, compute_dtype
from .indexing import index_symbols, print_index
from .kernel import Kernel
from .partials_in_output import hosting_plan
from .reduction_schedules import EVEN_PER_CALL, even_source, mask_line, per_call_xblock, persistent_per_call

COLUMN_PROGRAMS = 264  # row-kernel programs to aim for: 2 per SM on an H100/H200-class GPU
# Registers per SM on H100/H200-class GPUs: the row kernel is capped at REGISTERS // (2 programs x threads)
# per thread so two programs share an SM, as COLUMN_PROGRAMS assumes. Without the cap triton 3.6 gave
# the dynamic-shape LayerNorm backward 88 registers at 16 warps (64 static): one program per SM, 264
# programs in two waves, 1.24x the static time.
SM_REGISTERS = 65536
COMBINE_RBLOCK, COMBINE_GBLOCK = 64, 64  # columns per combine program, partial rows per step
# Software pipelining of the row loop: with more than one stage Triton copies the next rows' loads into
# shared memory (cp.async) while this row is computed, instead of each row waiting for its own loads
# (the row kernels are latency-bound: each program walks its rows one after another). 1: no pipelining.
# benchmarks/tune_reduction.py measures the choices ("col" candidates with a stage count).
COLUMN_STAGES = 3


def column_sums(nodes) -> list[fx.Node]:
    """The group's column sums: its reductions marked so (a placeholder carrying the mark is the value of
    another kernel's column sum, copied with the node's meta: read here like any input)."""
    return [n for n in nodes if n.op == "call_function" and n.meta.get(COLUMN_SUM)]


def column_ops(nodes, sums: list[fx.Node]) -> list[fx.Node]:
    """Ops of column sums alone (their casts): the combine kernel runs them after the sums."""
    values, ops = set(sums), []
    for n in nodes:
        if n.op == "call_function" and n not in values and n.all_input_nodes \
                and all(a in values for a in n.all_input_nodes):
            values.add(n)
            ops.append(n)
    return ops


def column_config(xblock: int, warps: int, rblock: int) -> tuple[int, int, int]:
    """(XBLOCK, num_warps, programs wanted), from the row kernel's own XBLOCK and warps: each program
    walks many rows one after another, so more warps per row hide the loads' latency: one warp per
    512 elements of the block, up to 16. On an H200 (bf16, 16384 x 4096, benchmarks/results/
    2026-12-02-h200-d.md) 8 warps on 264 programs ran LayerNorm backward at 73.4-73.8% of copy bandwidth
    against 70.9-72.1% with 16 warps and 66% with 4 warps on 512 programs; RMSNorm backward 78.2-78.4%
    with 8 or 16."""
    return xblock, max(warps, min(16, xblock * rblock // 512)), COLUMN_PROGRAMS


def column_strides(em, out: fx.Node) -> tuple:
    """A column sum's strides over the group's full shape S: 0 along the rows, its own along the row's dims."""
    st = strides(out.meta["val"])
    if len(sizes(out.meta["val"])) == len(em.S):  # keepdim
        return tuple(0 if d in em.xdims else st[d] for d in range(len(em.S)))
    it = iter(st)
    return tuple(0 if d in em.xdims else next(it) for d in range(len(em.S)))


def invariant_loads(em) -> list[int]:
    """Loads whose address has no row index (the weight a column operand casts, `w` of `w.float()`):
    the same values at every step of the row loop, so they are loaded once before it, not per row
    (one vector load per element fewer per row, and nothing for the loop's pipeline to stage)."""
    return [i for i in range(len(em.loads)) if not index_symbols(em.xaddr[i])]


def accumulate_line(em, n: fx.Node) -> str:
    block, acc, _ = em._reduced_value(n)  # masked [XBLOCK, RBLOCK] block of the summed value
    if n not in em.counted:
        em.ops.append("aten.sum.dim_IntList (columns)")
        em.counted.add(n)
    return f"colacc_{n.name} = colacc_{n.name} + {block}"


def with_column_sums(em, prelude: list[str], xblock: int, rblock: int, warps: int, wide: bool) -> Kernel:
    """The (row kernel, combine kernel) pair for a persistent group `em` (a ReductionEmitter) with
    column sums; the row kernel is the combine kernel's prologue, as split reductions do."""
    cols = em.columns
    setup: list[str] = []
    if is_symbolic(em.rnumel):  # block sizes per call, from the row's length
        xblock, rblock, warps, setup = _per_call_blocks(em)
        programs_wanted = COLUMN_PROGRAMS
    else:
        xblock, warps, programs_wanted = em._column_config(xblock, warps)
    acc_dtype = {n: compute_dtype(n.meta["val"].dtype) for n in cols}
    hosting = None
    if is_symbolic(em.xnumel) or setup:  # a fixed number of programs, the steps per call
        programs, steps, ragged = programs_wanted, f"cdiv(cdiv({pexpr(em.xnumel)}, {xblock}), {programs_wanted})", True
        rows_per_program = f"XSTEPS x {xblock if isinstance(xblock, int) else 'XBLOCK (per call)'}"
    else:
        blocks = -(-em.xnumel // xblock)
        steps = max(1, -(-blocks // programs_wanted))
        programs = -(-blocks // steps)
        ragged = bool(blocks % steps or em.xnumel % xblock)
        rows_per_program = str(steps * xblock)
        workspace = programs * em.rnumel * sum(acc_dtype[n].itemsize for n in cols)
        if em.headroom is None or workspace > em.headroom:  # a workspace would raise the graph's peak
            hosting = hosting_plan(em, cols, acc_dtype, xblock, steps, programs)
    if ragged:  # the last program runs past the rows: keep the bounds test
        prelude = [(mask_line("x", False) if line.startswith("xmask =") else line) for line in prelude]
    first = "(tl.program_id(0).to(tl.int64) * XSTEPS + xstep) * XBLOCK" if wide else \
        "(tl.program_id(0) * XSTEPS + xstep) * XBLOCK"
    body = [f"colacc_{n.name} = tl.zeros([XBLOCK, RBLOCK], {TL_DTYPE[acc_dtype[n]]})" for n in cols]
    body += [hosting.keep_line(wide)] if hosting else []
    hoisted = [] if setup else invariant_loads(em)
    if hoisted:
        body += ["# -- loads the same for every row (column operands), once per program ----", *em._row_index()]
        body += [em._load(i) for i in hoisted]
    body.append("for xstep in range(0, XSTEPS):" if COLUMN_STAGES <= 1 else
                f"for xstep in tl.range(0, XSTEPS, num_stages={COLUMN_STAGES}):")
    row_body = persistent_per_call(em) if setup else em._persistent(hoisted)
    body += ["    " + line for line in [f"xoffset = {first}"] + prelude[1:]
             + (hosting.rows_body(em, row_body) if hosting else row_body)]
    body += ["# -- this program's column partials ----", "rindex = tl.arange(0, RBLOCK)[None, :]",
             "rmask = rindex < rnumel"]
    if hosting:
        body += hosting.partial_stores(cols, lambda n: f"tl.sum(colacc_{n.name}, 0)")
    for k, n in enumerate([] if hosting else cols):
        body.append(f"tl.store(ws_ptr{k} + (tl.program_id(0) * rnumel + rindex), "
                    f"tl.sum(colacc_{n.name}, 0)[None, :], rmask)")
    workspaces = [] if hosting else [((programs, em.rnumel), acc_dtype[n]) for n in cols]
    kind = f"persistent, {len(cols)} column sum(s) over {rows_per_program} rows per program"
    if hosting:
        kind += (f"; partials in out{hosting.out}'s last {hosting.reserve} row block(s) per program, "
                 "those blocks stored by a fix-up kernel after the combine")
    # size symbols: a static row can still read a SymInt input as a value (compiled autograd passes
    # mean's element count as one), so both kernels take them like every other kernel
    syms, symbols = [s.name for s in em.syms], em._examples(em.syms)
    consts = {"XBLOCK": xblock, "RBLOCK": rblock, **({EVEN_PER_CALL: even_source(em, rblock)} if setup else {})}
    rows = Kernel(f"{em.name}_rows", "reduction",
                  em._function(f"{em.name}_rows", kind, body, ["in", "ws", "out"],
                               ["xnumel", "rnumel", "XSTEPS", *syms], list(consts), len(workspaces)),
                  em.ops, programs, [em.xnumel, em.rnumel, steps, *em.syms], consts,
                  warps, workspaces=workspaces, symbols=symbols, maxnreg=register_cap(warps), **em.io_meta())
    combine = em._size_input_lines() + _combine_body(em, cols, acc_dtype, hosting)
    combine_grid = f"cdiv({pexpr(em.rnumel)}, {COMBINE_RBLOCK})" if is_symbolic(em.rnumel) else \
        -(-em.rnumel // COMBINE_RBLOCK)
    return Kernel(em.name, "reduction",
                  em._function(em.name, "column partials (combine)", combine, ["in", "ws", "out"],
                               ["rnumel", "NPROG", *syms], ["RBLOCK", "GBLOCK"], len(workspaces)),
                  em.ops, combine_grid, [em.rnumel, programs, *em.syms],
                  {"RBLOCK": COMBINE_RBLOCK, "GBLOCK": COMBINE_GBLOCK}, 4, notes={"reduction": kind},
                  workspaces=workspaces, prologue=rows, symbols=symbols, setup=setup,
                  epilogue=hosting.fixup(em, prelude, em._persistent(), rows) if hosting else None, **em.io_meta())


def register_cap(warps: int | str) -> int | str | None:
    """maxnreg that lets two row-kernel programs of `warps` warps share an SM (None: no cap needed,
    past the 255 registers a thread can have); per-call source for per-call warps."""
    if isinstance(warps, str):
        return f"min(255, {SM_REGISTERS} // (2 * 32 * ({warps})))"
    cap = SM_REGISTERS // (2 * 32 * warps)
    return cap if cap < 255 else None


def _per_call_blocks(em) -> tuple[str, str, str, list[str]]:
    """(XBLOCK, RBLOCK, num_warps, wrapper lines) of a row kernel with column sums over a symbolic row
    length: the whole row in one block (whatever its length, up to Triton's largest block), XBLOCK and
    warps as the static rules pick them (column_config over _config's persistent choice)."""
    r, x, w = f"{em.name}_RBLOCK", f"{em.name}_XBLOCK", f"{em.name}_WARPS"
    return x, r, w, [f"{r} = whole_row_block({pexpr(em.rnumel)}, '{em.name}')",
                     per_call_xblock(em, x, r),
                     f"{w} = max(2, min(16, {x} * {r} // 256))"]


def _combine_body(em, cols: list[fx.Node], acc_dtype: dict, hosting) -> list[str]:
    lines = ["rindex = tl.program_id(0) * RBLOCK + tl.arange(0, RBLOCK)[None, :]", "rmask = rindex < rnumel",
             *em.rcoords]
    for k, n in enumerate(cols):
        lines += [f"part_{n.name} = tl.zeros([GBLOCK, RBLOCK], {TL_DTYPE[acc_dtype[n]]})",
                  "for g0 in range(0, NPROG, GBLOCK):",
                  "    gindex = g0 + tl.arange(0, GBLOCK)[:, None]",
                  f"    part_{n.name} += tl.load("
                  f"{hosting.combine_address(k) if hosting else f'ws_ptr{k} + (gindex * rnumel + rindex)'}, "
                  "(gindex < NPROG) & rmask, other=0)",
                  f"{n.name} = tl.sum(part_{n.name}, 0)[None, :]  # {n.name}: the programs' partials added"]
        em.vdtype[n] = acc_dtype[n]
    lines += [em._node(n) for n in em.column_ops]
    for j, (o, _) in enumerate(em.outs):
        if o in em.column_values:
            raddr = em.raddr[len(em.loads) + j]
            # (a width-1 row has no rindex in its address; the pointer block must take the [1, RBLOCK] value)
            addr = print_index(raddr) + ("" if index_symbols(raddr) else " + 0 * rindex")
            lines.append(f"tl.store(out_ptr{j} + ({addr}), {o.name}.to({TL_DTYPE[o.meta['val'].dtype]}), rmask)")
    return lines
