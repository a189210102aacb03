"""Turn the masking steps of a hand-written attention into facts the fused kernel can use.

A score chain applies masks in three spellings: `s.masked_fill(cond, v)`, `torch.where(cond, s, v)`
and `s + m`. Masks whose value is known at compile time (built from constants or module buffers) are
evaluated and compared with the causal pattern; when they equal it, the kernel gets `causal=True` and
reads no mask at all. A mask that depends on the model's inputs (a padding mask) becomes the kernel's
additive mask operand. A compile-time bias linear in the key index (ALiBi) becomes per-head slopes the
kernel computes the bias from (position_slopes.py). Anything else is refused with the reason, and the
site stays unfused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from .built_masks import built_causal
from .position_slopes import linear_key_slopes
from .sliced_masks import sliced_causal
from .torch_ops import meta

# A masked score must vanish after exp(): -inf does exactly; so does any value at or below fp16's
# lowest finite value (-65504), as long as the row keeps one unmasked score (true for causal rows).
MASKED_AT_MOST = -65504.0
# A finite fill at or below MASKED_AT_MOST *replaces* scores, the kernels *add* their mask: the mask they read
# holds fp32's finfo.min for it, whose sum with any score is itself, which the kernels drop as eager's
# equal fills (mask_tiles.add_mask): a row masked everywhere so is the uniform average, as in eager, and
# elsewhere such keys weigh nothing, as in eager (a fill kept as -65504 was added to the scores)
FOLDED_FILL = float(torch.finfo(torch.float32).min)


class NotAttention(Exception):
    """The site cannot be fused; the message says why (shown in rep.attention)."""


class NotACausalMask(NotAttention):
    """A compile-time additive mask that holds finite non-zero values (a position bias such as ALiBi):
    no fact to fold, but the kernel can read it like an input-dependent mask."""


@dataclass
class MaskStep:
    kind: str  # "fill": scores set to `value` where `cond` is True | "add": scores + `tensor`
    tensor: object  # cond (fill) or the additive mask (add): an fx.Node or a constant
    value: float = 0.0  # fill value
    after_scale: bool = False  # a scale step comes after this one (between it and the softmax)
    negate: bool = False  # fill where `cond` is False (torch.where(keep, scores, value))


@dataclass
class MaskFacts:
    causal: bool = False
    runtime_mask: fx.Node | None = None  # additive mask the kernel loads
    runtime_fill: MaskStep | None = None  # an input-dependent fill (-inf, or FOLDED_FILL), read as the kernel's mask
    finite_runtime_fill: float | None = None  # that fill's value where finite (finfo.min; see FOLDED_FILL)
    buffers: tuple = ()  # module buffers the causal fact or the slopes were read from (guarded at run time)
    key_slopes: torch.Tensor | None = None  # float64 [heads or 1]: a linear position bias (ALiBi) for the kernel
    safe_softmax: bool = False  # SDPA's: a row masked entirely is 0, not NaN (attention/op.py)
    # a causal step with a finite fill beside the input-dependent mask, whether it applies first, and the one
    # value of its masked entries where known (None: an additive causal tensor read with the mask), for the
    # kernel to fold into the mask it reads (fold_finite_causal)
    folded_causal: tuple[MaskStep, bool, float | None] | None = None
    described: str = "none"


def causal_keep(seq_q: int, seq_k: int) -> torch.Tensor:
    return torch.ones(seq_q, seq_k, dtype=torch.bool).tril(seq_k - seq_q)


def _scalar(value) -> float | None:
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    return None


def _keep_of_step(step: MaskStep, values, score_shape, node) -> torch.Tensor:
    """Where a constant mask step keeps the score, broadcast to the scores' shape."""
    value = values.value(step.tensor)
    try:
        return _keep(step, value, score_shape)
    except RuntimeError as e:  # a dim of the mask where the scores' dim is symbolic (evaluated as 1)
        name = node.name if isinstance(node, fx.Node) else "a constant"
        raise NotAttention(f"the compile-time mask {name} {list(torch.as_tensor(value).shape)} does not broadcast "
                           f"to the scores {list(score_shape)} ({e})") from None


def over_scores(tensor: torch.Tensor, score_shape) -> torch.Tensor:
    """`tensor` broadcast to the scores' query and key dims only: the batch and head dims keep the
    mask's own sizes (usually 1). A RuntimeError if it does not broadcast to `score_shape`. Expanded to
    the whole [batch, heads, q, k] a GPT-2 block's causal check built and compared 268M booleans at
    compile time (B16 H16 T1024: ~0.4 s of its first call)."""
    if torch.broadcast_shapes(tensor.shape, score_shape) != torch.Size(score_shape):
        raise RuntimeError(f"shape {list(tensor.shape)} does not broadcast to {list(score_shape)}")
    own = [1] * (len(score_shape) - tensor.dim()) + list(tensor.shape)
    return tensor.reshape(own).expand(*own[:-2], *score_shape[-2:])


def _keep(step: MaskStep, value, score_shape) -> torch.Tensor:
    tensor = torch.as_tensor(value).cpu()
    # a scale applied after the mask scales its value too (-1e5 * 1e-5 = -1 drops nothing): then only -inf
    masked_at_most = -math.inf if step.after_scale else MASKED_AT_MOST
    if step.kind == "fill":
        if not step.value <= masked_at_most:  # (a NaN fill is not a mask: eager's rows become NaN)
            raise NotAttention(f"masked scores are filled with {step.value:g}, not -inf or a value <= "
                               f"{MASKED_AT_MOST:g}{' (before a scale)' if step.after_scale else ''}: exp() would "
                               "not drop them")
        masked = ~tensor.bool() if step.negate else tensor.bool()
        return over_scores(~masked, score_shape)
    _require_float_mask(tensor.dtype)
    additive = over_scores(tensor.float(), score_shape)
    kept = additive == 0
    if not bool(((additive <= masked_at_most) | kept).all()):
        raise NotACausalMask("a compile-time additive mask holds values other than 0 and -inf: not a causal "
                             "mask, and not a node the kernel can read")
    return kept


def _check_readable(step: MaskStep, facts: MaskFacts) -> None:
    """The kernel reads one additive mask, added to the already-scaled scores."""
    if facts.runtime_mask is not None or facts.runtime_fill is not None:
        raise NotAttention("more than one mask for the kernel to read (computed from the model's inputs, a "
                           "position bias, or a compile-time fill that is not causal)")
    if step.after_scale:
        raise NotAttention("the scale is applied after a mask the kernel reads (the kernel adds the mask to "
                           "already-scaled scores)")


def _require_float_mask(dtype: torch.dtype) -> None:
    if not dtype.is_floating_point:
        raise NotAttention(f"an additive mask of dtype {dtype} (adds 0 and 1): not a mask of -inf")


def check_runtime_mask(step: MaskStep, score_shape) -> None:
    """The kernel reads a float mask broadcast over the scores: a bool or integer tensor added to the
    scores, or a mask that broadcasts the scores to more batches or heads (eager's result grows), is not."""
    v = meta(step.tensor)
    if not isinstance(v, torch.Tensor):
        return
    if step.kind == "add":
        _require_float_mask(v.dtype)
    if all(isinstance(d, int) for d in (*v.shape, *score_shape)) and \
            torch.broadcast_shapes(v.shape, score_shape) != torch.Size(score_shape):
        raise NotAttention(f"the mask {list(v.shape)} broadcasts the scores {list(score_shape)} to a larger shape")


def _fill_read_by_the_kernel(constant_steps: list[MaskStep], keep: torch.Tensor, facts: MaskFacts) -> MaskStep:
    """A compile-time fill that is not causal (a sliding window, a block-diagonal pattern): the kernel
    reads it as an additive -inf mask. Equal to eager only where every row keeps a score (then a
    finfo.min fill and -inf both vanish after exp()), and only for one fill node the kernel can read."""
    step = constant_steps[0] if len(constant_steps) == 1 else None
    if step is None or step.kind != "fill" or not isinstance(step.tensor, fx.Node):
        raise NotAttention("a compile-time mask that is not causal (bottom-right aligned) and is not one fill "
                           "the kernel can read")
    _check_readable(step, facts)
    if not bool(keep.any(-1).all()):
        raise NotAttention("a compile-time mask that is not causal masks whole rows: eager's result there "
                           "depends on the fill value")
    return step


def _slopes_of(step: MaskStep, values, score_shape, facts: MaskFacts, requires_grad):
    """(slopes, keep) of a compile-time additive bias that is linear in the key index, or None (then the
    kernel reads the bias as a tensor). Its masked entries must keep every key or be causal: any other
    pattern stays with the tensor, which the kernel reads exactly."""
    if step.kind != "add" or step.after_scale or facts.key_slopes is not None or requires_grad(step.tensor):
        return None
    if not getattr(values, "takes_new_constants", False):  # the slopes would be a new constant of the graph
        return None
    if not all(isinstance(d, int) for d in score_shape[-3:]):
        return None
    own = over_scores(torch.as_tensor(values.value(step.tensor)).cpu(), score_shape)
    if own.dim() > 4:
        return None
    fitted = linear_key_slopes(own.reshape([1] * (4 - own.dim()) + list(own.shape)), MASKED_AT_MOST)
    if fitted is None or fitted[0].shape[0] not in (1, score_shape[-3]):
        return None
    slopes, kept = fitted
    keep = kept.all(1, keepdim=True).all(0, keepdim=True)
    if not bool((kept == keep).all()):
        return None
    if not (bool(keep.all()) or bool((keep == causal_keep(*score_shape[-2:])).all())):
        return None
    return slopes, keep


def _describe_buffers(buffers) -> str:
    return ", ".join(b.name for b in buffers) or "built in the graph"


def mask_facts(steps: list[MaskStep], values, score_shape, requires_grad) -> MaskFacts:
    """Fold the mask steps of one site into MaskFacts, or raise NotAttention with the reason."""
    facts = MaskFacts()
    # Only symbolic lengths stop a compile-time mask from being evaluated: one over a symbolic batch or
    # head count broadcasts over it, so it is evaluated with those dims 1.
    symbolic = not all(isinstance(d, int) for d in score_shape[-2:])
    if not symbolic:
        score_shape = tuple(d if isinstance(d, int) else 1 for d in score_shape)
    keep = torch.ones(() if symbolic else (1,) * (len(score_shape) - 2) + tuple(score_shape[-2:]), dtype=torch.bool)
    constant_steps, causal_steps, runtime_at = [], [], None
    for at, step in enumerate(steps):
        if values.is_constant(step.tensor) and symbolic:
            raise NotAttention("a compile-time mask with symbolic (dynamic) sizes: it cannot be evaluated once "
                               "for every size")
        keep_of = lambda v, s, step=step: _keep(step, v, s)  # noqa: E731
        if symbolic and built_causal(step.tensor, keep_of, values, score_shape):
            facts.causal, facts.described = True, "causal (a triangle built in the graph over the symbolic length)"
            causal_steps.append((at, step))
            continue
        sliced = sliced_causal(step.tensor, keep_of, values, score_shape) if symbolic else None
        if sliced is not None:  # a causal buffer sliced to the length: causal for every length
            facts.causal = True
            causal_steps.append((at, step))
            facts.buffers = tuple(dict.fromkeys(facts.buffers + sliced))
            facts.described = f"causal (from {_describe_buffers(facts.buffers)}, sliced to the length)"
            continue
        if values.is_constant(step.tensor):
            try:
                keep = keep & _keep_of_step(step, values, score_shape, step.tensor)
                constant_steps.append(step)
                causal_steps.append((at, step))
                continue
            except NotACausalMask:
                if not isinstance(step.tensor, fx.Node):
                    raise
                fitted = _slopes_of(step, values, score_shape, facts, requires_grad)
                if fitted is not None:  # ALiBi: computed in the kernel from one slope per head
                    facts.key_slopes, kept = fitted
                    if not bool(kept.all()):
                        keep = keep & kept.reshape(keep.shape)
                        constant_steps.append(step)
                    facts.buffers = tuple(dict.fromkeys(facts.buffers + tuple(values.buffers_used(step.tensor))))
                    continue
                # a position bias (ALiBi, a relative-position table): read by the kernel, like a
                # padding mask; the other constant steps may still make the site causal
        _check_readable(step, facts)
        check_runtime_mask(step, score_shape)
        runtime_at = at
        if step.kind == "add":
            _read_additive(facts, step.tensor, requires_grad)
        elif step.value == -math.inf:
            facts.runtime_fill = step
        elif step.value <= MASKED_AT_MOST:  # HF's masked_fill(~mask, finfo.min): see FOLDED_FILL
            facts.runtime_fill, facts.finite_runtime_fill = replace(step, value=FOLDED_FILL), step.value
        else:
            raise NotAttention(f"an input-dependent mask fills with {step.value:g}, not -inf or a value <= "
                               f"{MASKED_AT_MOST:g}: the masked keys weigh in eager")
    seq_q, seq_k = score_shape[-2], score_shape[-1]
    if not bool(keep.all()) and (seq_q > seq_k or not bool((keep == causal_keep(seq_q, seq_k)).all())):
        facts.runtime_fill = _fill_read_by_the_kernel(constant_steps, keep, facts)
        shape_of = list(facts.runtime_fill.tensor.meta["example_value"].shape)
        facts.described = f"compile-time fill, as additive {shape_of} read by the kernel"
        return _with_slopes_described(facts)
    # a causal fact, or a mask that hides nothing (an all-ones buffer, a zero bias: dropped from the site):
    # either way the buffers it was read from are guarded, since a later write changes what is right
    buffers = [b for s in constant_steps if isinstance(s.tensor, fx.Node) for b in values.buffers_used(s.tensor)]
    facts.buffers = tuple(dict.fromkeys(facts.buffers + tuple(buffers)))
    if not bool(keep.all()):
        facts.causal = True
        facts.described = f"causal (from {_describe_buffers(dict.fromkeys(buffers))})"
    if (facts.causal and (facts.runtime_fill is not None or facts.runtime_mask is not None) and runtime_at is not None
            and any(_finite_fill(s, values) for _, s in causal_steps)):
        return fold_finite_causal(facts, causal_steps, runtime_at, values)
    if facts.runtime_mask is not None or facts.runtime_fill is not None:
        node = facts.runtime_mask if facts.runtime_mask is not None else facts.runtime_fill.tensor
        _describe_read_mask(facts, f"additive {list(node.meta['example_value'].shape)} read by the kernel")
    return _with_slopes_described(facts)


def _finite_fill(step: MaskStep, values) -> bool:
    """Whether a causal step masks with a finite value (finfo.min) rather than -inf; an additive mask whose
    values are not known here counts as finite."""
    if step.kind == "fill":
        return step.value != -math.inf
    masked = _masked_values(step, values)
    return masked is None or bool((masked != -math.inf).any())


def _masked_values(step: MaskStep, values) -> torch.Tensor | None:
    """The distinct nonzero values of an additive causal step's tensor; None where not evaluated (built over
    a symbolic length)."""
    try:
        tensor = torch.as_tensor(values.value(step.tensor))
    except Exception:  # (not evaluated)
        return None
    return tensor[tensor != 0].unique()


def fold_finite_causal(facts: MaskFacts, causal_steps: list, runtime_at: int, values) -> MaskFacts:
    """A causal mask with a finite fill (`masked_fill(~tril, finfo.min)`) beside an input-dependent mask (a
    bool padding mask, or an additive one that may hold -inf): a query row whose visible keys the padding
    removes (a left-padded row) has only -inf there, and eager's softmax averages the future keys, which
    hold the finite fill; causal block skipping never visits them and the row came out NaN, which the next
    layer's P @ V spread to every row (0 * NaN). Such a site runs with the causal step folded into the mask
    the kernel reads (the kernels fold the fill value in: the op's `causal_fold`; the forward skips the
    blocks above the diagonal of every query block whose rows all see a real score), so those rows are
    eager's (their gradients, where a loss reads them, are not: README, Attention).
    A fill *replaces* the score (eager's masked keys all hold the fill, so a row masked everywhere else is
    their uniform average), while the kernel *adds* its mask: the folded mask holds finfo(float32).min for
    the fill (the matcher takes fills at or below -65504 only, which weigh nothing beside a real score),
    whose sum with any score is itself, which the kernels drop as eager's equal fills (mask_tiles.add_mask).
    With fp16's -65504 kept, the kernel added the scores and weighted such a row by exp(s): wrong, found
    by benchmarks/attention_fuzz.py."""
    if len(causal_steps) != 1 or facts.key_slopes is not None or not isinstance(causal_steps[0][1].tensor, fx.Node):
        raise NotAttention("a causal mask with a finite fill (finfo.min) beside an input-dependent mask, in a form "
                           "the kernel cannot read as one mask: rows whose visible keys are all masked would "
                           "differ from eager")
    at, step = causal_steps[0]
    if facts.finite_runtime_fill is not None and not (step.kind == "fill" and step.value == facts.finite_runtime_fill):
        raise NotAttention("a causal mask and an input mask filled with different finite values: a row the input "
                           "masks entirely weighs the two levels in eager, the kernel reads one")
    if step.kind == "fill":
        fill = FOLDED_FILL
    else:  # an additive causal tensor: its one masked value, or None (added to the mask in the graph)
        masked = _masked_values(step, values)
        fill = float(masked[0]) if masked is not None and masked.numel() == 1 else None
    facts.causal = False  # (its buffers stay guarded: the forward kernels skip blocks above the diagonal)
    facts.folded_causal = (step, at < runtime_at, fill)
    facts.described = ("causal with a finite fill beside an input-dependent mask, read by the kernel as one "
                       "additive mask (rows whose visible keys are all masked average the keys at the fill "
                       "value, future ones included, as in eager: the forward visits the blocks above the "
                       "diagonal only for the query blocks holding such a row, the backward for every block)")
    return facts


def _read_additive(facts: MaskFacts, mask: fx.Node, requires_grad) -> None:
    if requires_grad(mask):
        raise NotAttention("the additive mask requires grad (the kernel gives no mask gradient)")
    facts.runtime_mask = mask


def _describe_read_mask(facts: MaskFacts, text: str) -> None:
    """(Without a causal fact the kernels walk each query block's visible key range: attention/mask_blocks.py.)"""
    facts.described = f"{facts.described} + {text}" if facts.causal else f"{text}; {RANGES_NOTE}"


RANGES_NOTE = ("key blocks it drops outside each query block's visible range skipped at run time, tiles it keeps "
               "whole walked without reading it")


def sdpa_mask_facts(facts: MaskFacts, mask: fx.Node, score_shape, requires_grad) -> None:
    """An SDPA call's attn_mask as the mask the kernel reads: a bool mask keeps scores where True (-inf
    elsewhere), a float one is added. SDPA's softmax is "safe" (a row its mask removes entirely is 0, and
    so are its gradients; eager's softmax gives NaN), so the kernel runs with safe_softmax."""
    v = meta(mask)
    is_bool = isinstance(v, torch.Tensor) and v.dtype == torch.bool
    step = MaskStep("fill", mask, -math.inf, negate=True) if is_bool else MaskStep("add", mask)
    check_runtime_mask(step, score_shape)
    if is_bool:
        facts.runtime_fill = step
    else:
        _read_additive(facts, mask, requires_grad)
    facts.safe_softmax = True
    _describe_read_mask(facts, f"{'bool' if is_bool else 'additive'} {list(v.shape)} read by the kernel, safe "
                               "softmax (rows it masks entirely give 0, as in SDPA)")


def _with_slopes_described(facts: MaskFacts) -> MaskFacts:
    if facts.key_slopes is not None:
        extra = f"position bias linear in the key index (ALiBi): {facts.key_slopes.numel()} slope(s) in the kernel"
        facts.described = extra if facts.described == "none" else f"{facts.described} + {extra}"
    return facts
