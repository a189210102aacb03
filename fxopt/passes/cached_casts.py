"""Inference under `precision=`: each parameter's cast is made once and cached, not every call.

The precision pass casts fp32 parameters to bf16/fp16 where a matmul reads them; in training that cast
runs every call (as torch.autocast does: the optimizer changes the weights). In inference
`lift_parameter_casts` makes each such cast a new graph input, and `with_cached_casts` fills it from a
`CachedCast`, made again only when the parameter changes.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..analysis.mutations import Mutations
from ..analysis.torch_ops import dtype
from ..pass_manager import PassContext


@dataclass
class CachedCast:
    """A parameter's low-precision copy, kept across calls of one compiled inference graph and made
    again when the parameter changes in place (its version counter moves), is swapped (its pointer), is
    another tensor (a new model at a freed parameter's address, version 1 like the old one's), or an
    optimizer stepped since (fused optimizers write parameters without moving their version)."""

    index: int  # the parameter's position among the graph's inputs
    dtype: torch.dtype
    value: torch.Tensor | None = None
    version: int = -1
    pointer: int = 0
    example: torch.Tensor | None = None  # dynamo's fake value of the cast (static shape), what aot_autograd traces with
    param: weakref.ref | None = None
    steps: int = -1  # optimizer steps taken in the process when the copy was made

    def get(self, param: torch.Tensor) -> torch.Tensor:
        if (self.value is None or param._version != self.version or param.data_ptr() != self.pointer
                or self.param is None or self.param() is not param or self.steps != _OPTIMIZER_STEPS[0]):
            with torch.no_grad():
                self.value = param.detach().to(self.dtype)
            self.version, self.pointer = param._version, param.data_ptr()
            self.param, self.steps = weakref.ref(param), _OPTIMIZER_STEPS[0]
        return self.value


_OPTIMIZER_STEPS = [0]  # optimizer.step() calls in this process, counted once a cast is cached


@functools.lru_cache(maxsize=1)
def _count_optimizer_steps() -> None:
    def counted(optimizer, args, kwargs):
        _OPTIMIZER_STEPS[0] += 1
    from torch.optim.optimizer import register_optimizer_step_post_hook
    register_optimizer_step_post_hook(counted)


def lift_parameter_casts(gm: fx.GraphModule, ctx: PassContext) -> tuple[fx.GraphModule, list[CachedCast]]:
    """Inference only: each parameter's inserted cast becomes a new graph input that `with_cached_casts`
    fills from a cache, so a call reads the bf16/fp16 copy instead of casting the fp32 weight again.
    Works on a copy (dynamo reads its own graph's inputs after the backend returns) and runs after the
    pre-autograd passes (the verifier compares graphs with the same inputs)."""
    if not ctx.casts or not _is_inference(ctx.example_inputs):
        return gm, []
    gm = _copy_of(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    records = {c.node: c for c in ctx.casts}
    mutations = Mutations(gm.graph)  # a parameter the graph writes (Embedding's max_norm) is cast where read
    last, lifted = placeholders[-1], []
    for node in list(gm.graph.nodes):
        record = records.get(node.name)
        source = node.args[0] if record is not None and node.op == "call_method" else None
        if source is None or source.op != "placeholder" or source not in placeholders:
            continue  # (a cast of a cast already lifted stays a cast)
        index = placeholders.index(source)
        if not isinstance(ctx.example_inputs[index], torch.nn.Parameter) or mutations.written(source):
            continue
        with gm.graph.inserting_after(last):
            last = gm.graph.placeholder(f"{source.name}_{record.to_dtype}")
        last.meta["example_value"] = node.meta["example_value"]
        node.replace_all_uses_with(last)
        gm.graph.erase_node(node)
        record.reason += "; inference: cast once and cached until the parameter changes"
        lifted.append(CachedCast(index, dtype(last), example=node.meta["example_value"]))
    if lifted:
        _count_optimizer_steps()
    gm.recompile()
    return gm, lifted


def _copy_of(gm: fx.GraphModule) -> fx.GraphModule:
    """A plain GraphModule with the same nodes: no dynamo metadata, so aot_autograd asks nothing of
    its (new) inputs beyond their example values."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def _is_inference(example_inputs) -> bool:
    """What aot_autograd compiles as an inference graph: grad disabled, or nothing requires it."""
    return not torch.is_grad_enabled() or not any(isinstance(t, torch.Tensor) and t.requires_grad
                                                  for t in example_inputs)


def with_cached_casts(compiled, cached: list[CachedCast]):
    """The compiled graph, called with the cached parameter casts appended to its inputs."""
    @functools.wraps(compiled)
    def call(*args):
        boxed = len(args) == 1 and isinstance(args[0], list)
        flat = list(args[0] if boxed else args)
        flat += [c.get(flat[c.index]) for c in cached]
        return compiled(flat) if boxed else compiled(*flat)
    return call
