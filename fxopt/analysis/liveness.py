"""Liveness of the buffers the wrapper allocates, in final node order.

A buffer is born at the node that writes it (a fused kernel's output, or an ATen call that is not a
view) and dies at the last node that reads it or any view of it. Graph inputs are not buffers the
wrapper allocates; graph outputs (and views of them) live to the end, and are marked so the planner
never lets later buffers reuse their memory. An ATen op whose schema says its output may alias an
input (views, and the rarer `alias`-annotated ops) extends its input's buffer rather than owning one,
so a buffer returned through such an op is an output too. The input of an asynchronous collective
lives until the wait on its result (the communication may still read it).

With symbolic sizes (dynamic shapes) a buffer's bytes are a sympy expression of the size symbols;
memory/size_plans.py evaluates them per distinct size.
"""
from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .op_classes import is_collective, is_view, is_wait, out_variant
from .symbolic import row_major_strides, sizes, storage_offset, strides


@dataclass
class Interval:
    name: str
    nbytes: object  # int, or a sympy expression of the size symbols
    first_use: int  # position of the node that writes it
    last_use: int  # position of the last node that reads it (or a view of it)
    is_output: bool = False
    kernel: bool = False  # written by a fused kernel launch (the wrapper allocates it)
    placeable: bool = False  # the wrapper can allocate it (kernel outputs, and ATen calls with an out= overload)


def tensor_bytes(val):
    """Bytes of the storage the tensor spans (a strided tensor needs the furthest element + 1): an int,
    or a sympy expression when its sizes are symbolic."""
    if not isinstance(val, torch.Tensor):
        return 0
    shape, stride = sizes(val), strides(val)
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(shape, stride)) if all(s != 0 for s in shape) else 0
    return span * val.element_size()


def _aliases_input(node: fx.Node) -> bool:
    """The op's output may share memory with an input: a view, a schema return marked as an alias, or a
    function that may write its result over an input (`writes_over`: passes/grad_over_logits.py)."""
    if is_view(node):
        return True
    t = node.target
    if node.op == "call_function" and hasattr(t, "writes_over"):
        return True
    return (node.op == "call_function" and isinstance(t, torch._ops.OpOverload)
            and any(r.alias_info is not None for r in t._schema.returns))


def _owner(node: fx.Node, owners: dict) -> fx.Node | None:
    """The buffer-owning node a value lives in: itself, or what its view chain starts from."""
    while node is not None and node not in owners:
        if _aliases_input(node) or (node.op == "call_function" and node.target is operator.getitem
                             and node.args[0].op != "call_module"):
            node = _aliased(node)
        else:
            return None
    return node


def _aliased(node: fx.Node) -> fx.Node | None:
    """The input whose memory an aliasing node's output shares (the first, but for `writes_over`)."""
    a = node.args[getattr(node.target, "writes_over", 0)]
    return a if isinstance(a, fx.Node) else None


def buffer_intervals(gm: fx.GraphModule) -> list[Interval]:
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    owners: dict[fx.Node, Interval] = {}
    for n in nodes:
        if n.op == "call_module" and isinstance(n.meta.get("val"), tuple):
            for u in n.users:  # a multi-output kernel writes one buffer per getitem
                owners[u] = Interval(u.name, tensor_bytes(u.meta.get("val")), position[n], position[n],
                                     kernel=True, placeable=True)
        elif n.op == "call_module" or (n.op == "call_function" and not _aliases_input(n)
                                      and n.target is not operator.getitem):
            size = tensor_bytes(n.meta.get("val"))
            if size:
                kernel = n.op == "call_module"
                owners[n] = Interval(n.name, size, position[n], position[n], kernel=kernel,
                                     placeable=kernel or out_variant(n) is not None)
    end = len(nodes) - 1
    for n in nodes:
        for a in n.all_input_nodes:
            owner = _owner(a, owners)
            if owner is None:
                continue
            iv = owners[owner]
            if n.op == "output":
                iv.last_use, iv.is_output = end, True
            else:
                iv.last_use = max(iv.last_use, _read_until(n, position))
    return sorted(owners.values(), key=lambda iv: (iv.first_use, iv.name))


def _read_until(node: fx.Node, position: dict) -> int:
    """Until when `node` reads its inputs: its own position, or for an asynchronous collective
    (all_gather, reduce_scatter, ... issued now, finished by a wait_tensor later) the position of the
    last wait on its result: the communication may read the input until then."""
    if not is_collective(node) or is_wait(node):
        return position[node]
    todo, last = list(node.users), position[node]
    while todo:
        u = todo.pop()
        if u.op == "call_function" and u.target is operator.getitem:
            todo.extend(u.users)
        elif is_wait(u):
            last = max(last, position[u])
    return last


def _same_layout(a, b) -> bool:
    """Element i of `a` and element i of `b` at the same byte: equal sizes and strides, or both
    row-major over the same element count (a [16, 4096] matmul result and the [1, 16, 4096] kernel
    output it was reshaped to)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.element_size() == b.element_size()):
        return False
    # sizes as sympy terms, never SymInts: comparing those would add a guard
    return (sizes(a) == sizes(b) and strides(a) == strides(b)) or (
        _row_major(a) and _row_major(b) and _numel(a) == _numel(b))


def _row_major(t) -> bool:
    return isinstance(t, torch.Tensor) and strides(t) == row_major_strides(sizes(t))


def _elementwise_from(sub: fx.GraphModule, index: int) -> bool:
    """Inside a fused group, the index-th input reaches the output only through pointwise ops, so the
    kernel reads input element i only while computing output element i (no view re-indexes it, no op
    broadcasts it: `y * y[0]` reads row 0 of y for every row of the output, and a kernel writing over y
    gave every block after the first the overwritten row: the fuzzer of 2026-12-06)."""
    from .op_classes import classify

    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    if index >= len(placeholders):
        return False
    todo, seen = [placeholders[index]], set()
    while todo:
        node = todo.pop()
        for u in node.users:
            if u in seen or u.op == "output":
                continue
            if u.op != "call_function" or not (classify(u) == "pointwise" or _flat_view(u)):
                return False
            if _numel(node.meta.get("val")) != _numel(u.meta.get("val")):  # broadcast, or a smaller view
                return False
            seen.add(u)
            todo.append(u)
    return True


def _flat_view(node: fx.Node) -> bool:
    """A view from row-major to row-major of all the elements at the same offset (a reshape): element i
    stays element i (a row-major `select(0, k)` or `[:1]` is not one)."""
    if not (is_view(node) and isinstance(node.args[0], fx.Node)):
        return False
    before, after = node.args[0].meta.get("val"), node.meta.get("val")
    return (_row_major(before) and _row_major(after) and _numel(before) == _numel(after)
            and storage_offset(before) == storage_offset(after))


def _numel(t):
    """The element count (a sympy expression under symbolic sizes: compared exactly, no guards); None for
    what is not a tensor."""
    return math.prod(sizes(t)) if isinstance(t, torch.Tensor) else None


def _base(node):
    """The value a view (or alias, or non-kernel getitem) chain starts from."""
    while isinstance(node, fx.Node) and (_aliases_input(node) or (
            node.op == "call_function" and node.target is operator.getitem and node.args[0].op != "call_module")):
        node = _aliased(node)
    return node


def inplace_pairs(gm: fx.GraphModule, intervals: list[Interval]) -> list[tuple[str, str]]:
    """(dying, born) buffers a pointwise kernel may write in place: the born buffer is the only output of
    a fused pointwise kernel; the dying one is an input of that kernel, read by nothing after it (its
    last use is this kernel), passed directly (not through a view), with the output's shape, strides and
    element size, and it reaches the output only through pointwise ops. The dying buffer is one the
    wrapper holds alone: a kernel output, or the result of an ATen op with an out= overload (a matmul:
    a fresh tensor, never a view of an input). Both must be in `intervals` (the buffers being
    planned); each dying buffer is taken by at most one born buffer."""
    from ..passes.fuse import FUSED_PREFIX
    from ..passes.fuse_reductions import REDUCTION_PREFIX

    by_name = {iv.name: iv for iv in intervals}
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    pairs, taken = [], set()
    for n in gm.graph.nodes:
        target = str(n.target)
        if (n.op != "call_module" or not target.startswith(FUSED_PREFIX) or target.startswith(REDUCTION_PREFIX)
                or not isinstance(n.meta.get("val"), torch.Tensor) or n.name not in by_name):
            continue
        sub = gm.get_submodule(n.target)
        for i, a in enumerate(n.args):
            iv = by_name.get(a.name) if isinstance(a, fx.Node) else None
            if (iv is None or a.name in taken or iv.last_use != position[n] or not iv.placeable
                    or iv.nbytes != by_name[n.name].nbytes or not _same_layout(a.meta.get("val"), n.meta["val"])
                    or not _elementwise_from(sub, i)
                    or any(_base(b) is a for j, b in enumerate(n.args) if j != i and b is not a)):
                continue  # (last: the kernel reads the dying buffer through a view too, re-indexed)
            pairs.append((a.name, n.name))
            taken.add(a.name)
            break
    return pairs


def peak_headroom(gm: fx.GraphModule) -> dict[str, int]:
    """For each kernel launch (call_module node, by name): the bytes it may allocate for its own use
    (a scratch buffer freed when it returns) without raising the graph's peak, i.e. the most bytes the
    graph's buffers ever hold at once minus what they hold while it runs. Graph inputs are held by the
    caller throughout and cancel out. Empty for symbolic sizes (no single peak to compare with)."""
    live = live_bytes(gm)
    if live is None:
        return {}
    peak = max(live, default=0)
    return {n.name: peak - live[i] for i, n in enumerate(gm.graph.nodes) if n.op == "call_module"}


def live_bytes(gm: fx.GraphModule) -> list[int] | None:
    """Bytes the graph's buffers hold at each node position (graph inputs excluded: the caller holds
    them throughout); None for symbolic sizes."""
    intervals = buffer_intervals(gm)
    if not all(isinstance(iv.nbytes, int) for iv in intervals):
        return None
    change = [0] * (len(gm.graph.nodes) + 1)  # bytes born minus bytes freed at each position (a running sum)
    for iv in intervals:
        change[iv.first_use] += iv.nbytes
        change[iv.last_use + 1] -= iv.nbytes
    return list(itertools.accumulate(change[:-1]))
