"""The cross-entropy gradient written over the logits where nothing else reads them after it.

An LM's logits ([tokens, vocabulary]: 4 GiB at 16K x 128K in bf16) are saved by the forward for the
cross-entropy backward, which makes a gradient just as large: at that node both are alive, two [N, V]
buffers for one loss. Where the saved logits are a buffer aot_autograd lets the backward consume (a
"donated" buffer: made by the forward, not a view of an input, of a returned value or of another
saved tensor, so only autograd's saved slot holds it; aot.donated_backward_inputs) and the
cross-entropy backward is their last reader in the graph, the node becomes
`cross_entropy_backward_over_logits`, which writes the gradient into the logits' own memory. Whether
one call may do so is decided when it runs (losses/cross_entropy_op.overwrite_allowed): not inside a
`retain_graph=True` or `create_graph=True` backward, whose saved logits are read again; there it
makes a new tensor, as before.

Left alone: graphs replayed as CUDA graphs (a capture would fix one call's decision for every replay),
logits that are graph inputs the caller owns (a leaf's gradient must be a new tensor), non-contiguous
logits (the gradient is contiguous), logits read by a later node, and logits whose memory another input
of the backward graph views (torch does not check saved tensors against each other).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..analysis.aliasing import storage_key, views_of
from ..analysis.symbolic import row_major_strides, sizes, strides
from ..losses.cross_entropy_op import cross_entropy_backward_op, cross_entropy_backward_over_logits
from ..pass_manager import PassContext, PassResult

BACKWARD_OP = cross_entropy_backward_op._opoverload  # torch.ops.fxopt.cross_entropy_backward.default


class GradientOverLogits:
    name = "grad_over_logits"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        if ctx.graph_name != "backward" or ctx.options.cudagraphs or not ctx.donated:
            return PassResult(gm, False)
        position = {n: i for i, n in enumerate(gm.graph.nodes)}
        moved = 0
        for n in gm.graph.find_nodes(op="call_function", target=BACKWARD_OP):
            logits = n.args[1]
            if _consumable(logits, n, ctx.donated, position) and not _shares_storage(gm, logits):
                n.target = cross_entropy_backward_over_logits
                moved += 1
        if moved:
            gm.recompile()
        return PassResult(gm, bool(moved), {"gradients_over_logits": moved})


def _consumable(logits, node: fx.Node, donated: frozenset, position: dict) -> bool:
    """A donated placeholder, contiguous (its strides those of its sizes, compared as expressions: no size
    guard asked), that no node after `node` reads, directly or through a view made before it (CSE
    leaves one `permute(logits)` ahead of the loss's backward for two matmuls after it)."""
    val = logits.meta.get("val") if isinstance(logits, fx.Node) else None
    return (isinstance(val, torch.Tensor) and logits.op == "placeholder" and logits.name in donated
            and strides(val) == row_major_strides(sizes(val))
            and all(position[u] <= position[node] for v in views_of(logits) for u in v.users))


def _shares_storage(gm: fx.GraphModule, logits: fx.Node) -> bool:
    """Whether another input of the graph views the logits' memory: torch's donated buffers are checked
    against the forward's inputs and outputs only, not against each other, so a view of an attention
    output saved as the loss's logits is donated beside the output itself, which the attention backward
    still reads after the loss's backward (it read the gradient there: a wrong dq, dk, dv)."""
    mine = _storage(logits)
    others = [_storage(p) for p in gm.graph.find_nodes(op="placeholder") if p is not logits]
    return mine is None or any(other is not None and other == mine for other in others)


def _storage(node: fx.Node):
    return storage_key(node.meta.get("val"))  # (None, a tensor without storage: never treated as unshared)
