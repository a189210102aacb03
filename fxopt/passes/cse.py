"""Common-subexpression elimination: on aot_autograd's joint graph before the min-cut partitioner, and
in the cleanup pass of every forward and backward graph (passes/cleanup.py).

torch's partitioner runs its own CSE (`torch._functorch.compile_utils.fx_graph_cse`), which imports
`torch._inductor.pattern_matcher` and with it Inductor's lowerings and kernel templates: 1.2 s of a
training graph's first call on a machine with a bytecode cache, 2-3 s on the H200 machine without one
(benchmarks/results/2026-12-02-h200-f.md), spent by a compiler that never uses Inductor. fxopt runs
this pass instead and calls the partitioner with `cse=False` (backend.py).

Two calls merge when they are the same ATen op (or `getitem`) on the same inputs with equal arguments,
compared with their types (`add(x, 1)` and `add(x, 1.0)` promote differently, so they stay apart), and
nothing mutable ran between them. Never merged: ops whose schema mutates (each one also starts a new
region, so no call merges across it), random ops (`nondeterministic_seeded`: two dropout masks are two
draws), fresh allocations (`empty*`: distinct buffers), and a call the graph returns when an earlier
equal call is returned too (two outputs must not become one tensor).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

_UNHASHABLE = object()


def _frozen(value):
    """A hashable key for an argument (values with their types: 1 and 1.0 differ; NaN equals NaN; 0.0
    and -0.0 differ, as x * 0.0 and x * -0.0 do, in 1 / x), or _UNHASHABLE."""
    if isinstance(value, (list, tuple)):
        items = tuple(_frozen(v) for v in value)
        return _UNHASHABLE if any(i is _UNHASHABLE for i in items) else (type(value).__name__, items)
    if isinstance(value, dict):
        items = tuple((k, _frozen(v)) for k, v in sorted(value.items()))
        return _UNHASHABLE if any(i is _UNHASHABLE for _, i in items) else ("dict", items)
    if isinstance(value, slice):
        return ("slice", _frozen((value.start, value.stop, value.step)))
    if isinstance(value, float):
        return (float, value.hex())  # one key per bit pattern but NaN's: 'nan', '-0x0.0p+0'
    try:
        hash(value)
    except TypeError:
        return _UNHASHABLE
    return (type(value), value)


def _mergeable(node: fx.Node) -> bool:
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return not target._schema.name.split("::")[-1].startswith(("empty", "new_empty"))


def _mutates(node: fx.Node) -> bool:
    """Starts a new region: a mutating ATen op, or any call that is neither ATen nor size arithmetic
    (`operator.mul`, `math.ceil`, `torch.sym_max`, ...): higher-order ops such as RNG state replay are
    taken as mutating, to be safe."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable
    module = getattr(target, "__module__", None)
    if module in ("_operator", "operator", "math"):
        return False
    return not (module == "torch" and getattr(target, "__name__", "").lstrip("_").startswith("sym_"))


def eliminate_common_subexpressions(graph: fx.Graph) -> int:
    """Merge equal calls in `graph` in place (see the module docstring); returns how many were removed."""
    out = graph.find_nodes(op="output")
    outputs = set(out[0].all_input_nodes) if out else set()
    kept: dict[tuple, fx.Node] = {}
    region, removed = 0, 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if _mutates(node):
            region += 1
            continue
        if not _mergeable(node):
            continue
        key = (region, node.target, _frozen(node.args), _frozen(node.kwargs))  # (merged args already replaced)
        if _UNHASHABLE in (key[2], key[3]):
            continue
        twin = kept.get(key)
        if twin is None:
            kept[key] = node
            continue
        if node in outputs and twin in outputs:
            continue
        node.replace_all_uses_with(twin)
        graph.erase_node(node)
        removed += 1
    return removed
