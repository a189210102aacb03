"""Fuse a partitioner's groups into submodules, as torch.fx's `fuse_by_partitions` does, without its
whole-graph copy.

`CapabilityBasedPartitioner.fuse_partitions` ends with `stable_topological_sort`, which rebuilds the
graph node by node and assigns it back to the GraphModule (a recompile of the whole graph). The fusion
passes fuse once per domain or reduction key, so a GPT-2 block's training step paid that 20 times:
0.30 of the fusion passes' 0.47 s (cProfile, CPU machine), on the first call's critical path. Here the
same order (Kahn's algorithm taking ready nodes in their current order, so the graphs and kernels are
unchanged) is applied by moving nodes in place, and only when some node precedes an input.

Each group becomes a `_LazyGraphModule`: torch's `fuse_as_graphmodule` builds an eager GraphModule, which
generates and compiles the group's Python code at once, and again each time the parent recompiles. Codegen
reads the groups' graphs, never that code: a 24-block GPT-2 training step's 480 groups spent 0.7 s (cProfile,
CPU machine) making code nothing ran. A lazy module makes it on first call or `.code`.
"""
from __future__ import annotations

import graphlib
import heapq
import inspect

import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.passes.utils.fuser_utils import erase_nodes, fuse_by_partitions, insert_subgm, topo_sort

from ..analysis.op_classes import is_view
from ..analysis.torch_ops import module_attribute

# torch >= 2.10 places the fused call at the group's last node, then sorts stably; older torch appended
# it to the graph and sorted with `legalize_graph`: there torch's own function runs, for the same graphs
_INSERTION_POINT = "insertion_point" in inspect.signature(insert_subgm).parameters


def fuse_partitions(gm: fx.GraphModule, partitions, prefix: str) -> fx.GraphModule:
    """Each partition (a torch.fx Partition) becomes a call_module `{prefix}{i}`; the graph stays in
    topological order."""
    for partition in partitions:
        _views_read_outside_stay_outside(gm.graph, partition.nodes)
    if not _INSERTION_POINT:
        return fuse_by_partitions(gm, [p.nodes for p in partitions], prefix=prefix)
    for i, partition in enumerate(partitions):
        nodes = topo_sort(list(partition.nodes))
        sub, inputs, outputs = lift_group(gm, nodes, f"{prefix}{i}")
        insert_subgm(gm, sub, inputs, outputs, nodes[-1])
        erase_nodes(gm, nodes)
    sort_in_place(gm.graph)
    gm.graph.lint()
    return gm


def lift_group(gm: fx.GraphModule, nodes: list[fx.Node], class_name: str):
    """The group's nodes (in topological order) copied into a lazy GraphModule of their own: a placeholder
    per value read from outside (in first-read order), an output per node read outside (in group order; a
    lone output returned bare, as `fuse_as_graphmodule` does). Returns (module, inputs, outputs)."""
    inside = set(nodes)
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    placeholders: dict[fx.Node, fx.Node] = {}

    def read(x: fx.Node) -> fx.Node:
        if x in inside:
            return copies[x]
        if x not in placeholders:
            placeholders[x] = graph.placeholder(x.name, type_expr=x.type)
            placeholders[x].meta = dict(x.meta)
        return placeholders[x]

    for n in nodes:
        copies[n] = graph.node_copy(n, read)
    outputs = tuple(n for n in nodes if any(u not in inside for u in n.users))
    results = tuple(copies[n] for n in outputs)
    graph.output(results[0] if len(results) == 1 else results)
    # attributes and modules the group reads, under their dotted names (GraphModule resolves them from a dict)
    owned = {n.target: module_attribute(gm, n.target) for n in graph.nodes if n.op in ("get_attr", "call_module")}
    return _LazyGraphModule(owned, graph, class_name), tuple(placeholders), outputs


def _views_read_outside_stay_outside(graph: fx.Graph, group) -> None:
    """A view (or chain of views) of values from outside the group that nodes outside also read: they get
    their own copy of it, made outside, instead of a kernel output holding the view's values. Such an
    output has no computation behind it, and the looped reduction schedule never stored it (a
    `p.view(1, C, 1, 1)` of a channels-last backward's bias: the next kernel read uninitialised memory
    for it, a wrong scale gradient)."""
    def outside_view(n) -> bool:
        return is_view(n) and all(a not in group or outside_view(a) for a in n.all_input_nodes)

    made: dict = {}

    def copy_outside(v):
        if v not in group:
            return v
        if v not in made:
            with graph.inserting_before(v):
                made[v] = graph.node_copy(v, copy_outside)
        return made[v]

    for n in list(group):
        readers = [u for u in n.users if u not in group]
        if readers and outside_view(n):
            for u in readers:
                u.replace_input_with(n, copy_outside(n))


def sort_in_place(graph: fx.Graph) -> None:
    """torch.fx's stable topological order (ready nodes taken in their current order), by moving nodes:
    nothing is copied and a graph already in order is left as it is."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    if all(index[a] < i for i, n in enumerate(nodes) for a in n.all_input_nodes):
        return
    waiting = {n: 0 for n in nodes}
    for n in nodes:
        for user in n.users:
            waiting[user] += 1
    ready = [(index[n], n) for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for user in n.users:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, (index[user], user))
    if len(order) != len(nodes):
        raise RuntimeError(f"fxopt: fusing made a cycle through {[n.name for n in nodes if waiting[n]]}")
    anchor = graph._root
    for n in order:
        if anchor.next is not n:
            anchor.append(n)
        anchor = n


def acyclic_subset(graph: fx.Graph, partitions: list) -> tuple[list, list]:
    """(kept, dropped): the partitions that can all be fused, each into one node, without a cycle in the
    graph, and the rest. torch's CapabilityBasedPartitioner can propose two groups that each depend on
    the other through a node of neither (a backward graph: `where` in group B feeds group A, whose result
    reaches B again through a `flip` no group takes), and fusing them raised "Invalid partition, found
    dependency cycles". Usually all are kept after one check; otherwise groups are taken in order, each
    one only if the graph with it contracted stays acyclic (a dropped group's ops stay ATen calls)."""
    if _contractible(graph, partitions):
        return list(partitions), []
    kept, dropped = [], []
    for p in partitions:
        (kept if _contractible(graph, kept + [p]) else dropped).append(p)
    return kept, dropped


def _contractible(graph: fx.Graph, partitions: list) -> bool:
    """Whether the graph with each partition contracted to one node is acyclic."""
    group = {n: i for i, p in enumerate(partitions) for n in p.nodes}
    preds: dict = {}
    for n in graph.nodes:
        key = group.get(n, n)
        preds.setdefault(key, set()).update(k for a in n.all_input_nodes if (k := group.get(a, a)) != key)
    try:
        graphlib.TopologicalSorter(preds).prepare()
    except graphlib.CycleError:
        return False
    return True
