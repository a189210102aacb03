"""Pointwise fusion: maximal groups of elementwise ops become one submodule each (one kernel later).

Which nodes may share a kernel is a partitioning question: propose_partitions (torch.fx's
CapabilityBasedPartitioner's rule, with reachability in bitsets) merges supported nodes without creating
a cycle. A group iterates over one domain, so it is run once per (shape, device) of the values it may
hold; inputs of any broadcastable shape are read in place.
Views and expands that feed a group are copied into its subgraph, so codegen reads their base with
the view's strides instead of the wrapper materialising anything.

    before                                        after
    t = aten.permute.default(x, [1, 0])            fused_0 = self.fused_0(x, b)
    y = aten.add.Tensor(t, b)                      # fused_0: permute(x) -> add -> gelu
    z = aten.gelu.default(y)
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.passes.operator_support import OperatorSupportBase

from ..analysis.op_classes import GATHERS, classify, is_view, kernel_unsupported_reason
from ..analysis.reductions import reduction_unsupported_reason
from ..analysis.symbolic import sizes
from ..pass_manager import PassContext, PassResult
from .fuse_partitions import acyclic_subset, fuse_partitions
from .propose_partitions import propose_partitions

FUSED_PREFIX = "fused"


class _SameDomainPointwise(OperatorSupportBase):
    def __init__(self, key, target: str):
        self.key, self.target = key, target

    def is_node_supported(self, submodules, node: fx.Node) -> bool:
        return _domain_key(node) == self.key and kernel_unsupported_reason(node, self.target) is None


def _domain_key(node: fx.Node):
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    return (sizes(val), str(val.device))  # sympy sizes: hashable, compared without guards


def _view_chain(arg: fx.Node) -> list[fx.Node]:
    """The view nodes from arg down to a non-view root, outermost last; [] if arg is not a view."""
    chain = []
    node = arg
    while is_view(node) and isinstance(node.args[0], fx.Node):
        chain.append(node)
        node = node.args[0]
    root_val = node.meta.get("val")
    if not chain or not isinstance(root_val, torch.Tensor):
        return []
    if any(n.meta.get("val") is None or n.meta["val"].dtype != root_val.dtype for n in chain):
        return []  # a dtype-reinterpreting view: the kernel cannot read it through strides
    if any(a.all_input_nodes[1:] for a in chain):
        return []  # a view sized by graph values (SymInts, dynamic shapes) stays an ATen view outside
    return list(reversed(chain))


def absorb_input_views(gm: fx.GraphModule, call: fx.Node) -> int:
    """Copy the view chains feeding `call` into its subgraph and pass their roots instead."""
    sub: fx.GraphModule = gm.get_submodule(call.target)
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    root_ph: dict[fx.Node, fx.Node] = {}
    new_args, absorbed = [], 0
    for ph, arg in zip(placeholders, call.args):
        chain = _view_chain(arg) if isinstance(arg, fx.Node) else []
        if not chain:
            if arg in root_ph:
                ph.replace_all_uses_with(root_ph[arg])
                sub.graph.erase_node(ph)
            else:
                root_ph[arg] = ph
                new_args.append(arg)
            continue
        root = chain[0].args[0]
        if root not in root_ph:
            with sub.graph.inserting_before(ph):
                base = sub.graph.placeholder(f"{root.name}_base")
            base.meta = dict(root.meta)
            root_ph[root] = base
            new_args.append(root)
        value = root_ph[root]
        with sub.graph.inserting_before(ph):
            for view in chain:
                args = (value,) + tuple(view.args[1:])
                value = sub.graph.call_function(view.target, args, dict(view.kwargs))
                value.meta = dict(view.meta)
                value.name  # keep fx's fresh unique name
        ph.replace_all_uses_with(value)
        sub.graph.erase_node(ph)
        absorbed += len(chain)
    # placeholders must stay in call-argument order: rebuild the order they appear in
    call.args = tuple(new_args)
    sub.graph.lint()
    sub.recompile()
    return absorbed


@dataclass(frozen=True)
class FusePointwise:
    """Partition elementwise ops into groups; leave every other compute node with a reason."""

    name: str = "fuse"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        stats = {"groups": 0, "fused_ops": 0, "views_absorbed": 0}
        if not ctx.options.fuse:
            self._note_fallbacks(gm, ctx, fused=set())
            return PassResult(gm, False, stats)
        keys = OrderedDict()
        for node in gm.graph.nodes:
            key = _domain_key(node)
            if key and key[1].startswith(ctx.device_type) and kernel_unsupported_reason(node, ctx.target) is None:
                keys[key] = None
        fused_nodes: set[str] = set()
        cyclic: set[str] = set()  # ops of groups that would have made a cycle (fuse_partitions.acyclic_subset)
        for i, key in enumerate(keys):
            support = _SameDomainPointwise(key, ctx.target)
            # a cat alone saves no pass over memory: ATen's copy kernel does it as well (op_classes.GATHERS)
            partitions = [p for p in propose_partitions(gm, support) if not all(n.target in GATHERS for n in p.nodes)]
            partitions, dropped = acyclic_subset(gm.graph, partitions)
            cyclic |= {n.name for p in dropped for n in p.nodes}
            if not partitions:
                continue
            for p in partitions:
                fused_nodes |= {n.name for n in p.nodes}
                stats["fused_ops"] += len(p.nodes)
            gm = fuse_partitions(gm, partitions, prefix=f"{FUSED_PREFIX}{i}_")
            stats["groups"] += len(partitions)
        for node in list(gm.graph.nodes):
            if node.op == "call_module" and str(node.target).startswith(FUSED_PREFIX):
                stats["views_absorbed"] += absorb_input_views(gm, node)
        gm.graph.eliminate_dead_code()
        self._note_fallbacks(gm, ctx, fused_nodes, cyclic)
        gm.recompile()
        return PassResult(gm, stats["groups"] > 0, stats)

    @staticmethod
    def _note_fallbacks(gm: fx.GraphModule, ctx: PassContext, fused: set[str], cyclic: frozenset = frozenset()) -> None:
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.name in fused or classify(node) in ("view", "fxopt"):
                continue
            if getattr(node.target, "__name__", "") == "getitem":
                continue
            reason = kernel_unsupported_reason(node, ctx.target)
            if classify(node) == "reduction":
                reason = reduction_unsupported_reason(node, ctx.target) or "reduction: no group took it"
            if reason is None and node.name in cyclic:
                reason = "not fused: its group and another kernel would each need the other's result"
            if reason is None and node.target in GATHERS and ctx.options.fuse:
                reason = "cat with no element-wise consumer to fuse with: ATen's copy kernel"
            if reason is None:
                reason = "fusion disabled (fuse=False)" if not ctx.options.fuse else "not fused"
            ctx.note(node.name, reason)
