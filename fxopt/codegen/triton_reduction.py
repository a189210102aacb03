"""A reduction group (reductions plus the pointwise ops around them) as one Triton kernel.

Each program owns XBLOCK rows; a row is the reduced dims (RBLOCK lanes at a time). Values are either
row values ([XBLOCK, RBLOCK], shape S of the group) or row scalars ([XBLOCK, 1], the reduced shape).

- persistent (a row fits in one block): every input is loaded once, reductions are `tl.sum`/`tl.reduce`
  over axis 1, and everything after them reuses the registers;
- looped (long rows): one pass over the row per reduction level (a reduction that needs another's
  result, like softmax's sum needing its max, waits one pass), accumulating in fp32 blocks; row
  values are recomputed from the inputs in each pass, and row outputs are stored in the earliest pass
  that has what they need.

Symbolic row length (dynamic shapes): a looped kernel and a persistent alternative are generated, and
the wrapper launches the persistent one when the call's row fits in registers; for the looped one it picks
its block sizes per call from the actual length (RBLOCK = next power of two up to 4096, XBLOCK rows
sharing ~2048 lanes), so a short row runs the loop once and a long one walks it: any length is
served, masked at the tail. A static row length with symbolic rows stays persistent when it fits.
Symbolic sizes are never split (the chunk count would depend on the call's sizes).
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from ..analysis.op_classes import is_view
from ..analysis.reductions import ROW_IN_REGISTERS, dropped_shape, kept_shape, reduction_info
from ..analysis.symbolic import expr, is_symbolic, pexpr, sizes, storage_offset, strides
from ..printing import describe_value, target_name
from .dtypes import TL_DTYPE, compute_dtype, literal
from .indexing import (IterationSpace, Layout, broadcast_strides, index_symbols, needs_int64, print_index,
                       size_symbols)
from .column_sums import (accumulate_line, column_config, column_ops, column_strides, column_sums,
                          with_column_sums)
from .erf_poly import with_erf_helper
from .joint_sums import joint_order, joint_reduce, sum_kind, with_combine_helpers
from .kernel import Kernel
from .reduction_schedules import (COMBINE, EVEN_PER_CALL, LoopedSchedule, even_source, floating, inner_view,
                                  lane_reduce, mask_line, per_call_xblock, persistent_per_call, rindex_line,
                                  split_kernel, per_call_config, strided_config, strided_rows)
from .pointwise_ops import LOWERINGS, LowerCtx
from .pointwise_launch import cdiv_source
from .triton_pointwise import PointwiseEmitter, view_root

PERSISTENT_MAX = ROW_IN_REGISTERS  # widest row (elements) kept whole in registers
LOOP_RBLOCK = 4096
SPLIT_PROGRAMS = 1024  # below this many programs, long rows are cut into chunks (two kernels)
SPLIT_MIN_BLOCKS = 4  # RBLOCK-sized steps a chunk keeps at least


def _pow2(n) -> int:
    if is_symbolic(n):
        return 1 << 30  # unknown: as large as any block; configs clamp it
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


class ReductionEmitter(PointwiseEmitter):
    headroom: int | None = None  # bytes a scratch buffer may take under the graph's peak (None: unknown)
    wide = False  # 64-bit offsets (set by generate)

    def __init__(self, gm: fx.GraphModule, name: str, target: str):
        super().__init__(gm, name, target)
        self.columns = column_sums(self.nodes)  # column epilogue (codegen/column_sums.py)
        self.column_ops = column_ops(self.nodes, self.columns)
        self.column_values = set(self.columns) | set(self.column_ops)
        self.reductions = [n for n in self.nodes if reduction_info(n) is not None and n not in self.columns]
        info = reduction_info(self.reductions[0])
        self.S, self.D = info.in_shape, info.dims
        self.keep, self.drop = kept_shape(self.S, self.D), dropped_shape(self.S, self.D)
        self.xdims = [d for d in range(len(self.S)) if d not in self.D]
        self.rnumel = info.rnumel
        self.xnumel = math.prod(self.S[d] for d in self.xdims)
        self.suffix = ""  # set per pass of a looped kernel
        self.load_policy, self.store_hint = None, False  # set per pass of a strided looped kernel
        self.counted: set = set()  # nodes already listed in `ops` (looped kernels recompute row values)
        self.is_row: dict[fx.Node, bool] = {}

    # -- spaces and layouts ----
    def _mapping(self, consumer_shape) -> str:
        return "drop" if tuple(expr(s) for s in consumer_shape) == self.drop and len(self.drop) != len(self.S) else "full"

    def _s_strides(self, val: torch.Tensor, base: torch.Tensor, mapping: str) -> tuple[tuple[int, ...], int]:
        """The value's strides over the group's full shape S, and its offset from its base pointer.

        "full": broadcast against S as torch does (right-aligned); "drop": the consumer has the reduced
        shape without the reduced dims, so broadcast against that and put stride 0 at the reduced dims."""
        offset = storage_offset(val) - storage_offset(base)
        layout = Layout(sizes(val), strides(val))
        if mapping == "drop":
            it = iter(broadcast_strides(layout, self.drop))
            return tuple(0 if d in self.D else next(it) for d in range(len(self.S))), offset
        return broadcast_strides(layout, self.S), offset

    def _out_strides(self, val: torch.Tensor) -> tuple[int, ...]:
        if sizes(val) == self.S:
            return strides(val)
        if sizes(val) == self.keep and len(self.keep) == len(self.S):
            return tuple(0 if d in self.D else s for d, s in enumerate(strides(val)))
        it = iter(strides(val))
        return tuple(0 if d in self.D else next(it) for d in range(len(self.S)))

    # -- classification ----
    def _classify(self) -> None:
        for n in self.nodes:
            if n.op == "placeholder" or n.op == "output" or (is_view(n) and not inner_view(n)):
                if n in self.output_nodes:  # an input (or a view of one) the group also returns
                    self.is_row[n] = n in self.row_leaves or (sizes(n.meta["val"]) == self.S != self.keep)
                continue
            if inner_view(n):  # row scalars reshaped, or expanded along the row (then a row value)
                self.is_row[n] = sizes(n.meta["val"]) == self.S and sizes(n.meta["val"]) != self.keep
            elif reduction_info(n) is not None:
                self.is_row[n] = False
            else:  # row values, and column operands (`w.float()`: [M] of [N, M]) varying along the row
                shape = sizes(n.meta["val"])
                # a value of the full shape is a row even when no input varies along it (an input broadcast
                # with stride 0 along the reduced dims): it is stored over the whole row, not once
                full = shape == self.S and shape != self.keep
                self.is_row[n] = full or (shape not in (self.keep, self.drop) and any(
                    self.is_row.get(a, a in self.row_leaves) for a in n.all_input_nodes))

    def _var(self, node: fx.Node) -> str:
        if node in self.load_names:
            names = self.load_names[node]
            mapping = self.current_mapping if self.current_mapping in names else next(iter(names))
            return names[mapping] + (self.suffix if (node, mapping) in self.row_loads else "")
        return node.name + (self.suffix if self.is_row.get(node) else "")

    def generate(self) -> Kernel:
        leaves = self._leaves()
        # a leaf is loaded once per mapping its consumers need
        self.load_names: dict[fx.Node, dict[str, str]] = {}
        loads = []  # (leaf, mapping, var, x_strides, r_strides, offset)
        for leaf in leaves:
            maps = sorted({"full" if reduction_info(u) else self._mapping(u.meta["val"].shape)
                           for u in leaf.users if u.op == "call_function" and not is_view(u)} or {"full"})
            self.load_names[leaf] = {}
            for m in maps:
                var = leaf.name if len(maps) == 1 else f"{leaf.name}_{m}"
                self.load_names[leaf][m] = var
                strides, offset = self._s_strides(leaf.meta["val"], view_root(leaf).meta["val"], m)
                loads.append((leaf, m, var, strides, offset))
        self.row_loads = {(leaf, m) for (leaf, m, var, st, off) in loads if any(st[d] for d in self.D)}
        self.row_leaves = {leaf for (leaf, m) in self.row_loads}
        self._classify()
        outs = [(o, column_strides(self, o) if o in self.column_values else self._out_strides(o.meta["val"]))
                for o in self.output_nodes]
        all_layouts = [(st, off) for (_, _, _, st, off) in loads] + [(st, 0) for (_, st) in outs]
        ref = next((st for st in [s for (_, _, _, s, _) in loads if any(s[d] for d in self.D)]), all_layouts[0][0])
        order = self._order_strides  # dims sorted by example strides: a heuristic, any order is correct
        xs = IterationSpace(tuple(self.S[d] for d in self.xdims), order(tuple(outs[0][1][d] for d in self.xdims)),
                            [Layout(tuple(self.S[d] for d in self.xdims), tuple(st[d] for d in self.xdims), off)
                             for st, off in all_layouts], prefix="x")
        rs = IterationSpace(tuple(self.S[d] for d in self.D), order(tuple(ref[d] for d in self.D)),
                            [Layout(tuple(self.S[d] for d in self.D), tuple(st[d] for d in self.D), 0)
                             for st, _ in all_layouts], prefix="r")
        self.xaddr = [xs.address(i) for i in range(len(all_layouts))]
        self.raddr = [rs.address(i) for i in range(len(all_layouts))]
        wide = needs_int64(self.xnumel * self.rnumel,
                           [xs.max_address(i) + rs.max_address(i) for i in range(len(all_layouts))])
        self.wide = wide  # row offsets too: `stride * r0` passes 2^31 in a tall or strided row (rindex_line)
        column = ref[self.D[-1]] != 1 and any(ref[d] == 1 for d in self.xdims)
        # never for a symbolic row; always with column sums (the fuser took them only for rows that fit)
        persistent = bool(self.columns) or _pow2(self.rnumel) <= (64 if column else PERSISTENT_MAX)
        xblock, rblock, warps = self._config(persistent, column and not self.columns)  # column sums: one row a step
        self.loads, self.outs = loads, outs
        self.syms = size_symbols(self.xnumel, self.rnumel, *self.xaddr, *self.raddr, *xs.sizes, *xs.pitches,
                                 *rs.sizes, *rs.pitches, *self._size_input_exprs())

        used_x = set().union(*(index_symbols(a) for a in self.xaddr))
        used_r = set().union(*(index_symbols(a) for a in self.raddr))
        # a block that divides its static extent needs no bounds mask: the mask is a constant that
        # Triton folds away (fewer instructions per element; the persistent rows are compute-tight)
        self.exact_r = not is_symbolic(self.rnumel) and self.rnumel % rblock == 0
        exact_x = not is_symbolic(self.xnumel) and not is_symbolic(self.rnumel) and self.xnumel % xblock == 0
        prelude = [f"xoffset = tl.program_id(0){'.to(tl.int64)' if wide else ''} * XBLOCK",
                   "xindex = xoffset + tl.arange(0, XBLOCK)[:, None]", mask_line("x", exact_x)]
        prelude += xs.coord_lines(used_x) + self._size_input_lines()
        self.ops: list[str] = []
        self.rcoords = rs.coord_lines(used_r)
        if self.columns:
            return with_column_sums(self, prelude, xblock, rblock, warps, wide)
        schedule = None if persistent else LoopedSchedule(self)
        splittable = schedule is not None and schedule.splittable and not self.syms
        nchunk = self._chunks(xblock, rblock) if splittable else 1
        if nchunk > 1:
            return split_kernel(self, schedule, prelude, xblock, rblock, warps, nchunk)
        grid, consts, setup = cdiv_source(self.xnumel, xblock), {"XBLOCK": xblock, "RBLOCK": rblock}, []
        strided = strided_config(self, grid) if schedule is not None and not self.syms else None
        if strided:
            grid, rblock, warps = strided
            self.exact_r, consts["RBLOCK"] = self.rnumel % rblock == 0, rblock
            body = strided_rows(schedule, prelude, cdiv_source(self.xnumel, xblock), wide)
        else:
            body = prelude + (self._persistent() if persistent else schedule.lines())
        kind = "persistent" if persistent else "strided looped (one program per SM)" if strided else "looped"
        ints = ["xnumel", "rnumel"] + [s.name for s in self.syms]
        source = self._function(self.name, kind, body, ["in", "out"], ints, ["XBLOCK", "RBLOCK"])
        alternative = None
        if is_symbolic(self.rnumel) and not column:
            grid, consts, warps, setup = per_call_config(self, LOOP_RBLOCK)
            alternative = self._persistent_alternative(prelude, ints)
            kind = "looped (block sizes per call), persistent when the row fits"
        kernel = self._kernel(self.name, source, grid, consts, warps, kind, setup)
        if alternative is not None:
            kernel.alternative = alternative
            kernel.alternative_when = f"next_power_of_2({pexpr(self.rnumel)}) <= {PERSISTENT_MAX}"
        return kernel

    def _kernel(self, name, source, grid, consts, warps, kind, setup) -> Kernel:
        return Kernel(name, "reduction", source, self.ops, grid=grid,
                      int_args=[self.xnumel, self.rnumel, *self.syms], constexprs=consts,
                      num_warps=warps, notes={"reduction": kind},
                      symbols=self._examples(self.syms), setup=setup, **self.io_meta())

    def io_meta(self) -> dict:
        """The Kernel fields every kernel of this group shares: output, input and pointer dtypes."""
        return dict(outputs=[o.meta["val"] for o in self.output_nodes], input_dtypes=self._input_dtypes(),
                    inputs=[p.meta["val"] for p in self.placeholders])

    def _persistent_alternative(self, prelude: list[str], ints: list[str]) -> Kernel:
        """The persistent kernel of a symbolic row, launched when the call's row fits in registers
        (next power of two <= PERSISTENT_MAX): RBLOCK is that power of two (one compiled variant per
        power met), XBLOCK and warps as _config picks them for a static row."""
        self.suffix = ""
        name = f"{self.name}_persistent"
        source = self._function(name, "persistent", prelude + persistent_per_call(self), ["in", "out"], ints,
                                ["XBLOCK", "RBLOCK", EVEN_PER_CALL])
        r, x = f"{name}_RBLOCK", f"{name}_XBLOCK"
        setup = [f"{r} = next_power_of_2({pexpr(self.rnumel)})",
                 per_call_xblock(self, x, r)]
        warps = f"max(2, min(8, {x} * {r} // 1024))"
        consts = {"XBLOCK": x, "RBLOCK": r, EVEN_PER_CALL: even_source(self, r)}
        return self._kernel(name, source, f"cdiv({pexpr(self.xnumel)}, {x})", consts,
                            warps, "persistent (row length per call)", setup)

    def _function(self, name: str, kind: str, body: list[str], pointers: list[str], ints: list[str],
                  consts: list[str], n_ws: int = 0) -> str:
        groups = {"in": [f"in_ptr{i}" for i in range(len(self.placeholders))],
                  "ws": [f"ws_ptr{k}" for k in range(n_ws)],
                  "out": [f"out_ptr{j}" for j in range(len(self.output_nodes))]}
        args = [a for g in pointers for a in groups[g]] + ints + [f"{c}: tl.constexpr" for c in consts]
        header = [f"# {kind} reduction over {describe_value(self.reductions[0].args[0].meta['val'])} dims "
                  f"{list(self.D)}: {', '.join(self.ops)}", "@triton.jit", f"def {name}({', '.join(args)}):"]
        source = with_erf_helper("\n".join(header + ["    " + line for line in body]) + "\n", self.target)
        if any("_fx_max" in line or "_fx_min" in line for line in body):
            source = COMBINE.lstrip("\n") + "\n\n" + source
        return with_combine_helpers(source, body)

    def _chunks(self, xblock: int, rblock: int) -> int:
        """How many chunks to cut each row into so that ~SPLIT_PROGRAMS programs run (1: no split)."""
        programs = (self.xnumel + xblock - 1) // xblock
        if programs >= SPLIT_PROGRAMS:
            return 1
        most = max(1, self.rnumel // (SPLIT_MIN_BLOCKS * rblock))  # every chunk keeps some blocks of work
        return max(1, min(-(-SPLIT_PROGRAMS // programs), most, 1024))

    def _config(self, persistent: bool, column: bool) -> tuple[int, int, int]:
        """(XBLOCK, RBLOCK, num_warps), from benchmarks/tune_reduction.py on an H200 (bf16):
        rows of 8192 -> 8 warps (90% of copy bandwidth), 4096 -> 4 warps; strided columns -> 16
        columns x 64 rows a step, 8 warps, which keeps ~2 waves of programs for 4096 columns."""
        if column:
            xblock = min(16, _pow2(self.xnumel))
            rblock = _pow2(self.rnumel) if persistent else 64
            return xblock, rblock, 8
        if persistent:
            rblock = _pow2(self.rnumel)
            xblock = max(1, min(_pow2(self.xnumel), 2048 // rblock))
            return xblock, rblock, max(2, min(8, xblock * rblock // 1024))
        return 1, LOOP_RBLOCK, 16

    def _column_config(self, xblock: int, warps: int) -> tuple[int, int, int]:
        """(XBLOCK, num_warps, programs wanted) of a row kernel with column sums (column_sums.
        column_config; benchmarks/tune_reduction.py replaces this method to try others)."""
        return column_config(xblock, warps, _pow2(self.rnumel))

    # -- code for loads, nodes, reductions, stores ----
    def _load(self, i: int) -> str:
        leaf, m, var, strides, off = self.loads[i]
        val = leaf.meta["val"]
        ptr = f"in_ptr{self.placeholders.index(view_root(leaf))}"
        addr = self.xaddr[i] + self.raddr[i]
        has_x, has_r = bool(index_symbols(self.xaddr[i])), bool(index_symbols(self.raddr[i]))
        mask = {(1, 1): ", xmask & rmask", (1, 0): ", xmask", (0, 1): ", rmask", (0, 0): ""}[(has_x, has_r)]
        other = ", other=0" if has_r else ""
        policy = ', eviction_policy="evict_last"' if not has_x and has_r else ""
        if has_x and has_r and self.load_policy:  # a strided looped kernel's (reduction_schedules.strided_rows)
            policy = f', eviction_policy="{self.load_policy}"'
        one = not (has_x or has_r) and self.target == "interpret"  # a block of it there (see triton_pointwise)
        pad = " + tl.zeros([XBLOCK, 1], tl.int32)" if one else ""
        load = f"tl.load({ptr} + ({print_index(addr)}){pad}{mask}{other}{policy})"
        cdt = compute_dtype(val.dtype)
        if cdt != val.dtype:
            load += f".to({TL_DTYPE[cdt]})"
        self.vdtype[leaf] = cdt
        return f"{var}{self.suffix if has_r else ''} = {load}  # {describe_value(val)}"

    def _node(self, n: fx.Node) -> str:
        if inner_view(n):  # [XBLOCK, 1] either way: the same registers under another name
            self.vdtype[n] = self.vdtype[n.args[0]]
            if self.is_row.get(n):  # expanded along the row
                return f"{self._var(n)} = tl.broadcast_to({self._var(n.args[0])}, [XBLOCK, RBLOCK])  # expand"
            return f"{n.name} = {self._var(n.args[0])}  # {target_name(n.target)}"
        self.current_mapping = self._mapping(n.meta["val"].shape)
        if n not in self.counted:
            self.ops.append(target_name(n.target))
            self.counted.add(n)
        return f"{self._var(n)} = {self._compute(n)}  # {target_name(n.target)}"

    def _reduced_value(self, n: fx.Node) -> tuple[str, torch.dtype, str]:
        """(block expression to reduce, accumulator dtype, kind) for reduction node n."""
        info = reduction_info(n)
        acc = compute_dtype(n.meta["val"].dtype)
        self.current_mapping = "full"
        src = self._operand(n.args[0], acc)
        ident = {"sum": "0", "mean": "0", "amax": literal(float("-inf") if acc.is_floating_point else
                                                             torch.iinfo(acc).min, acc),
                 "amin": literal(float("inf") if acc.is_floating_point else torch.iinfo(acc).max, acc)}[info.kind]
        block = f"tl.where(xmask & rmask, tl.broadcast_to({src}, [XBLOCK, RBLOCK]), {ident})"
        return block, acc, info.kind

    def _finish(self, n: fx.Node, reduced: str, kind: str) -> str:
        if n not in self.counted:
            self.ops.append(target_name(n.target))
            self.counted.add(n)
        self.vdtype[n] = compute_dtype(n.meta["val"].dtype)
        if kind == "mean":
            reduced = f"{reduced} / rnumel" if is_symbolic(self.rnumel) else f"{reduced} / {self.rnumel}.0"
        return f"{n.name} = {reduced}  # {target_name(n.target)}"

    def _store(self, j: int, guard: str = "") -> str:
        """Store output j; the pointer block always has the value's shape ([XBLOCK, RBLOCK] or [XBLOCK, 1])."""
        o, strides = self.outs[j]
        i = len(self.loads) + j
        row = self.is_row.get(o, False)
        addr = print_index(self.xaddr[i] + self.raddr[i]) if row else print_index(self.xaddr[i])
        if not index_symbols(self.xaddr[i]):
            addr += " + 0 * xindex"
        if row and not index_symbols(self.raddr[i]):
            addr += " + 0 * rindex"
        val = o.meta["val"]
        self.current_mapping = self._mapping(val.shape)
        mask = f"xmask & rmask{guard}" if row else f"xmask{guard}"
        hint = ', cache_modifier=".cs"' if row and self.store_hint else ""
        return f"tl.store(out_ptr{j} + ({addr}), {self._var(o)}.to({TL_DTYPE[val.dtype]}), {mask}{hint})"

    def _row_index(self) -> list[str]:
        """rindex, its mask and the row's coordinates: what a whole-row block's loads address by."""
        return [rindex_line("tl.arange(0, RBLOCK)[None, :]", self.wide), mask_line("r", self.exact_r), *self.rcoords]

    def _persistent(self, hoisted=()) -> list[str]:
        """One block of rows, whole; loads numbered in `hoisted` were issued before a row loop."""
        body = [*self._row_index(), "# -- load inputs ----"]
        body += [self._load(i) for i in range(len(self.loads)) if i not in hoisted]
        body.append("# -- compute ----")
        for n in joint_order(self.nodes, self._joinable):
            if isinstance(n, tuple):  # row sums reading none of each other: one reduce
                lines, sums = joint_reduce([s.name for s in n], [self._reduced_value(s)[0] for s in n], self.target)
                body += lines + [self._finish(s, e, sum_kind(s)) for s, e in zip(n, sums)]
                continue
            if n.op != "call_function" or (is_view(n) and not inner_view(n)):
                continue
            if n in self.columns:
                body.append(accumulate_line(self, n))
            elif n in self.column_ops:
                continue  # in the combine kernel
            elif reduction_info(n) is not None:
                block, acc, kind = self._reduced_value(n)
                body.append(self._finish(n, lane_reduce(kind, block, self.target, floating(n)), kind))
            else:
                body.append(self._node(n))
        body.append("# -- store outputs ----")
        body += [self._store(j) for j, (o, _) in enumerate(self.outs) if o not in self.column_values]
        return body

    def _joinable(self, n: fx.Node):
        """The accumulator dtype of a row sum that may be reduced with others (joint_sums), else None."""
        if n.op != "call_function" or n in self.columns or n in self.column_ops or not sum_kind(n):
            return None
        return compute_dtype(n.meta["val"].dtype)

    def _exp_of(self, s: fx.Node):
        """The exp the graph's exp node (feeding the paired sum) is lowered to, as a function."""
        e = s.args[0]
        ctx = LowerCtx(self.target, e.meta["val"].dtype, compute_dtype(e.meta["val"].dtype), self.rounds_to)
        return lambda x: LOWERINGS[e.target](ctx, e, [f"({x})"])


def generate_reduction_kernel(gm: fx.GraphModule, name: str, target: str, headroom: int | None = None) -> Kernel:
    em = ReductionEmitter(gm, name, target)
    em.headroom = headroom
    kernel = em.generate()
    unstored = [j for j in range(len(em.output_nodes)) if f"tl.store(out_ptr{j} " not in kernel.full_source()]
    if unstored:  # an output no schedule writes would hand its reader uninitialised memory
        raise NotImplementedError(f"fxopt: reduction kernel {name} never stores output(s) "
                                  f"{[em.output_nodes[j].name for j in unstored]}")
    return kernel
