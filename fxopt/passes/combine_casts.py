"""Casts of graph inputs that pointwise fusion left one per kernel become one kernel.

A mixed-precision training step casts every float32 parameter to bf16/fp16 on every call (as
torch.autocast does): nothing else reads the parameter in the forward, so each cast is a group of
its own, one launch each (8 per GPT-2 block, ~150 for a whole GPT-2 small). The step is bound by
host time at small and medium sizes, and a launch costs about as much host time as a small kernel
takes on the GPU. These casts read only graph inputs, so all of them can run at the first one's
place: this pass moves them into one multi-output group, one launch of codegen/combined_casts.py.

    before                                   after
    fused0 = self.fused0_0(w_qkv)            casts = self.fusedcasts_0(w_qkv, b_qkv, w_proj)
    ... = addmm(fused1, x, permute(fused0))  fused0 = casts[0]; fused1 = casts[1]; fused2 = casts[2]
    fused2 = self.fused2_0(w_proj)           ... = addmm(fused1, x, permute(fused0))

Cost rule: a moved cast's result is allocated earlier, from the first cast's place; a cast joins
only if that never raises the graph's peak (liveness.live_bytes; in training the casts are mostly
kept for the backward and alive at the forward's end, where its peak is). Members are float casts of
contiguous inputs of static size, each under 2**31 elements (32-bit offsets); at most MAX_MEMBERS
per kernel (each program tests every member's range). 16, not 64: a 64-member kernel's compile took
3.6 s on an H100 host's compile pool, 1.5-1.8 s of it Triton's front end (16 members: 1.8 s and 0.38 s;
the 24-block stack's kernels of 16 are one program, compiled once; benchmarks/results/2026-12-07-h100.md).
The price is a few more launches per step: 12 instead of 3 for 192 casts.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..analysis.liveness import live_bytes, tensor_bytes
from ..pass_manager import PassContext, PassResult
from .fuse import FUSED_PREFIX
from .fuse_reductions import REDUCTION_PREFIX

aten, prims = torch.ops.aten, torch.ops.prims
CASTS_PREFIX = f"{FUSED_PREFIX}casts"
MAX_MEMBERS = 16
_MAX_NUMEL = 2**31 - 2**16


def cast_of(sub: fx.GraphModule) -> fx.Node | None:
    """The one cast node of a group that does nothing but cast its one input (same shape), or None."""
    nodes = list(sub.graph.nodes)
    if [n.op for n in nodes] != ["placeholder", "call_function", "output"]:
        return None
    cast, out = nodes[1], nodes[2]
    if out.args[0] is not cast or cast.args[0] is not nodes[0]:
        return None
    if cast.target is prims.convert_element_type.default and len(cast.args) == 2 and not cast.kwargs:
        return cast
    if cast.target is aten._to_copy.default and len(cast.args) == 1 and set(cast.kwargs) <= {"dtype"}:
        return cast
    return None


def input_cast(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A fused group that only casts a contiguous graph input between float dtypes, static size."""
    target = str(node.target)
    if node.op != "call_module" or not target.startswith(FUSED_PREFIX) or target.startswith(
            (REDUCTION_PREFIX, CASTS_PREFIX)):
        return False
    if len(node.args) != 1 or node.args[0].op != "placeholder" or cast_of(gm.get_submodule(target)) is None:
        return False
    src, dst = node.args[0].meta.get("val"), node.meta.get("val")
    if not (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)):
        return False
    static = all(isinstance(s, int) for s in (*src.shape, *src.stride(), *dst.stride()))
    return (static and src.dtype.is_floating_point and dst.dtype.is_floating_point and src.shape == dst.shape
            and src.device == dst.device and 0 < src.numel() < _MAX_NUMEL
            and src.is_contiguous() and dst.is_contiguous())


def _joinable(members: list[fx.Node], gm: fx.GraphModule, live: list[int]) -> list[fx.Node]:
    """The members, in graph order, whose results may be allocated at the first member's place
    without raising the graph's peak (greedy, first come first in; `live`: liveness.live_bytes)."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    peak, start = max(live, default=0), position[members[0]]
    extra = [0] * len(live)
    chosen = [members[0]]
    for m in members[1:]:
        nbytes, end = tensor_bytes(m.meta["val"]), position[m]
        if max(live[j] + extra[j] + nbytes for j in range(start, end)) <= peak:
            for j in range(start, end):
                extra[j] += nbytes
            chosen.append(m)
    return chosen


def _combined_module(gm: fx.GraphModule, members: list[fx.Node]) -> fx.GraphModule:
    """One subgraph holding every member's cast, returning their results in the members' order."""
    graph = fx.Graph()
    results = []
    for i, m in enumerate(members):
        cast = cast_of(gm.get_submodule(m.target))
        x = graph.placeholder(f"in{i}")
        x.meta = dict(cast.args[0].meta)
        results.append(graph.node_copy(cast, lambda _: x))
    graph.output(tuple(results))
    return fx.GraphModule(torch.nn.Module(), graph)


@dataclass(frozen=True)
class CombineInputCasts:
    name: str = "combine_casts"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        candidates = [n for n in gm.graph.nodes if input_cast(gm, n)]
        kernels = cast_count = 0
        while len(candidates) >= 2:
            live = live_bytes(gm)  # (again after each combine: the graph changed)
            if live is None:  # symbolic sizes somewhere: no single peak to keep, nothing joins
                break
            members = _joinable(candidates[:MAX_MEMBERS], gm, live)
            candidates = [c for c in candidates if c not in members]  # (the first always leaves)
            if len(members) < 2:
                continue
            self._combine(gm, members, f"{CASTS_PREFIX}_{kernels}")
            kernels, cast_count = kernels + 1, cast_count + len(members)
        if kernels:
            gm.graph.lint()
            gm.recompile()
        return PassResult(gm, bool(kernels), {"kernels": kernels, "casts": cast_count})

    @staticmethod
    def _combine(gm: fx.GraphModule, members: list[fx.Node], name: str) -> None:
        gm.add_submodule(name, _combined_module(gm, members))
        with gm.graph.inserting_before(members[0]):
            combo = gm.graph.call_module(name, tuple(m.args[0] for m in members))
            combo.meta["val"] = tuple(m.meta["val"] for m in members)
            for i, m in enumerate(members):
                item = gm.graph.call_function(operator.getitem, (combo, i))
                item.meta = dict(m.meta)
                m.replace_all_uses_with(item)
        for m in members:
            target = m.target
            gm.graph.erase_node(m)
            gm.delete_submodule(target)
