"""Fuse an LM head with its loss: F.cross_entropy(hidden @ weight.T, target) -> fxopt::linear_cross_entropy.

Runs on the torch-level graph before FuseCrossEntropy (which takes the losses this pass leaves). The
fused op (losses/linear_cross_entropy.py) never holds the [N, V] logits: it computes them a chunk of
rows at a time together with the gradients of hidden and weight, so a 16K x 128K bf16 head's loss
holds one 2 GiB chunk instead of 4 GiB of logits (and, in eager, 4 GiB of their gradient and 4 GiB of
log-probabilities).

Matched: a loss FuseCrossEntropy would fuse (passes/cross_entropy.match_loss: F.cross_entropy or
nll_loss(log_softmax), an fp32 up-cast folded) whose logits, with the classes last and optionally
flattened to [rows, V] by a view, are
  - F.linear(hidden, weight) / nn.Linear without bias, or
  - hidden @ W2 (operator.matmul, torch.matmul, the method) where W2 is weight.t(), weight.T,
    weight.transpose(0, 1) or weight.permute(1, 0) of a 2-D weight;
read by nothing but the loss. Left to FuseCrossEntropy, with the reason noted: reduction="none" (each
row's upstream gradient is only known in the backward), float16 (see the op's DTYPES), a bias, logits
read elsewhere (returned, or a second loss), hidden and weight of different dtypes (autocast), or a
hidden state that is not [..., D] rows.

The gradients are made in the forward for the inputs the graph computes gradients of (their example
values' requires_grad, with grad mode on: dynamo guards on both), none under torch.no_grad.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..analysis.mutations import returns_its_input
from ..analysis.torch_ops import arg, dtype, functorch_transform_inside, meta, op_of, permute_dims, shape
from ..losses.linear_cross_entropy import DTYPES, GRAD_HIDDEN, GRAD_WEIGHT, REDUCTIONS, linear_cross_entropy_op
from ..pass_manager import PassContext, PassResult
from .cross_entropy import LossSite, NotFusable, check_moved_reads, is_loss_call, is_view, match_loss
from .graph_edit import erase_unused

FUSED_OP = linear_cross_entropy_op._opoverload  # torch.ops.fxopt.linear_cross_entropy.default


class NotAHead(Exception):
    """The loss's logits are not a head's matmul: nothing to say, the plain loss fusion takes it."""


def _is_linear(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch._C._nn.linear


def _transposed_weight(node) -> fx.Node | None:
    """W for W.t(), W.T, W.transpose(0, 1) / (-1, -2), W.permute(1, 0) of a 2-D W; else None."""
    if not isinstance(node, fx.Node) or len(shape(node) or ()) != 2:
        return None
    src = node.args[0] if node.args else None
    if (node.op == "call_method" and node.target == "t") or (node.op == "call_function" and node.target is torch.t):
        return src
    if node.op == "call_function" and node.target is getattr and node.args[1] in ("T", "mT"):
        return src
    op = op_of(node)
    if op == "transpose" and len(node.args) >= 3 and {d % 2 for d in node.args[1:3] if isinstance(d, int)} == {0, 1}:
        return src
    if op == "permute":
        return src if permute_dims(node, 2) == [1, 0] else None
    return None


def _flattens_rows(node) -> bool:
    """A view/reshape that keeps the last (class) dim: [B, T, V] -> [B * T, V]."""
    src = arg(node, 0, "input") if is_view(node) else None
    return isinstance(src, fx.Node) and bool(shape(src)) and bool(shape(node)) and shape(src)[-1] == shape(node)[-1]


def head_of(site: LossSite) -> tuple[fx.Node, fx.Node, list[fx.Node]]:
    """(hidden, weight, nodes made dead) of the head whose logits the loss reads; NotAHead where the
    logits are no head's matmul, NotFusable where they are but the op cannot take them."""
    logits, dead = site.logits, []
    if site.class_dim != len(shape(logits) or ()) - 1:
        raise NotAHead()
    for n in site.chain[1:]:  # what match_loss looked through (an fp32 up-cast, a view) is the loss's alone
        if len(n.users) != 1:
            raise NotFusable(f"the logits ({n.name}) are read outside the loss")
    while _flattens_rows(logits) or returns_its_input(logits):  # logits.view(-1, V), logits.float() of fp32 logits
        if len(logits.users) != 1:
            raise NotFusable(f"the logits ({logits.name}) are read outside the loss")
        dead.append(logits)
        logits = arg(logits, 0, "input")
    if _is_linear(logits):
        hidden, weight, bias = arg(logits, 0, "input"), arg(logits, 1, "weight"), arg(logits, 2, "bias")
        if bias is not None:
            raise NotFusable("the head has a bias")
    elif op_of(logits) == "matmul" and _transposed_weight(arg(logits, 1, "other")) is not None:
        hidden, weight = arg(logits, 0, "input"), _transposed_weight(arg(logits, 1, "other"))
        dead.append(arg(logits, 1, "other"))
    else:
        raise NotAHead()
    if len(logits.users) != 1:
        raise NotFusable(f"the logits ({logits.name}) are read outside the loss")
    h, w = meta(hidden), meta(weight)
    if not isinstance(h, torch.Tensor) or not isinstance(w, torch.Tensor) or w.dim() != 2 or h.dim() < 2:
        raise NotFusable("hidden is not [..., D] rows or weight is not a [V, D] matrix")
    if h.dtype == w.dtype == torch.float16:
        raise NotFusable("float16: gradients made in the forward, before any loss scaling, would underflow")
    if h.dtype != w.dtype or h.dtype not in DTYPES or dtype(logits) != h.dtype:
        raise NotFusable(f"hidden {h.dtype}, weight {w.dtype}, logits {dtype(logits)}: the op takes one dtype of "
                         f"{DTYPES} (autocast's mixed dtypes are not fused)")
    if h.device != w.device:
        raise NotFusable(f"hidden on {h.device}, weight on {w.device}")
    check_moved_reads([logits, *dead], site.out, [hidden, weight])
    return hidden, weight, [logits, *dead]


def gradient_bits(loss_requires_grad: bool, hidden: fx.Node, weight: fx.Node) -> int:
    """Which gradients the op makes: those autograd will ask for (none when the loss needs none: grad
    mode off where the loss is computed)."""
    if not loss_requires_grad:
        return 0
    return (GRAD_HIDDEN if meta(hidden).requires_grad else 0) | (GRAD_WEIGHT if meta(weight).requires_grad else 0)


def rewrite(gm: fx.GraphModule, site: LossSite, hidden: fx.Node, weight: fx.Node, dead: list[fx.Node]) -> fx.Node:
    graph = gm.graph
    grads = gradient_bits(bool(getattr(meta(site.out), "requires_grad", False)), hidden, weight)
    with graph.inserting_before(site.out):
        rows = hidden
        if len(shape(hidden)) != 2:
            rows = graph.call_method("reshape", (hidden, -1, shape(hidden)[-1]))
        target = site.target if len(shape(site.target)) == 1 else graph.call_method("reshape", (site.target, -1))
        fused = graph.call_function(FUSED_OP, (rows, weight, target, site.ignore_index, site.reduction,
                                               dtype(site.out), grads))
        loss = graph.call_function(operator.getitem, (fused, 0))
    site.out.replace_all_uses_with(loss)
    erase_unused(graph, [*site.chain, *dead])
    return fused


class FuseLinearCrossEntropy:
    """Pre-autograd pass: cross_entropy(hidden @ weight.T) -> torch.ops.fxopt.linear_cross_entropy."""

    name = "fuse_linear_cross_entropy"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        fused = 0
        if functorch_transform_inside(gm):
            return PassResult(gm, False, {"fused": 0})  # FuseCrossEntropy notes why neither fuses
        for node in list(gm.graph.nodes):
            if not is_loss_call(node):
                continue
            try:
                site = match_loss(node)
            except NotFusable:
                continue  # FuseCrossEntropy notes why
            try:
                hidden, weight, dead = head_of(site)
                if site.reduction not in REDUCTIONS:
                    raise NotFusable(f"reduction={site.reduction!r} (each row's gradient comes in the backward)")
            except NotAHead:
                continue
            except NotFusable as why:
                ctx.note(node.name, f"LM head not fused with its loss: {why}")
                continue
            rewrite(gm, site, hidden, weight, dead)
            fused += 1
        return PassResult(gm, fused > 0, {"fused": fused})
