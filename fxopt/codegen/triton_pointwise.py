"""A fused pointwise group (an fx subgraph) as one Triton kernel, written as readable source.

    @triton.jit
    def fused_mul_add_gelu_0(in_ptr0, in_ptr1, out_ptr0, xnumel, XBLOCK: tl.constexpr):
        xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
        xmask = xindex < xnumel
        x1 = xindex % 4096
        # -- load inputs ----
        arg0 = tl.load(in_ptr0 + xindex, xmask).to(tl.float32)  # bf16[8192, 4096] cuda
        arg1 = tl.load(in_ptr1 + x1, xmask, eviction_policy="evict_last").to(tl.float32)  # bf16[4096]
        # -- compute ----
        mul = arg0 * arg1  # aten.mul.Tensor
        ...
        # -- store outputs ----
        tl.store(out_ptr0 + xindex, gelu.to(tl.bfloat16), xmask)

Views and expands at the group's inputs (moved into the subgraph by the fuse pass) become strides of
the load; values are computed in fp32 for bf16/fp16, rounded where stored, where eager casts to bf16/fp16,
and where an op reads them as eager holds them (codegen/operand_rounding.py).

When an operand is contiguous along an outer dim while the output is contiguous along the innermost
one (`x.t() * 2 + y`), the kernel is tiled instead (plan_tiles): program axis 0 walks YBLOCK rows of
the flattened outer dims, axis 1 XBLOCK columns of the innermost dim, and Triton coalesces each load
along the axis its address is contiguous in:

    yindex = yoffset + tl.arange(0, YBLOCK)[:, None]
    xindex = xoffset + tl.arange(0, XBLOCK)[None, :]
    arg0 = tl.load(in_ptr0 + (xindex + 8192*yindex), ymask & xmask)  # contiguous along x
    arg1 = tl.load(in_ptr1 + (8192*xindex + yindex), ymask & xmask)  # contiguous along y

With symbolic sizes (dynamic shapes) the size symbols are kernel arguments after the numels
(`xnumel, s0, s1`), addresses are sympy over them, indexing is int64, and the wrapper computes the
grid per call (`cdiv(xnumel, XBLOCK)`); a 2-D tiling needs a static innermost dim (grid axis
1 has a limit that a symbolic one could pass).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..analysis.op_classes import is_view
from ..analysis.symbolic import expr, hint, pexpr, shape_env_of, sizes, storage_offset, strides
from ..printing import describe_value, target_name
from .dtypes import LOW_PRECISION, TL_DTYPE, cast_operand, compute_dtype, float64_operand, literal
from .cat_pieces import (cat_pieces, cat_value, coordinate_layout, coordinate_name, is_gather, piece_layout,
                         piece_mask)
from .erf_poly import with_erf_helper
from .indexing import IterationSpace, Layout, index_symbols, needs_int64, print_index, size_symbols
from .kernel import Kernel
from .operand_rounding import reads_own_dtype, rounded_operands, rounded_scalars
from .pointwise_launch import TilePlan, cdiv_source, launch_config, plan_tiles
from .pointwise_ops import LOWERINGS, UNCAST_OPERANDS, LowerCtx, operand_dtype

aten = torch.ops.aten


def layout_of(val: torch.Tensor, base: torch.Tensor | None = None) -> Layout:
    offset = storage_offset(val) - (storage_offset(base) if base is not None else 0)
    return Layout(sizes(val), strides(val), offset)


def view_root(node: fx.Node) -> fx.Node:
    while is_view(node):
        node = node.args[0]
    return node


class PointwiseEmitter:
    def __init__(self, gm: fx.GraphModule, name: str, target: str):
        self.gm, self.name, self.target = gm, name, target
        self.nodes = list(gm.graph.nodes)
        self.placeholders = [n for n in self.nodes if n.op == "placeholder"]
        self.output_nodes = list(self._outputs())
        self.domain = sizes(self.output_nodes[0].meta["val"])
        self.shape_env = shape_env_of(gm)  # None unless sizes are symbolic
        # SymInt inputs (a size used as a number, `x / s1`): computed in the kernel from the size symbols
        self.size_inputs = [p for p in self.placeholders if isinstance(p.meta.get("val"), torch.SymInt)]
        self.vdtype: dict[fx.Node, torch.dtype] = {}  # compute dtype of each value in registers
        out_dtypes = {o.meta["val"].dtype for o in self.output_nodes if isinstance(o.meta.get("val"), torch.Tensor)}
        self.rounds_to = next(iter(out_dtypes)) if out_dtypes in ({torch.bfloat16}, {torch.float16}) else None

    def _outputs(self):
        out = next(n for n in self.nodes if n.op == "output").args[0]
        return out if isinstance(out, (tuple, list)) else [out]

    def _leaves(self) -> list[fx.Node]:
        """Values read from memory: placeholders and view chains of placeholders used by compute."""
        leaves = []
        for n in self.nodes:
            if (n.op == "placeholder" and n not in self.size_inputs) or (
                    is_view(n) and view_root(n).op == "placeholder"):
                if any(u.op == "call_function" and not is_view(u) and not is_gather(u) for u in n.users) \
                        or n in self.output_nodes:  # (a cat reads its inputs itself: cat_pieces.py)
                    leaves.append(n)
        return leaves

    def generate(self) -> Kernel:
        leaves = self._leaves()
        leaf_layouts = []
        for leaf in leaves:
            root = view_root(leaf)
            leaf_layouts.append(layout_of(leaf.meta["val"], root.meta["val"]))
        # the wrapper allocates every output at offset 0 (a fresh buffer, an arena view, a dying buffer
        # reused in place), whatever storage offset the traced value had (a clone of a slice can carry it)
        out_layouts = [Layout(sizes(o.meta["val"]), strides(o.meta["val"]), 0) for o in self.output_nodes]
        ref_stride = self._order_strides(strides(self.output_nodes[0].meta["val"]))
        extra = self._cat_layouts()  # after the outputs: operand i < len(leaves) + outputs keeps its meaning
        space = IterationSpace(self.domain, ref_stride, leaf_layouts + out_layouts + extra)
        n_operands = len(leaf_layouts) + len(out_layouts) + len(extra)
        wide = needs_int64(space.numel, [space.max_address(i) for i in range(n_operands)])
        plan = plan_tiles(space)
        if plan is not None:
            return self._generate_tiled(leaves, space, plan, wide)

        addresses = [space.address(i) for i in range(n_operands)]
        used = set().union(*(a.free_symbols for a in addresses)) if addresses else set()
        body = [f"xoffset = tl.program_id(0){'.to(tl.int64)' if wide else ''} * XBLOCK",
                "xindex = xoffset + tl.arange(0, XBLOCK)", "xmask = xindex < xnumel"]
        body += space.coord_lines(used)
        body += self._pointwise_body(leaves, space, addresses, lambda syms: "xmask",
                                     lambda syms: "" if syms else " + 0 * xindex", "xmask")
        syms = size_symbols(space.numel, *addresses, *space.sizes, *space.pitches, *self._size_input_exprs())
        args = [f"in_ptr{i}" for i in range(len(self.placeholders))] + \
               [f"out_ptr{j}" for j in range(len(self.output_nodes))] + ["xnumel"] + \
               [s.name for s in syms] + ["XBLOCK: tl.constexpr"]
        xblock, warps = launch_config(space.numel)
        header = [f"# {len(self.ops)} ops over {describe_value(self.output_nodes[0].meta['val'])}: "
                  f"{', '.join(self.ops)}", "@triton.jit", f"def {self.name}({', '.join(args)}):"]
        source = with_erf_helper("\n".join(header + ["    " + line for line in body]) + "\n", self.target)
        return Kernel(self.name, "pointwise", source, self.ops, grid=cdiv_source(space.numel, xblock),
                      int_args=[space.numel, *syms], constexprs={"XBLOCK": xblock}, num_warps=warps,
                      outputs=[o.meta["val"] for o in self.output_nodes],
                      input_dtypes=self._input_dtypes(),
                      inputs=[p.meta["val"] for p in self.placeholders], symbols=self._examples(syms))

    def _generate_tiled(self, leaves: list[fx.Node], space: IterationSpace, plan: TilePlan,
                        wide: bool) -> Kernel:
        """2-D tiles: program axis 0 walks YBLOCK rows of the outer dims, axis 1 XBLOCK columns of the
        innermost dim (one axis of both when the innermost dim is symbolic); every operand is addressed by
        strides times (yindex, xindex) coordinates."""
        tiles = plan.space
        addresses = [tiles.address(i) for i in range(len(space.operand_strides))]
        used = set().union(*(a.free_symbols for a in addresses)) if addresses else set()
        to64 = ".to(tl.int64)" if wide else ""
        body: list[str] = []
        if isinstance(plan.grid, tuple):
            ytile, xtile = f"tl.program_id(0){to64}", f"tl.program_id(1){to64}"
        else:  # one grid axis: x tiles vary fastest
            body = ["xtiles = tl.cdiv(xnumel, XBLOCK)", f"tile = tl.program_id(0){to64}"]
            ytile, xtile = "(tile // xtiles)", "(tile % xtiles)"
        body += [f"yoffset = {ytile} * YBLOCK",
                 "yindex = yoffset + tl.arange(0, YBLOCK)[:, None]", "ymask = yindex < ynumel",
                 f"xoffset = {xtile} * XBLOCK",
                 "xindex = xoffset + tl.arange(0, XBLOCK)[None, :]", "xmask = xindex < xnumel"]
        body += tiles.coord_lines(used)

        def load_mask(syms):  # a load depending on one axis only is a [YBLOCK, 1] or [1, XBLOCK] block
            has_y, has_x = bool(syms & tiles.ysymbols), tiles.xindex in syms
            return "ymask & xmask" if has_y and has_x else ("ymask" if has_y else "xmask")

        def store_pad(syms):  # the pointer block must be [YBLOCK, XBLOCK] to take the mask
            return ("" if syms & tiles.ysymbols else " + 0 * yindex") + \
                ("" if tiles.xindex in syms else " + 0 * xindex")

        body += self._pointwise_body(leaves, space, addresses, load_mask, store_pad, "ymask & xmask")
        syms = size_symbols(tiles.ynumel, tiles.xnumel, *addresses, *tiles.ysizes, *tiles.ypitches,
                            *self._size_input_exprs())
        args = [f"in_ptr{i}" for i in range(len(self.placeholders))] + \
               [f"out_ptr{j}" for j in range(len(self.output_nodes))] + \
               ["ynumel", "xnumel"] + [s.name for s in syms] + ["YBLOCK: tl.constexpr", "XBLOCK: tl.constexpr"]
        header = [f"# {len(self.ops)} ops over {describe_value(self.output_nodes[0].meta['val'])}: "
                  f"{', '.join(self.ops)}",
                  f"# 2-D tiles: yindex over the outer dims {tiles.ysizes}, xindex over the innermost dim "
                  f"({tiles.xnumel});",
                  "# each operand is read along the axis it is contiguous in",
                  "@triton.jit", f"def {self.name}({', '.join(args)}):"]
        source = with_erf_helper("\n".join(header + ["    " + line for line in body]) + "\n", self.target)
        return Kernel(self.name, "pointwise", source, self.ops, grid=plan.grid,
                      int_args=[tiles.ynumel, tiles.xnumel, *syms], symbols=self._examples(syms),
                      constexprs={"YBLOCK": plan.yblock, "XBLOCK": plan.xblock}, num_warps=plan.num_warps,
                      outputs=[o.meta["val"] for o in self.output_nodes],
                      input_dtypes=self._input_dtypes(),
                      inputs=[p.meta["val"] for p in self.placeholders], notes={"tiling": "2d"})

    def _cat_layouts(self) -> list[Layout]:
        """The pieces of the group's cats over the domain, then one coordinate operand per cat dim."""
        self.pieces = cat_pieces(self.nodes)
        self.cat_dims = sorted({p.dim for p in self.pieces})
        return ([piece_layout(p, layout_of(p.source.meta["val"], view_root(p.source).meta["val"]), self.domain)
                 for p in self.pieces] + [coordinate_layout(d, self.domain) for d in self.cat_dims])

    def _cat_loads(self, addresses: list, first: int, load_mask, ptr_of) -> list[str]:
        """Each cat dim's coordinate, then each piece loaded where the lane falls in it (cat_pieces.py)."""
        coords = {d: addresses[first + len(self.pieces) + k] for k, d in enumerate(self.cat_dims)}
        lines = [f"{coordinate_name(d)} = {print_index(a)}" for d, a in coords.items()]
        for i, p in enumerate(self.pieces):
            addr = addresses[first + i]
            mask = f"{load_mask(index_symbols(addr) | index_symbols(coords[p.dim]))} & " \
                   f"{piece_mask(p, p.end == sizes(p.cat.meta['val'])[p.dim])}"
            val = p.source.meta["val"]
            ptr = f"{ptr_of[view_root(p.source)]} + ({print_index(addr)})"  # no index: one element (stride 0)
            load = f"tl.load({ptr}, {mask}, other=0)" if index_symbols(addr) else f"tl.where({mask}, tl.load({ptr}), 0)"
            cdt = compute_dtype(val.dtype)
            lines.append(f"{p.name} = {load}{f'.to({TL_DTYPE[cdt]})' if cdt != val.dtype else ''}"
                         f"  # piece {p.index} of {p.cat.name}: {describe_value(val)}")
        return lines

    def _size_input_lines(self) -> list[str]:
        """Each SymInt input as its expression over the size symbols (kernel arguments)."""
        for p in self.size_inputs:
            self.vdtype[p] = torch.int64
        return [f"{p.name} = {pexpr(expr(p.meta['val']))}  # size input" for p in self.size_inputs]

    def _size_input_exprs(self) -> list:
        return [expr(p.meta["val"]) for p in self.size_inputs]

    def _input_dtypes(self) -> list[torch.dtype]:
        return [getattr(p.meta["val"], "dtype", torch.int64) for p in self.placeholders]

    def _examples(self, syms) -> dict[str, int]:
        """Each size symbol the kernel takes -> its example value (the harness and report use them)."""
        return {s.name: hint(s, self.shape_env) for s in syms}

    def _order_strides(self, st: tuple) -> tuple:
        """Strides to sort dims by (outer -> inner): example values, a heuristic (any order is correct)."""
        return tuple(hint(s, self.shape_env) for s in st)

    def _pointwise_body(self, leaves: list[fx.Node], space: IterationSpace, addresses: list, load_mask,
                        store_pad, store_mask: str) -> list[str]:
        """Loads, compute and stores. load_mask(symbols) is the mask of a load whose address uses those
        index symbols; store_pad(symbols) is what to add to a store address so it spans the whole block."""
        ptr_of = {p: f"in_ptr{i}" for i, p in enumerate(self.placeholders)}
        body = self._size_input_lines() + ["# -- load inputs ----"]
        for i, leaf in enumerate(leaves):
            val = leaf.meta["val"]
            ptr = ptr_of[view_root(leaf)]
            addr = print_index(addresses[i])
            broadcast = any(s == 0 for s in space.operand_strides[i]) or not space.operand_strides[i]
            if not index_symbols(addresses[i]):  # one element, read by every lane
                # (the interpreter's comparisons of a 0-d value give floats that `|` and `&` refuse: a
                # block of the element there)
                load = f"tl.load({ptr} + {addr}{store_pad(set()) if self.target == 'interpret' else ''})"
            else:
                policy = ', eviction_policy="evict_last"' if broadcast else ""
                load = f"tl.load({ptr} + ({addr}), {load_mask(index_symbols(addresses[i]))}{policy})"
            cdt = compute_dtype(val.dtype)
            if cdt != val.dtype:
                load += f".to({TL_DTYPE[cdt]})"
            self.vdtype[leaf] = cdt
            body.append(f"{leaf.name} = {load}  # {describe_value(val)}")
        body += self._cat_loads(addresses, len(leaves) + len(self.output_nodes), load_mask, ptr_of)
        body.append("# -- compute ----")
        self.ops = []
        for n in self.nodes:
            if n.op != "call_function" or is_view(n):
                continue
            self.ops.append(target_name(n.target))
            if is_gather(n):
                self.vdtype[n] = compute_dtype(n.meta["val"].dtype)
                body.append(f"{n.name} = {cat_value(n, self.pieces)}  # {target_name(n.target)}")
                continue
            body.append(f"{n.name} = {self._compute(n)}  # {target_name(n.target)}")
        body.append("# -- store outputs ----")
        for j, o in enumerate(self.output_nodes):
            address = addresses[len(leaves) + j]
            addr = print_index(address) + store_pad(index_symbols(address))
            val = o.meta["val"]
            body.append(f"tl.store(out_ptr{j} + ({addr}), {o.name}.to({TL_DTYPE[val.dtype]}), {store_mask})")
        return body

    def _var(self, node: fx.Node) -> str:
        """The kernel variable holding a node's value (the reduction emitter renames some)."""
        return node.name

    def _operand(self, arg, want: torch.dtype | None, common: torch.dtype | None = None, own: bool = False) -> str:
        """`arg` as `want`; `common` (bf16/fp16 or None): the dtype eager rounds a higher-precision operand to
        first (a Python scalar, a 0-d fp32 tensor); `own`: a bf16/fp16 value held in fp32 is read rounded to
        its dtype (codegen/operand_rounding.py)."""
        if isinstance(arg, fx.Node):
            have = self.vdtype[arg]
            var = self._var(arg)
            dtype = getattr(arg.meta["val"], "dtype", have)  # (a SymInt operand has none: an int)
            if own and dtype in LOW_PRECISION and have == torch.float32:
                var = f"{var}.to({TL_DTYPE[dtype]}).to(tl.float32)"
            # (every op with a `common` dtype reads its operands `own`: one of that dtype is rounded above)
            if common is not None and dtype != torch.bool and dtype != common:
                # through float32, as eager's conversions to bf16/fp16 go (c10's Half and BFloat16 take a float;
                # the interpreter would also reinterpret an int's bits as bf16)
                via = "" if have == torch.float32 else ".to(tl.float32)"
                return f"{var}{via}.to({TL_DTYPE[common]}).to({TL_DTYPE[want]})"
            if want is None or want == have:
                return var
            if want == torch.bool:
                return f"({var} != 0)"
            return f"{var}.to({TL_DTYPE[want]})"
        if isinstance(arg, (int, float)) and not isinstance(arg, bool) and common is not None:
            arg = torch.tensor(arg, dtype=common).item()
        if isinstance(arg, (bool, int, float)) and want is not None:
            return literal(arg, want)
        if isinstance(arg, (bool, int, float)):
            return repr(arg)
        return None if arg is None else repr(arg)

    def _schema_args(self, n: fx.Node) -> list:
        """node.args, then the keyword-only arguments present in node.kwargs, in schema order."""
        values = list(n.args)
        for a in n.target._schema.arguments[len(n.args):]:
            if a.name in n.kwargs and a.kwarg_only and isinstance(n.kwargs[a.name], (int, float, bool, fx.Node)):
                values.append(n.kwargs[a.name])
            elif a.name in n.kwargs and not a.kwarg_only:
                values.append(n.kwargs[a.name])
        return values

    def _compute(self, n: fx.Node) -> str:
        out = n.meta["val"].dtype
        want = operand_dtype(n)
        args = self._schema_args(n)
        common, own, scalars = rounded_operands(n), reads_own_dtype(n), rounded_scalars(n, self.target)
        if n.target is aten.where.self:
            operands = [self._operand(args[0], torch.bool)] + [self._operand(a, want, common, own) for a in args[1:]]
        else:
            operands = [self._operand(a, want, common if isinstance(a, fx.Node) or scalars is None else scalars, own)
                        for a in args]
        if n.target in UNCAST_OPERANDS:  # eager's float64 -> bf16 goes through float32, float -> uint8 through int64
            operands[0] = cast_operand(operands[0], self.vdtype.get(args[0]), out, self.target)
        ctx = LowerCtx(self.target, out, want if want is not None else compute_dtype(out), self.rounds_to)
        if ctx.compute == torch.float64:
            operands = [float64_operand(o) if isinstance(o, str) else o for o in operands]
        expr = LOWERINGS[n.target](ctx, n, operands)
        result = compute_dtype(out)
        if n.target in UNCAST_OPERANDS and out in LOW_PRECISION and n.target is not aten.clone.default:
            expr = f"{expr}.to(tl.float32)"  # an explicit cast to bf16/fp16 rounds, as in eager
        elif result != (want if want is not None else self.vdtype[args[0]]):
            expr = f"({expr}).to({TL_DTYPE[result]})"
        if out in LOW_PRECISION and result == torch.float32 and self._read_rounded_by_all(n):
            expr = f"({expr}).to({TL_DTYPE[out]}).to(tl.float32)"
        self.vdtype[n] = result
        return expr

    def _read_rounded_by_all(self, n: fx.Node) -> bool:
        """Whether every op reading n (16-bit) must read it rounded, since one of them sees it so: the kernel
        stores n and computes with it (every kernel that loads it reads it rounded: a backward that loads a
        saved rsqrt recomputed `x * rsqrt` as another value than the forward's, and fp16 RMSNorm then amax
        found no element equal to the max, NaN gradients; graph_fuzz --mixed, 2026-12-07), or an op that
        reads its operands rounded (operand_rounding) reads n beside one that would not
        (`where(v > x, v, t) - v` was not 0 where v was selected)."""
        users = [u for u in n.users if u.op != "output"]
        return bool(users) and (n in self.output_nodes or any(reads_own_dtype(u) for u in users))


def generate_pointwise_kernel(gm: fx.GraphModule, name: str, target: str) -> Kernel:
    """Triton source for a fused pointwise subgraph. `target` is "cuda" or "interpret"."""
    return PointwiseEmitter(gm, name, target).generate()
