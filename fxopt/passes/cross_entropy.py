"""Find cross-entropy losses and replace them with fxopt's fused op (fxopt::cross_entropy).

Runs on the torch-level graph dynamo captured, before aot_autograd, so autograd sees one
`fxopt::cross_entropy` node and derives one `fxopt::cross_entropy_backward` node from it: no
log_softmax [N, V] and no gradient of it are ever materialised.

Recognised spellings:
  - F.cross_entropy(x, target, ...) (nn.CrossEntropyLoss inlines to it);
  - F.nll_loss(log_softmax(x, dim), target, ...), log_softmax as F.log_softmax, torch.log_softmax or
    the method, used only by the nll_loss, optionally through a view/reshape to [M, V];
  - on either, an up-cast of bf16/fp16 logits to float32 (`x.float()`, `log_softmax(x, dtype=float32)`)
    is folded away: the kernels compute in float32 and write the gradient in the logits' dtype, which
    is what eager's cast-then-loss gives, without the float32 copies.
Layouts: x [N, C] with target [N]; x [N, C, d1, ...] (classes in dim 1, torch's convention) with
target [N, d1, ...] when moving the classes last and flattening is a view (e.g. the input is
`logits.transpose(1, 2)` of [B, T, V] logits); the op then sees [N * d1 * ..., C].

Left as they are, with the reason noted (ctx.note): class weights, label smoothing, probability
(float) targets, legacy size_average/reduce arguments, targets that are not int64, unbatched input,
logits whose layout would need a copy, other dtypes and devices.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..analysis.mutations import written_between
from ..analysis.torch_ops import (LOW_FLOATS, arg, dtype, functorch_transform_inside, grad_enabled_at, meta,
                                  provably_equal, shape, upcast_source)
from ..losses.cross_entropy_op import REDUCTIONS, cross_entropy_op
from ..pass_manager import PassContext, PassResult
from .graph_edit import erase_unused

FUSED_OP = cross_entropy_op._opoverload  # torch.ops.fxopt.cross_entropy.default
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
VIEW_METHODS = ("view", "reshape")


class NotFusable(Exception):
    """A loss the fused op does not compute exactly; the message says why."""


@dataclass
class LossSite:
    """What one loss computes, in the fused op's terms."""

    out: fx.Node  # the loss node whose uses the fused op takes over
    logits: fx.Node  # the tensor the op reads, after layout changes (below)
    class_dim: int  # where the classes are in `logits` (moved last when not already)
    target: fx.Node
    ignore_index: int
    reduction: str
    chain: list[fx.Node] = field(default_factory=list)  # nodes the fused op makes dead


def _is_cross_entropy(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is F.cross_entropy


def _is_nll_loss(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is F.nll_loss


def is_loss_call(node: fx.Node) -> bool:
    """F.cross_entropy or F.nll_loss: what match_loss reads."""
    return _is_cross_entropy(node) or _is_nll_loss(node)


def _is_log_softmax(node) -> bool:
    if not isinstance(node, fx.Node):
        return False
    return (node.op == "call_function" and node.target in (F.log_softmax, torch.log_softmax)) or \
        (node.op == "call_method" and node.target == "log_softmax")


def is_view(node) -> bool:
    """x.view(shape) / x.reshape(shape) / torch.reshape; not `x.view(dtype)`, which reinterprets the bits."""
    if not isinstance(node, fx.Node):
        return False
    if any(isinstance(a, torch.dtype) for a in (*node.args[1:], *node.kwargs.values())):
        return False
    return (node.op == "call_method" and node.target in VIEW_METHODS) or \
        (node.op == "call_function" and node.target is torch.reshape)


def _loss_arguments(node: fx.Node, smoothing: bool) -> tuple[int, str]:
    """(ignore_index, reduction) of F.cross_entropy / F.nll_loss, or NotFusable for what the op lacks.
    Signature: (input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)."""
    if arg(node, 2, "weight") is not None:
        raise NotFusable("class weights (weight=...): the fused op has none")
    if arg(node, 3, "size_average") is not None or arg(node, 5, "reduce") is not None:
        raise NotFusable("legacy size_average/reduce arguments")
    ignore_index = arg(node, 4, "ignore_index", -100)
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise NotFusable(f"ignore_index {ignore_index!r} is not a compile-time int")
    reduction = arg(node, 6, "reduction", "mean")
    if reduction not in REDUCTIONS:
        raise NotFusable(f"reduction {reduction!r} is not one of {REDUCTIONS}")
    if smoothing:
        smooth = arg(node, 7, "label_smoothing", 0.0)
        if not isinstance(smooth, (int, float)) or smooth != 0:
            raise NotFusable(f"label_smoothing={smooth!r} (the fused op computes plain cross-entropy)")
    return ignore_index, reduction


def _peel_upcast(node: fx.Node, site: LossSite) -> fx.Node:
    """node, or the tensor under its up-cast (the cast joins the nodes the fused op makes dead)."""
    src = upcast_source(node)
    if src is None:
        return node
    site.chain.append(node)
    return src


def _through_upcast(loss_input: fx.Node, site: LossSite) -> tuple[fx.Node, int]:
    """cross_entropy's logits and their class dim: `x.float()` folds to x; so does
    `x.float().view(-1, V)` (the cast under a flattening view), which becomes x with its classes last."""
    if is_view(loss_input) and len(loss_input.users) == 1:
        src = upcast_source(arg(loss_input, 0, "input"))
        flat, x = shape(loss_input), shape(src) if src is not None else ()
        if src is not None and len(flat) == 2 and len(x) >= 2 and flat[1] == x[-1]:
            site.chain += [loss_input, arg(loss_input, 0, "input")]
            return src, len(x) - 1
    return _peel_upcast(loss_input, site), 1


def _log_softmax_arguments(node: fx.Node) -> tuple[int | None, torch.dtype | None]:
    """(dim, dtype) of F.log_softmax(x, dim, _stacklevel, dtype), torch.log_softmax(x, dim, dtype) or
    x.log_softmax(dim, dtype)."""
    dtype_at = 3 if node.target is F.log_softmax else 2
    return arg(node, 1, "dim"), arg(node, dtype_at, "dtype")


def _through_log_softmax(nll_input: fx.Node, site: LossSite) -> tuple[fx.Node, int]:
    """From nll_loss's input up to the logits: (logits node, class dim of the logits)."""
    view = None
    node = nll_input
    if is_view(node):
        view, node = node, arg(node, 0, "input")
    if not _is_log_softmax(node):
        raise NotFusable("the nll_loss input is not a log_softmax (or a view of one)")
    for n in (view, node):
        if n is not None and len(n.users) != 1:
            raise NotFusable(f"the log-probabilities ({n.name}) are used outside the loss")
    x = arg(node, 0, "input")
    dim, out_dtype = _log_softmax_arguments(node)
    rank = len(shape(x) or ())
    if not isinstance(dim, int) or rank == 0:
        raise NotFusable(f"log_softmax over dim {dim!r}")
    dim %= rank
    site.chain.extend(n for n in (view, node) if n is not None)
    if view is not None:
        if dim != rank - 1 or len(shape(view)) != 2 or shape(view)[1] != shape(x)[-1]:
            raise NotFusable(f"log_softmax over dim {dim} viewed as {list(shape(view))}: "
                             "not [rows, classes] with the classes last")
    elif dim != min(1, rank - 1):
        raise NotFusable(f"log_softmax over dim {dim}, but nll_loss reads the classes from dim 1")
    if out_dtype is not None and out_dtype != dtype(x):
        if out_dtype != torch.float32 or dtype(x) not in LOW_FLOATS:
            raise NotFusable(f"log_softmax(dtype={out_dtype}) of {dtype(x)} logits")
        return x, dim  # log_softmax(x, dtype=float32): the up-cast is folded like x.float()
    return _peel_upcast(x, site), dim


def _check_tensors(site: LossSite, loss_input: fx.Node) -> None:
    """Dtypes, devices and shapes the op takes, and a layout it can read without copying the logits."""
    x, t = meta(site.logits), meta(site.target)
    if not isinstance(x, torch.Tensor) or not isinstance(t, torch.Tensor):
        raise NotFusable("logits or target has no recorded tensor value")
    if t.dtype.is_floating_point:
        raise NotFusable("probability (float) targets: the fused op takes class indices")
    if t.dtype != torch.int64:
        raise NotFusable(f"target dtype {t.dtype} (the fused op reads int64 class indices)")
    if x.dtype not in DTYPES:
        raise NotFusable(f"logits dtype {x.dtype}: the fused op takes one of fp32, bf16, fp16")
    symbolic = not all(isinstance(d, int) for d in (*x.shape, *t.shape))
    if symbolic and (x.dim() != 2 or site.class_dim != 1):  # the kernels read the class count per call
        raise NotFusable("symbolic (dynamic) shapes other than [rows, classes] logits")
    if x.device.type not in ("cuda", "cpu") or t.device != x.device:
        raise NotFusable(f"logits on {x.device}, target on {t.device}")
    loss_shape = shape(loss_input)
    if len(loss_shape) < 2:
        raise NotFusable("unbatched input (one row of classes and a 0-d target)")
    if not provably_equal(tuple(t.shape), loss_shape[:1] + loss_shape[2:]):
        raise NotFusable(f"target {list(t.shape)} does not match input {list(loss_shape)} without its class dim")
    if x.dim() > 2 or site.class_dim != x.dim() - 1:
        _check_rows_are_a_view(x, site.class_dim)


def _check_rows_are_a_view(x: torch.Tensor, class_dim: int) -> None:
    """[.., C, ..] -> [rows, C] must not copy: that copy is the [N, V] buffer this op exists to avoid."""
    probe = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    try:
        rows = probe.movedim(class_dim, -1).view(-1, x.shape[class_dim])
    except RuntimeError:
        rows = None
    if rows is None or (x.shape[class_dim] > 1 and rows.stride(1) != 1):
        raise NotFusable(f"logits {list(x.shape)} strides {list(x.stride())}: moving the classes (dim "
                         f"{class_dim}) last as [rows, classes] rows would copy the logits")


def match_loss(node: fx.Node) -> LossSite:
    """The LossSite of an F.cross_entropy / F.nll_loss(log_softmax) call, or NotFusable(reason)."""
    is_ce = _is_cross_entropy(node)
    ignore_index, reduction = _loss_arguments(node, smoothing=is_ce)
    loss_input, target = arg(node, 0, "input"), arg(node, 1, "target")
    if not isinstance(loss_input, fx.Node) or not isinstance(target, fx.Node):
        raise NotFusable("input or target is not a tensor of the graph")
    site = LossSite(out=node, logits=loss_input, class_dim=1, target=target, ignore_index=ignore_index,
                    reduction=reduction, chain=[node])
    if is_ce:
        site.logits, site.class_dim = _through_upcast(loss_input, site)
    else:
        site.logits, site.class_dim = _through_log_softmax(loss_input, site)
    _check_tensors(site, loss_input)
    check_moved_reads(site.chain[1:], site.out, [site.logits])
    return site


def check_moved_reads(looked_through: list[fx.Node], at: fx.Node, read: list[fx.Node]) -> None:
    """NotFusable where the fused op, placed at `at`, would not see what the nodes it replaces saw:
    `read` (what it reads) written in place after the first of `looked_through` (a log_softmax, a cast,
    a head's matmul, now computed at `at`), or one of those nodes made under torch.no_grad() (or detached)
    from inputs that require grad, where eager lets no gradient through."""
    if not looked_through:
        return
    first = min(looked_through, key=_position)
    writer = written_between(first, at, read)
    if writer is not None:
        raise NotFusable(f"{writer.name} writes the loss's input in place after {first.name} read it")
    if not grad_enabled_at(at):  # the fused op records no gradient there either
        return
    for n in looked_through:
        if _stops_gradients(n):
            raise NotFusable(f"{n.name} is made under torch.no_grad(): no gradient flows through it")


def _position(node: fx.Node) -> int:
    return list(node.graph.nodes).index(node)


def _stops_gradients(node: fx.Node) -> bool:
    """An op whose result needs no gradient though an input does: made with grad mode off (dynamo's
    example value of a view under no_grad can still say requires_grad, so the mode is read from the
    graph's `_set_grad_enabled` calls too)."""
    out = meta(node)
    needs = any(isinstance(meta(a), torch.Tensor) and meta(a).requires_grad for a in node.all_input_nodes)
    return needs and (not grad_enabled_at(node) or (isinstance(out, torch.Tensor) and not out.requires_grad))


def rewrite(gm: fx.GraphModule, site: LossSite) -> fx.Node:
    """Insert the fused op before the loss node and hand it the loss node's uses."""
    graph = gm.graph
    x_shape, t_shape = shape(site.logits), shape(site.target)
    with graph.inserting_before(site.out):
        logits = site.logits
        if site.class_dim != len(x_shape) - 1:
            logits = graph.call_method("movedim", (logits, site.class_dim, -1))
        if len(x_shape) != 2:
            logits = graph.call_method("reshape", (logits, -1, x_shape[site.class_dim]))
        target = site.target if len(t_shape) == 1 else graph.call_method("reshape", (site.target, -1))
        # the loss in the dtype F.cross_entropy returns (computed in float32): no cast node after the
        # op, and none for its gradient in the backward
        fused = graph.call_function(FUSED_OP, (logits, target, site.ignore_index, site.reduction, dtype(site.out)))
        loss = graph.call_function(operator.getitem, (fused, 0))
        if site.reduction == "none" and len(t_shape) != 1:
            loss = graph.call_method("reshape", (loss, *t_shape))
    site.out.replace_all_uses_with(loss)
    erase_unused(graph, site.chain)
    return fused


class FuseCrossEntropy:
    """Pre-autograd pass: F.cross_entropy and nll_loss(log_softmax) -> torch.ops.fxopt.cross_entropy."""

    name = "fuse_cross_entropy"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        fused = unfused = 0
        if functorch_transform_inside(gm):
            ctx.note("(graph)", "cross-entropy not fused: a torch.func transform is inside the graph (fxopt's op has "
                     "no functorch rules)")
            return PassResult(gm, False, {"fused": 0, "unfused": 0})
        for node in list(gm.graph.nodes):
            if not is_loss_call(node):
                continue
            try:
                site = match_loss(node)
            except NotFusable as why:
                ctx.note(node.name, f"cross-entropy not fused: {why}")
                unfused += 1
                continue
            rewrite(gm, site)
            fused += 1
        return PassResult(gm, fused > 0, {"fused": fused, "unfused": unfused})
