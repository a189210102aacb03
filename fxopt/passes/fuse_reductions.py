"""Reduction fusion: a reduction, the pointwise ops that feed it (prologue) and those that consume it or
the row it came from (epilogue) become one group, so softmax, LayerNorm and RMSNorm are one kernel.

A group is keyed by (input shape S, reduced dims D, device) and holds: reductions of that key,
pointwise ops of shape S (row values), and pointwise ops of the reduced shape (row scalars,
with or without keepdim). propose_partitions merges them without creating cycles, as for
pointwise fusion; groups without a reduction are dropped and left to the pointwise fuser.

Column sums: a sum over every kept dim of the group's shape (LayerNorm/RMSNorm backward's weight and
bias gradients, `sum(dy * xhat, 0)`) joins the row group when the row fits in registers: the row
kernel then walks many rows per program and accumulates the column sums as it goes, so the [N, M]
product is never written and read back (one pass over the data instead of three); a tiny second
kernel adds the programs' partials.

Cost rule: a node is never duplicated into two groups, so nothing is computed twice across kernels;
inside a kernel, row values are kept in registers when a row fits (persistent kernel), and are
recomputed from the loaded inputs in each pass over a long row (looped kernel): recomputing a few
arithmetic ops costs less than writing the intermediate and reading it back, which is what a
separate kernel would do.

    before                                          after
    amax = aten.amax.default(x, [-1], True)          fused_red0_0 = self.red0_0(x)  # softmax, one kernel
    sub = aten.sub.Tensor(x, amax); exp = ...
    sum_1 = aten.sum.dim_IntList(exp, [-1], True)
    div = aten.div.Tensor(exp, sum_1)
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.passes.operator_support import OperatorSupportBase

from ..analysis.op_classes import is_view, pointwise_unsupported_reason
from ..analysis.symbolic import sizes
from ..analysis.reductions import (COLUMN_SUM, dropped_shape, is_column_sum_of, kept_shape, reduces_trailing_dims,
                                   reduction_info, reduction_unsupported_reason)
from ..pass_manager import PassContext, PassResult
from .fuse import FUSED_PREFIX, absorb_input_views
from .recompute import RESERVED_FOR
from .fuse_partitions import acyclic_subset, fuse_partitions
from .propose_partitions import propose_partitions

REDUCTION_PREFIX = f"{FUSED_PREFIX}red"
_aten = torch.ops.aten
# views that keep the elements' order: a row scalar moves between its kept and dropped shapes through these
_RESHAPES = (_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default, _aten.squeeze.default,
             _aten.squeeze.dim, _aten.squeeze.dims, _aten.unsqueeze.default, _aten.alias.default)
COLUMN_CHAIN_DEPTH = 64  # ops of a column operand computed in a row kernel (_column_operand)


class _ReductionGroupSupport(OperatorSupportBase):
    def __init__(self, key, target: str):
        self.key, self.target = key, target
        shape, dims, self.device = key
        self.shapes = {shape, kept_shape(shape, dims), dropped_shape(shape, dims)}
        self._columns: dict[fx.Node, bool] = {}
        self._after_columns: set[fx.Node] | None = None

    def is_node_supported(self, submodules, node: fx.Node) -> bool:
        if self._too_far(node):
            return False
        if any(self._after_column(a) or self._column_value(a) for a in node.all_input_nodes):
            # a column sum is known only after every row: only ops of column sums alone (the casts
            # after a weight gradient) may use it, in the kernel's combine step; nothing downstream of
            # it through a view (a [1, N] column sum viewed as [N, 1] row scalars of a square [N, N])
            return self._column_value(node)
        info = reduction_info(node)
        if info is not None:
            return ((info.key == self.key or is_column_sum_of(node, self.key))
                    and reduction_unsupported_reason(node, self.target) is None)
        if node.meta.get(RESERVED_FOR, self.key) != self.key:
            return False  # a copy made for another group's reduction (passes/recompute.py)
        if is_view(node):  # squeezing/unsqueezing a row scalar between its kept and dropped shapes
            if any(u.op == "output" for u in node.users):
                return False  # a view the caller gets stays a view in the wrapper: it aliases its base (y.view, y)
            src, val = node.args[0].meta.get("val"), node.meta.get("val")
            if node.target not in _RESHAPES and node.target is not torch.ops.aten.expand.default:
                return False  # a transpose of a square [N, N] row scalar has the shape, not the order
            scalars = self.shapes - {self.key[0]}
            if not (isinstance(src, torch.Tensor) and isinstance(val, torch.Tensor) and src.dtype == val.dtype):
                return False
            if node.target is torch.ops.aten.expand.default and sizes(src) == kept_shape(*self.key[:2]) \
                    and sizes(val) == self.key[0]:
                return True  # a row scalar broadcast along its row (autograd's backward of mean)
            return (sizes(src) in scalars and sizes(val) in scalars
                    and not self._ambiguous_row_scalar(node, sizes(val)))
        val = node.meta.get("val")
        if not (isinstance(val, torch.Tensor) and str(val.device) == self.device
                and pointwise_unsupported_reason(node, self.target) is None):
            return False
        if sizes(val) not in self.shapes:
            return self._column_operand(node)
        if sizes(val) == self.key[0] and any(self._reads_ambiguously(a) for a in node.all_input_nodes):
            return False
        return not self._ambiguous_row_scalar(node, sizes(val))

    def _too_far(self, node: fx.Node) -> bool:
        """A cheap test that implies every check below refuses the node: a tensor that is no reduction
        and no view, of a shape neither among the group's nor broadcast to its rows (row values, row
        scalars, column operands and column sums all are). A graph with many reduction keys (200
        softmaxes over 200 row lengths) asked every node the full question once per key."""
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or is_view(node) or reduction_info(node) is not None:
            return False
        shape, full = sizes(val), self.key[0]
        if shape in self.shapes:
            return False
        return len(shape) > len(full) or not all(d == 1 or d == f for d, f in zip(reversed(shape), reversed(full)))

    def _reads_ambiguously(self, operand: fx.Node) -> bool:
        """A full-shape node reading a row scalar without keepdim (`x.sum(1) * x` for a square x) broadcasts
        it from the right, along the row, which the kernel would read as one value per row: the node
        stays out of the group (the scalar's producer may be the reduction itself, which stays in)."""
        val = operand.meta.get("val")
        return isinstance(val, torch.Tensor) and self._ambiguous_row_scalar(operand, sizes(val))

    def _after_column(self, node: fx.Node) -> bool:
        """Computed, through any ops, from a column sum of this group's key (one walk over the graph in
        order, not a recursion: a deep backward graph would exceed Python's recursion limit; the walk
        also fills _column_value's memo in order, so its own recursion stays shallow)."""
        if self._after_columns is None:
            self._after_columns = set()
            for n in node.graph.nodes:
                if any(self._column_value(a) or a in self._after_columns for a in n.all_input_nodes):
                    self._after_columns.add(n)
        return node in self._after_columns

    def _column_operand(self, node: fx.Node, depth: int = 0) -> bool:
        """A pointwise op of graph inputs only whose shape the row broadcasts from the right ([M] of
        [N, M]: `w.float()` in LayerNorm's backward). Computed in the kernel where it is read, so its
        inputs are read once per program instead of a kernel writing the result and the row kernel
        reading it back. Kept out of the group if anything outside it reads the value (see
        _drop_escaping_column_operands). A chain deeper than COLUMN_CHAIN_DEPTH stays outside (a
        recursion per op: 450 ops overflowed Python's stack)."""
        shape, val = self.key[0], node.meta.get("val")
        if depth > COLUMN_CHAIN_DEPTH:
            return False
        if not (node.op == "call_function" and not is_view(node) and reduction_info(node) is None
                and isinstance(val, torch.Tensor) and 0 < val.dim() < len(shape)
                and sizes(val) == shape[len(shape) - val.dim():] and node.all_input_nodes):
            return False
        return all(a.op in ("placeholder", "get_attr") or self._column_operand(a, depth + 1)
                   for a in node.all_input_nodes)

    def _column_value(self, node: fx.Node) -> bool:
        """A column sum of the group's shape, or a pointwise op computed from such sums only. A sum of
        column values is not a column sum of the rows, even where its shapes say so (a [1, M] column sum
        summed over its dim 0 again, for a single row)."""
        if node not in self._columns:
            if is_column_sum_of(node, self.key):
                self._columns[node] = not any(self._column_value(a) or self._after_column(a)
                                              for a in node.all_input_nodes)
            else:
                self._columns[node] = (
                    node.op == "call_function" and not is_view(node) and reduction_info(node) is None
                    and bool(node.all_input_nodes) and all(self._column_value(a) for a in node.all_input_nodes)
                    and pointwise_unsupported_reason(node, self.target) is None)
        return self._columns[node]

    def _ambiguous_row_scalar(self, node: fx.Node, shape) -> bool:
        """A value of the reduced shape without the reduced dims ([N] for a sum over dim 1 of [N, M]) is
        one number per row. A consumer of the full rank reads it broadcast from the right instead (along
        M): the two readings differ unless the reduced dims lead, so such a node stays out of the group."""
        full_shape, dims, _ = self.key
        if shape != dropped_shape(full_shape, dims) or len(shape) == len(full_shape):
            return False
        if tuple(dims) == tuple(range(len(dims))):
            return False
        return any(isinstance(u.meta.get("val"), torch.Tensor) and u.meta["val"].dim() == len(full_shape)
                   for u in node.users)


@dataclass(frozen=True)
class FuseReductions:
    name: str = "fuse_reductions"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        stats = {"groups": 0, "reductions": 0, "fused_ops": 0}
        if not ctx.options.fuse:
            return PassResult(gm, False, stats)
        keys = OrderedDict()
        for node in gm.graph.nodes:
            info = reduction_info(node)
            if info and info.device.startswith(ctx.device_type) and reduction_unsupported_reason(node, ctx.target) is None:
                keys[info.key] = None
        for i, key in enumerate(sorted(keys, key=_columns_last)):
            proposed = propose_partitions(gm, _ReductionGroupSupport(key, ctx.target))
            groups = [p for p in proposed if any(reduction_info(n) is not None and reduction_info(n).key == key
                                                 for n in p.nodes)]
            if not groups:
                continue
            _merge_column_partitions(gm, groups, [p for p in proposed if p not in groups
                                                  and any(is_column_sum_of(n, key) for n in p.nodes)])
            _drop_escaping_column_operands(groups, key)
            groups, _ = acyclic_subset(gm.graph, groups)  # (a dropped group's reductions stay ATen, noted by fuse)
            for p in groups:
                for n in p.nodes:
                    if reduction_info(n) is not None and reduction_info(n).key != key:
                        n.meta[COLUMN_SUM] = True
                stats["reductions"] += sum(1 for n in p.nodes if reduction_info(n) is not None)
                stats["fused_ops"] += len(p.nodes)
            gm = fuse_partitions(gm, groups, prefix=f"{REDUCTION_PREFIX}{i}_")
            stats["groups"] += len(groups)
        for node in list(gm.graph.nodes):
            if node.op == "call_module" and str(node.target).startswith(REDUCTION_PREFIX):
                absorb_input_views(gm, node)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        return PassResult(gm, stats["groups"] > 0, stats)


def _drop_escaping_column_operands(groups: list, key) -> None:
    """A column operand (_ReductionGroupSupport._column_operand) read outside its group would be a
    kernel output of a shape the row kernel does not store: it stays out (a kernel of its own)."""
    support = _ReductionGroupSupport(key, "")
    for p in groups:
        changed = True
        while changed:
            changed = False
            for n in list(p.nodes):
                val = n.meta.get("val")
                if (isinstance(val, torch.Tensor) and sizes(val) not in support.shapes
                        and support._column_operand(n) and any(u not in p.nodes for u in n.users)):
                    p.remove_node(n)
                    changed = True


def _columns_last(key) -> bool:
    """Row groups (reducing trailing dims) are formed before column groups, so that column sums can
    join the row kernels that compute their inputs."""
    return not reduces_trailing_dims(*key[:2])


def _merge_column_partitions(gm: fx.GraphModule, rows: list, columns: list) -> None:
    """Put each partition that computes only column sums (and the ops feeding them or using them alone)
    into a row partition it shares an input with: the partitioner merges along data flow, and a
    norm backward's `sum(dy * x_hat, 0)` or `sum(dy, 0)` shares only x and dy with the row kernel.
    Skipped where merging would make a cycle (a path between the two through other nodes)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for c in columns:
        c_inputs = {a for n in c.nodes for a in n.all_input_nodes if a not in c.nodes}
        for r in rows:
            r_reads = set(r.nodes) | {a for n in r.nodes for a in n.all_input_nodes}
            if c_inputs & r_reads and not _path_outside(r, c, order) and not _path_outside(c, r, order):
                for n in c.nodes:
                    r.add_node(n)
                break


def _path_outside(src, dst, order: dict) -> bool:
    """Whether a node of partition `dst` is reachable from `src` through a node of neither."""
    members = set(src.nodes) | set(dst.nodes)
    last = max(order[n] for n in dst.nodes)
    starts = [u for n in src.nodes for u in n.users if u not in members]
    return any(n in dst.nodes for s in starts for n in [s, *_reachable(s, order, last)])


def _reachable(node: fx.Node, order: dict, last: int):
    """Nodes reachable from `node` through users, up to graph position `last`."""
    seen, stack = set(), list(node.users)
    while stack:
        n = stack.pop()
        if n in seen or order[n] > last:
            continue
        seen.add(n)
        yield n
        stack += list(n.users)
