"""fxopt's own ops (attention, cross-entropy, the LM head's loss) run as their torch-op references.

Each own op has two implementations: Triton kernels, and the same contract in plain torch ops (what CPU
graphs without the interpreter run). Kernels carry no forward-mode tangent, and the custom-op boundary
has neither a forward-AD rule nor functorch batching rules, so where a call needs those (a forward-AD
level, a torch.func transform, batched gradients) compile.py runs `reference_graph(gm)`: the graph with
every own-op node calling the op's Python implementation directly, inside `torch_ops_only()`, where
each implementation takes its torch-op path. Every op in it is then one autograd, forward AD and
functorch know. (So is `mm.dtype`, the fp32-output matmul passes/matmul_casts.py makes on CUDA, which
has no forward-AD formula: it becomes `mm_widened`.)
"""
from __future__ import annotations

import contextlib
import os
import threading

import torch
import torch.fx as fx

_state = threading.local()


def active() -> bool:
    """Whether own ops must run their torch-op references on this thread."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def torch_ops_only():
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def kernels_serve(t) -> bool:
    """Whether fxopt's Triton kernels run for tensor t: CUDA, or CPU under TRITON_INTERPRET=1; never
    inside torch_ops_only(). Each own op's `_on_triton` asks this first."""
    if active():
        return False
    return t.is_cuda or (t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1")


# own-op variants whose reference is another function's (writing over the logits is the kernels' job)
_SAME_REFERENCE = {"cross_entropy_backward_over_logits": "cross_entropy_backward"}


def mm_widened(a, b, out_dtype):
    """aten.mm.dtype (passes/matmul_casts.py: cuBLAS writes its fp32 accumulator) in ops with a
    forward-AD formula: the operands widened, then an ordinary mm."""
    return torch.mm(a.to(out_dtype), b.to(out_dtype))


def _reference_of(n: fx.Node):
    """The function a reference graph calls for node n, or None to keep it."""
    from .codegen import direct_calls
    from .codegen.wrapper import own_op_callee

    if n.op != "call_function":
        return None
    if n.target is torch.ops.aten.mm.dtype:
        return mm_widened
    name = own_op_callee(n)
    return getattr(direct_calls, _SAME_REFERENCE.get(name, name)) if name else None


def reference_graph(gm: fx.GraphModule) -> fx.GraphModule | None:
    """A copy of gm whose own-op nodes call their implementations (codegen/direct_calls.py) instead of
    the custom ops, and whose `mm.dtype` calls are `mm_widened`; None where gm has neither (gm serves)."""
    if not any(_reference_of(n) for n in gm.graph.nodes):
        return None
    graph = _copied(gm.graph)
    for n in graph.nodes:
        reference = _reference_of(n)
        if reference is not None:
            n.target = reference
    return fx.GraphModule(gm, graph)  # (takes the submodules, the fused groups, the graph names)


def _copied(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    out = new.graph_copy(graph, {})
    new.output(out)
    return new
