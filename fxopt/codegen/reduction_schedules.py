"""Looped schedules of a reduction kernel: passes over long rows, and the split (two-kernel) form.

Looped: one pass over the row per reduction level; row outputs are stored in the earliest pass that
has what they need. Split: when there are too few rows to fill the GPU (column sums of a weight
gradient, a loss over a whole tensor, softmax over few very long rows), every row is cut into chunks:
kernel 1 reduces each chunk into a small fp32 workspace, kernel 2 combines the chunks' partials and,
still one program per (rows, chunk), computes what follows and stores it. Split needs every reduction
to finish in the first pass (an online softmax pair counts as one), so the partials are final values.
"""
from __future__ import annotations

import re

import torch
import torch.fx as fx

from ..analysis.op_classes import is_view
from ..analysis.reductions import reduction_info
from ..analysis.symbolic import is_symbolic, pexpr
from .dtypes import TL_DTYPE, compute_dtype
from .kernel import Kernel
from .online_softmax import eager_sum, find_online_pairs, online_finish, online_init, online_update
from .triton_pointwise import view_root


def inner_view(n: fx.Node) -> bool:
    """A view of a value computed inside the group (a row scalar squeezed, unsqueezed or expanded
    along its row)."""
    return is_view(n) and view_root(n).op != "placeholder"


def lane_reduce(kind: str, expr: str, target: str, floating: bool = True) -> str:
    """Reduce a [XBLOCK, N] block over axis 1 to [XBLOCK, 1].

    max/min propagate NaN as torch does: on the GPU through a combine function (_fx_max); in the
    Triton interpreter through an explicit NaN test, because calling a @triton.jit combine function there leaves
    triton.language patched for the rest of the process (triton 3.6-3.9), breaking later GPU compiles.
    An integer block (`floating` False) has no NaN, and the test's float NaN would turn its max into fp32."""
    if kind in ("amax", "amin"):
        if target == "interpret" and floating:  # tl.max skips NaN there: put it back
            plain = f"tl.{'max' if kind == 'amax' else 'min'}({expr}, 1)[:, None]"
            return f"tl.where(tl.max(({expr} != {expr}).to(tl.int32), 1)[:, None] > 0, float('nan'), {plain})"
        return f"tl.reduce({expr}, 1, {'_fx_max' if kind == 'amax' else '_fx_min'})[:, None]"
    return f"tl.sum({expr}, 1)[:, None]"


def floating(node: fx.Node) -> bool:
    """The reduction's result is a floating-point value (NaN can occur in it)."""
    return node.meta["val"].dtype.is_floating_point


EVEN_PER_CALL = "EVEN_R"  # exact_r of a symbolic row in one block: a constexpr the wrapper sets per call


def mask_line(axis: str, exact) -> str:
    """`xmask`/`rmask`: the bounds test, or a constant true block where the block divides the extent
    (Triton folds it away: no compare and select per element); for a symbolic row held in one block,
    either one, picked at compile time of each variant by the constexpr EVEN_R (the row is a power of two)."""
    if exact == EVEN_PER_CALL:
        return f"rmask = tl.full([1, RBLOCK], 1, tl.int1) if {EVEN_PER_CALL} else rindex < rnumel"
    if exact:
        return f"{axis}mask = tl.full({'[XBLOCK, 1]' if axis == 'x' else '[1, RBLOCK]'}, 1, tl.int1)  # no tail"
    return f"{axis}mask = {axis}index < {axis}numel"


def persistent_per_call(em) -> list[str]:
    """The persistent body of a symbolic row held in one block: no bounds test where the call's row
    fills the block (EVEN_R, set per call), as a static row that divides its block has none."""
    saved, em.exact_r = em.exact_r, EVEN_PER_CALL
    try:
        return em._persistent()
    finally:
        em.exact_r = saved


def even_source(em, rblock: str) -> str:
    """EVEN_R as wrapper source: the call's row fills its block."""
    return f"{rblock} == {pexpr(em.rnumel)}"


def per_call_xblock(em, x: str, r: str) -> str:
    """Wrapper line: XBLOCK rows of a per-call RBLOCK filling ~2048 lanes (the static rule, per call)."""
    return f"{x} = max(1, min(next_power_of_2({pexpr(em.xnumel)}), 2048 // {r}))"


SPLIT_GUARD = " & first_chunk"  # only chunk 0 stores row scalars in split kernels
# NaN-propagating max/min for tl.reduce (tl.max/tl.min drop NaN), put in front of kernels that use them
COMBINE = '''
@triton.jit
def _fx_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _fx_min(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)
'''


def pass_marker(names: set[str]) -> str:
    """What a row value's name gets before the pass number in a looped kernel (`div` -> `div_p1`): a marker
    no existing name ends with (followed by digits), so `name + marker + pass` is never another variable's
    name (`div_1` + pass 1 of `div` clashed: a wrong gradient, found by a robustness sweep)."""
    marker = "_p"
    while any(re.search(re.escape(marker) + r"\d+$", n) for n in names):
        marker = "_" + marker
    return marker


class LoopedSchedule:
    def __init__(self, em):
        self.em = em
        self.pairs = find_online_pairs(em.reductions)
        self.paired_max = set(self.pairs.values())
        self.ready, self.need = self._levels()
        self.passes = max([self.ready[r] for r in em.reductions] +
                          [self.need[o] for o, _ in em.outs if em.is_row.get(o)])
        self.emitted: set = set()
        self.stored: set = set()
        self.strided = False  # set by strided_rows: passes alternate direction, loads carry L2 hints
        self.marker = pass_marker({n.name for n in em.nodes} | {v for d in em.load_names.values() for v in d.values()})

    def _levels(self):
        em, ready, need = self.em, {}, {}
        for n in em.nodes:
            if n.op == "placeholder" or (is_view(n) and not inner_view(n)):
                ready[n] = need[n] = 0
                if em.is_row.get(n) and any(o is n for o, _ in em.outs):  # returned over the row: in pass 1
                    need[n] = 1
            elif n.op == "call_function":
                level = max([need[a] if em.is_row.get(a) or a in em.row_leaves else ready[a]
                             for a in n.all_input_nodes] or [0])
                if n in self.pairs:  # online softmax: the sum finishes in the same pass as its max
                    need[n], ready[n] = need[self.pairs[n]], ready[self.pairs[n]]
                elif reduction_info(n) is not None:
                    need[n], ready[n] = level, level + 1
                else:
                    need[n] = level
                    if not em.is_row[n]:
                        ready[n] = level
        return ready, need

    @property
    def splittable(self) -> bool:
        """Every reduction finishes in the first pass, and no row output waits for a later pass: a
        later pass re-reads the row from memory, which costs more than the parallelism gains (softmax
        over a few long rows stays looped, reading the row twice, the second time mostly from L2)."""
        em = self.em
        return all(self.ready[r] == 1 for r in em.reductions) and \
            all(self.need[o] == 0 for o, _ in em.outs if em.is_row.get(o))

    # -- pieces ----
    def _scalar_leaves(self) -> list[str]:
        em = self.em
        em.suffix = ""
        return ["# -- row scalars read from memory ----"] + \
            [em._load(i) for i, ld in enumerate(em.loads) if ld[0] not in em.row_leaves]

    def _scalars_until(self, p: int, guard: str = "") -> list[str]:
        """Row scalars computable before pass p, then the stores of those that are outputs."""
        em, lines = self.em, []
        for n in em.nodes:
            if n.op == "call_function" and (not is_view(n) or inner_view(n)) and n not in self.emitted \
                    and not em.is_row.get(n) \
                    and reduction_info(n) is None and self.ready.get(n, 0) <= p:
                em.suffix = ""
                lines.append(em._node(n))
                self.emitted.add(n)
        for j, (o, _) in enumerate(em.outs):
            if not em.is_row.get(o) and o in self.emitted and j not in self.stored:
                lines.append(em._store(j, guard))
                self.stored.add(j)
        return lines

    def _pass(self, p: int, chunked: bool) -> tuple[list[str], list]:
        """Lines of pass p (accumulator set-up and the loop), and the reductions it finishes."""
        em = self.em
        reds = [r for r in em.reductions if self.need[r] == p]
        stores = [j for j, (o, _) in enumerate(em.outs) if em.is_row.get(o) and self.need[o] == p]
        if not reds and not stores:
            return [], []
        em.suffix = f"{self.marker}{p}"
        body = [f"# -- pass {p} over the row{' chunk' if chunked else ''} ----"]
        for r in reds:
            if r in self.pairs:
                body += online_init(r, self.pairs[r])
            elif r not in self.paired_max:
                acc = compute_dtype(r.meta["val"].dtype)
                kind = reduction_info(r).kind
                init = {"amax": 'float("-inf")', "amin": 'float("inf")'}.get(kind, "0")
                if not acc.is_floating_point and kind in ("amax", "amin"):
                    init = str(torch.iinfo(acc).min if kind == "amax" else torch.iinfo(acc).max)
                body.append(f"acc_{r.name} = tl.full([XBLOCK, RBLOCK], {init}, {TL_DTYPE[acc]})")
        start = "rstart + roffset" if chunked else "roffset"
        backwards = self.strided and p % 2 == 1
        # a strided kernel re-reads rows it read moments ago: keep them in L2 until the last pass
        em.load_policy = ("evict_first" if p == self.passes else "evict_last") if self.strided else None
        em.store_hint = self.strided
        loop = ["roffset = (rnumel - 1) // RBLOCK * RBLOCK - rstep"] if backwards else []
        loop += [rindex_line(f"{start} + tl.arange(0, RBLOCK)[None, :]", em.wide),
                 mask_line("r", em.exact_r and not chunked),
                 *em.rcoords]
        wanted = row_ancestors(em, [r.args[0] for r in reds if r not in self.pairs] +
                                   [em.outs[j][0] for j in stores])
        loop += [em._load(i) for i, ld in enumerate(em.loads) if ld[0] in wanted and ld[0] in em.row_leaves]
        loop += [em._node(n) for n in em.nodes
                 if n in wanted and n.op == "call_function" and (not is_view(n) or inner_view(n)) and em.is_row.get(n)]
        for r in reds:
            if r in self.pairs:
                em.current_mapping = "full"
                loop += online_update(r, self.pairs[r], em._var(self.pairs[r].args[0]), em._exp_of(r), em.target)
            elif r not in self.paired_max:
                block, acc, kind = em._reduced_value(r)
                if kind in ("amax", "amin"):
                    fn = "tl.maximum" if kind == "amax" else "tl.minimum"
                    loop.append(f"acc_{r.name} = {fn}(acc_{r.name}, {block}, propagate_nan=tl.PropagateNan.ALL)")
                else:
                    loop.append(f"acc_{r.name} = acc_{r.name} + {block}")
        loop += [em._store(j) for j in stores]
        if backwards:  # the blocks read last in the pass before come first: they are the likeliest in L2
            body.append("for rstep in range(0, rnumel, RBLOCK):")
        else:
            body.append(f"for roffset in range(0, {'RCHUNK' if chunked else 'rnumel'}, RBLOCK):")
        body += ["    " + line for line in loop]
        em.suffix, em.load_policy, em.store_hint = "", None, False
        return body, reds

    def _lane_results(self, reds, final: bool = True) -> list[tuple[fx.Node, str, str]]:
        """(node, expression over the accumulators' lanes, kind) for each reduction a pass finished;
        `final`: the row's results, not a split row's chunk partials."""
        out = []
        for r in reds:
            if r in self.pairs:
                mx, total = online_finish(r, self.pairs[r], self.em._exp_of(r),
                                          lane_reduce("amax", f"acc_{self.pairs[r].name}", self.em.target), final)
                out += [(self.pairs[r], mx, "amax"), (r, total, "sum")]
            elif r not in self.paired_max:
                kind = reduction_info(r).kind
                out.append((r, lane_reduce(kind, f"acc_{r.name}", self.em.target, floating(r)), kind))
        return out

    # -- schedules ----
    def lines(self) -> list[str]:
        em = self.em
        body = self._scalar_leaves()
        for p in range(self.passes + 1):
            body += self._scalars_until(p)
            lines, reds = self._pass(p, chunked=False)
            body += lines
            for node, expr, kind in self._lane_results(reds):
                body.append(em._finish(node, expr, kind))
                self.emitted.add(node)
        return body + self._scalars_until(self.passes + 1)

    def split_lines(self) -> tuple[list[str], list[str], list[fx.Node]]:
        """(partial kernel body, final kernel body, reductions whose partials go through workspaces)."""
        em = self.em
        chunk = [f"rstart = tl.program_id(1){'.to(tl.int64)' if em.wide else ''} * RCHUNK",
                 "first_chunk = (xindex * 0 + tl.program_id(1)) == 0"]
        partial = chunk + self._scalar_leaves() + self._scalars_until(0, SPLIT_GUARD)
        lines, reds = self._pass(0, chunked=True)
        partial += lines + ["# -- this chunk's partial results ----"]
        results = self._lane_results(reds, final=False)
        for k, (node, expr, kind) in enumerate(results):
            partial.append(f"{node.name} = {expr}")
            partial.append(f"tl.store(ws_ptr{k} + (tl.program_id(1) * xnumel + xindex), {node.name}, xmask)")
        final = chunk + self._scalar_leaves()
        self.emitted = set()  # the second kernel recomputes the row scalars it needs (stores stay done)
        final += ["# -- combine the chunks' partials ----", "cindex = tl.arange(0, CBLOCK)[None, :]",
                  "cmask = cindex < NCHUNK"]
        partial_of = {}
        for k, (node, expr, kind) in enumerate(results):
            ident = {"amax": 'float("-inf")', "amin": 'float("inf")'}.get(kind, "0")
            var = f"part_{node.name}"
            partial_of[node] = var
            final.append(f"{var} = tl.load(ws_ptr{k} + (cindex * xnumel + xindex), xmask & cmask, other={ident})")
        for node, expr, kind in results:
            final.append(em._finish(node, self._combine(node, kind, partial_of), kind))
        self.emitted |= {node for node, _, _ in results}
        for p in range(1, self.passes + 1):
            final += self._scalars_until(p, SPLIT_GUARD)
            final += self._pass(p, chunked=True)[0]
        final += self._scalars_until(self.passes + 1, SPLIT_GUARD)
        return partial, final, [node for node, _, _ in results]

    def _combine(self, node: fx.Node, kind: str, partial_of: dict) -> str:
        v = partial_of[node]
        if kind in ("amax", "amin"):
            return lane_reduce(kind, v, self.em.target, floating(node))
        pair_max = self.pairs.get(node)
        if pair_max is not None:  # online softmax partial sums were taken against each chunk's max
            m, pm = pair_max.name, partial_of[pair_max]
            rescaled = f"{v} * {self.em._exp_of(node)(f'{pm} - {m}')}"
            return eager_sum(f"tl.sum(tl.where({pm} == {m}, {v}, {rescaled}), 1)[:, None]", m)
        return f"tl.sum({v}, 1)[:, None]"


def split_kernel(em, schedule: LoopedSchedule, prelude: list[str], xblock: int, rblock: int, warps: int,
                 nchunk: int) -> Kernel:
    """The (partial kernel, combine kernel) pair of a split reduction: each row cut into `nchunk`
    chunks of a multiple of RBLOCK; the partial kernel is the combine kernel's prologue."""
    rchunk = -(-(-(-em.rnumel // nchunk)) // rblock) * rblock  # ceil to a multiple of RBLOCK
    nchunk = -(-em.rnumel // rchunk)
    partial, final, results = schedule.split_lines()
    n_ws = len(results)
    grid = ((em.xnumel + xblock - 1) // xblock, nchunk)
    consts = {"XBLOCK": xblock, "RBLOCK": rblock}
    workspaces = [((nchunk, em.xnumel), compute_dtype(r.meta["val"].dtype)) for r in results]
    pre = Kernel(f"{em.name}_partial", "reduction",
                 em._function(f"{em.name}_partial", "split (partials)", prelude + partial, ["in", "ws", "out"],
                              ["xnumel", "rnumel", "RCHUNK"], ["XBLOCK", "RBLOCK"], n_ws),
                 em.ops, grid, [em.xnumel, em.rnumel, rchunk], consts, warps, workspaces=workspaces, **em.io_meta())
    source = em._function(em.name, "split (combine)", prelude + final, ["in", "ws", "out"],
                          ["xnumel", "rnumel", "RCHUNK", "NCHUNK"], ["XBLOCK", "RBLOCK", "CBLOCK"], n_ws)
    return Kernel(em.name, "reduction", source, em.ops, grid, [em.xnumel, em.rnumel, rchunk, nchunk],
                  {**consts, "CBLOCK": 1 << max(0, (nchunk - 1).bit_length())}, warps,
                  notes={"reduction": f"split into {nchunk} chunks"}, workspaces=workspaces, prologue=pre,
                  **em.io_meta())


def row_ancestors(em, roots: list) -> set:
    """Row values (and the leaves they read) needed to compute `roots` inside a pass."""
    out, stack = set(), [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n in out:
            continue
        if n in em.load_names:
            out.add(n)
            continue
        if em.is_row.get(n):
            out.add(n)
            stack += n.all_input_nodes
    return out


STRIDED_CONFIG = (16384, 32)  # RBLOCK, num_warps of a strided looped kernel (one program per SM)
STRIDED_MIN_BLOCKS = 4  # rows shorter than this many blocks keep one program per row tile
STRIDED_PROGRAMS = None  # programs of a strided kernel; None: the GPU's SM count (4 in the interpreter)


def strided_config(em, tiles) -> tuple[int, int, int] | None:
    """(programs, RBLOCK, num_warps) of a looped kernel strided over its `tiles` row tiles: one program
    per SM (4 in the interpreter, so tests see programs striding); None where it keeps one program per
    tile (symbolic sizes, rows shorter than STRIDED_MIN_BLOCKS blocks, no more tiles than programs)."""
    rblock, warps = STRIDED_CONFIG
    if not isinstance(tiles, int) or is_symbolic(em.rnumel) or em.rnumel < STRIDED_MIN_BLOCKS * rblock:
        return None
    device = em.output_nodes[0].meta["val"].device
    programs = STRIDED_PROGRAMS or (torch.cuda.get_device_properties(device).multi_processor_count
                                    if device.type == "cuda" else 4)
    return (programs, rblock, warps) if tiles > programs else None


def strided_rows(schedule: LoopedSchedule, prelude: list[str], tiles: int, wide: bool) -> list[str]:
    """The looped schedule inside a loop over row tiles that each program strides through (the grid is
    one program per SM). Only that many rows are in flight, so a pass that re-reads a row finds much of
    it still in L2: it walks the row backwards from where the previous pass ended (the blocks read last
    first), rows are loaded `evict_last` until their last pass, which loads them `evict_first` and
    stores with `.cs` (streaming). Softmax over rows of 131072 on an H200: 54% of copy bandwidth
    walking forwards without hints, 62% so (benchmarks/probe_softmax_l2.py,
    benchmarks/results/2026-12-02-h200-f.md)."""
    assert prelude[0].startswith("xoffset = tl.program_id(0)"), prelude[0]
    schedule.strided = True
    start = "tl.program_id(0).to(tl.int64)" if wide else "tl.program_id(0)"
    inner = ["xoffset = xtile * XBLOCK", *prelude[1:], *schedule.lines()]
    return [f"for xtile in range({start}, {tiles}, tl.num_programs(0)):"] + ["    " + line for line in inner]


def per_call_config(em, loop_rblock: int):
    """(grid, constexprs, num_warps, wrapper lines) of a row whose length is known only per call:
    RBLOCK = the row's next power of two up to loop_rblock, XBLOCK rows filling ~2048 lanes."""
    r, x = f"{em.name}_RBLOCK", f"{em.name}_XBLOCK"
    setup = [f"{r} = min({loop_rblock}, next_power_of_2({pexpr(em.rnumel)}))", per_call_xblock(em, x, r)]
    warps = f"max(1, min(16, {x} * {r} // 256))"
    return f"cdiv({pexpr(em.xnumel)}, {x})", {"XBLOCK": x, "RBLOCK": r}, warps, setup


def rindex_line(expr: str, wide: bool) -> str:
    """`rindex = expr`, in 64 bits where the kernel's addresses need them: the row coordinates derived
    from rindex are multiplied by their strides, which wrapped in 32 bits (`4096 * r0` past 2^31)."""
    return f"rindex = ({expr}).to(tl.int64)" if wide else f"rindex = {expr}"
