"""logsumexp of a bf16/fp16 tensor is computed on its float32 up-cast, then rounded back.

Autograd's logsumexp backward is `grad * exp(x - result)`, with `result` the saved, rounded output. Eager
rounds every op, so its `x` is the rounded tensor and `x - result` is exact for the largest element. A
fused kernel holds 16-bit values in fp32 and rounds them only where it stores them, and the partitioner
recomputes a cheap producer of `x` (`logits * scale`) in the backward instead of saving it: that `x`
came out unrounded while `result` was rounded, so `x - result` was off by up to half a unit of `result`'s
last place and the gradient by that factor's exponential: up to e^4 for fp16 values near 1e4 (measured),
up to 6% by the same arithmetic for bf16 values near 20 (a z-loss over temperature-scaled logits; found
by `benchmarks/edge_sweep.py --family rows`). On the up-cast the result is saved in float32 and `x` is a
cast, which every kernel reads rounded (codegen/operand_rounding.py), so forward and backward agree. The forward value is eager's
(its kernel computes in float32 and rounds once); the gradient is at least as accurate.

Runs on the torch-level graph dynamo captured, before aot_autograd, so autograd derives the fp32
backward. `torch.logsumexp(x, dim, keepdim)` and `x.logsumexp(...)`; an `out=` call is left alone.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..analysis.torch_ops import LOW_FLOATS, dtype
from ..pass_manager import PassContext, PassResult
from .example_values import fake_mode, run_on_fakes

_FUNCTIONS = (torch.logsumexp, torch.special.logsumexp)


def _is_logsumexp(node: fx.Node) -> bool:
    return ((node.op == "call_function" and node.target in _FUNCTIONS)
            or (node.op == "call_method" and node.target == "logsumexp")) and "out" not in node.kwargs


class UpcastLogsumexp:
    name = "upcast_logsumexp"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph, mode = gm.graph, fake_mode(gm)
        changed = 0
        for node in list(graph.nodes):
            if not _is_logsumexp(node) or not node.args or dtype(node.args[0]) not in LOW_FLOATS:
                continue
            x, low = node.args[0], dtype(node.args[0])
            with graph.inserting_before(node):
                up = graph.call_method("to", (x, torch.float32))
            node.args = (up, *node.args[1:])
            with graph.inserting_after(node):
                down = graph.call_method("to", (node, low))
            node.replace_all_uses_with(down, delete_user_cb=lambda user: user is not down)
            if mode is not None:
                for n in (up, node, down):
                    n.meta["example_value"] = run_on_fakes(n, mode)
            changed += 1
        if changed:
            gm.recompile()
        return PassResult(gm, bool(changed), {"logsumexp_upcast": changed})
