"""fxopt's own ops (attention, cross-entropy, the LM head's loss) run as their torch-op references.

Each own op has two implementations: Triton kernels, and the same contract in plain torch ops (what CPU
graphs without the interpreter run). Kernels carry no forward-mode tangent, and the custom-op boundary
has neither a forward-AD rule nor functorch batching rules, so where a call needs those (a forward-AD
level, a torch.func transform, batched gradients) compile.py runs `reference_graph(gm)`: the graph with
every own-op node calling the op's Python implementation directly, inside `torch_ops_only()`, where
each implementation takes its torch-op path. Every op in it is then one autograd, forward AD and
functorch know.
"""
from __future__ import annotations

import contextlib
import threading

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


# own-op variants whose reference is another function's (writing over the logits is the kernels' job)
_SAME_REFERENCE = {"cross_entropy_backward_over_logits": "cross_entropy_backward"}


def reference_graph(gm: fx.GraphModule) -> fx.GraphModule | None:
    """A copy of gm whose own-op nodes call their implementations (codegen/direct_calls.py) instead of
    the custom ops; None where gm has none (gm itself serves)."""
    from .codegen import direct_calls
    from .codegen.wrapper import own_op_callee

    if not any(n.op == "call_function" and own_op_callee(n) for n in gm.graph.nodes):
        return None
    graph = _copied(gm.graph)
    for n in graph.nodes:
        name = own_op_callee(n) if n.op == "call_function" else None
        if name:
            n.target = getattr(direct_calls, _SAME_REFERENCE.get(name, name))
    return fx.GraphModule(gm, graph)  # (takes the submodules, the fused groups, the graph names)


def _copied(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    out = new.graph_copy(graph, {})
    new.output(out)
    return new
