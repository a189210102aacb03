"""Which nodes are an attention site, and what each computes in the fused op's terms.

A site is a softmax whose input comes from a matmul (the scores, S = Q @ K^T) and whose output feeds a
matmul (P @ V), or an F.scaled_dot_product_attention call. Between them the matcher accepts, in any
spelling (see analysis/torch_ops.py):
  scores side:  scale by a constant (mul or div, on the scores, on q, on k or split across them),
                masks (masked_fill / where / + mask; see analysis/attention_masks.py), casts to float
  probs side:   casts, dropout that does nothing (eval mode or p=0)
  operands:     q, k and v as they come (any strides), k^T through transpose/permute, up-casts of
                bf16/fp16 operands (the kernel's dot accumulates in fp32 anyway), grouped-query
                repeats of k and v (repeat_interleave, or expand + reshape as HF's repeat_kv).
Every condition that fails raises NotAttention with the reason; the site then stays as written.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from ..analysis.attention_masks import MaskFacts, MaskStep, NotAttention, mask_facts, sdpa_mask_facts
from ..analysis.constant_values import ConstantValues
from ..analysis.symbolic import expr, is_inverse_sqrt, is_symbolic, scalar_expr
from ..analysis.torch_ops import (
    arg, casts_to_the_matmul_dtype, dtype, is_identity_dropout, meta, new_axis_at_2, op_of, provably_equal, shape,
    swaps_last_two, upcast_source, widening_cast,
)

HEAD_DIMS = (16, 256)  # head dims the kernels handle (inclusive)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class Match:
    """What one site computes, in the fused op's terms."""

    q: fx.Node
    k: fx.Node | None  # None: k is the transpose of `k_transposed` (inserted by the rewrite)
    k_transposed: fx.Node
    v: fx.Node
    scale: float | None  # None: 1/sqrt(head dim) of each call (a symbolic head dim's default scale)
    facts: MaskFacts
    out: fx.Node  # the node whose uses the fused op takes over
    kv_groups: int = 1
    scale_by: fx.Node | None = None  # a 0-d tensor input the scale is multiplied by per call, to scale_power
    scale_power: int = 1
    recognised: list[str] = field(default_factory=list)
    chain: list[fx.Node] = field(default_factory=list)  # nodes the fused op makes dead


def _single_user(node: fx.Node) -> bool:
    return len(node.users) == 1


def _scalar_of(value, values: ConstantValues):
    """A python number or a compile-time 0-d tensor (HF GPT-2 divides by torch.full([], sqrt(d))) as a
    float; a scalar computed from symbolic sizes (`1 / math.sqrt(q.size(-1))` under dynamic shapes) as
    its sympy expression; else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, fx.Node) and scalar_expr(meta(value)) is not None:
        return scalar_expr(meta(value))
    if isinstance(value, fx.Node) and values.is_constant(value) and not values.buffers_used(value):
        # (a module buffer's value can change in place after compiling: it is not baked into the kernel)
        v = values.value(value)
        if isinstance(v, torch.Tensor) and v.numel() == 1 and v.dim() == 0:  # ([1, 1, 1, 1] would add dims)
            return float(v.item())
    return None


def _scale_step(node: fx.Node, values) -> tuple[fx.Node, float] | None:
    """(the tensor operand, factor) of `x * c`, `c * x` or `x / c` with c a constant scalar."""
    op = op_of(node)
    a, b = arg(node, 0, "input"), arg(node, 1, "other")
    if op == "mul":
        for x, c in ((a, b), (b, a)):
            factor = _scalar_of(c, values)
            if isinstance(x, fx.Node) and factor is not None:
                return x, factor
    if op == "div" and isinstance(a, fx.Node) and not node.kwargs.get("rounding_mode"):
        factor = _scalar_of(b, values)
        if factor is not None and factor != 0:
            return a, 1.0 / factor
    return None


def _strip_operand(node: fx.Node, values, m: Match, what: str) -> tuple[fx.Node, float]:
    """Peel constant scales and up-casts off a matmul operand used only there; returns (base, factor)."""
    factor = 1.0
    while _single_user(node):
        step = _scale_step(node, values)
        if step is not None:
            m.chain.append(node)
            node, f = step
            factor *= f
            m.recognised.append(f"scale on {what}")
            continue
        src = upcast_source(node)
        if src is not None:
            m.chain.append(node)
            node = src
            m.recognised.append(f"float() of {what}")
            continue
        break
    return node, factor


def _peel_kv_repeat(node: fx.Node, m: Match, what: str) -> fx.Node:
    """The kv tensor before a grouped-query repeat: repeat_interleave(x, n, dim=1) or HF's repeat_kv
    x[:, :, None].expand(B, Hkv, n, T, D).reshape(B, Hkv * n, T, D). Otherwise the node itself."""
    full = shape(node)
    if full is None or len(full) != 4 or not _single_user(node):
        return node
    op = op_of(node)
    if op == "repeat_interleave":
        x, dim = node.args[0], arg(node, 2, "dim")
        if isinstance(arg(node, 1, "repeats"), int) and dim in (1, -3) and shape(x) is not None:
            m.chain.append(node)
            m.recognised.append(f"repeat_interleave of {what} (grouped-query)")
            return x
    if op == "reshape" and op_of(node.args[0]) == "expand" and _single_user(node.args[0]):
        expand = node.args[0]
        src = expand.args[0]
        five = shape(src)
        if five and len(five) == 5 and five[2] == 1 and new_axis_at_2(src) and _single_user(src):
            base = src.args[0]
            b = shape(base)
            if b and len(b) == 4 and b[1] * shape(expand)[2] == full[1] and b[2:] == full[2:]:
                m.chain.extend([node, expand, src])
                m.recognised.append(f"expand+reshape repeat of {what} (grouped-query)")
                return base
    return node


def _scores_chain(softmax: fx.Node, values, m: Match) -> tuple[fx.Node, list[MaskStep]]:
    """Walk from the softmax up to the scores matmul; collect scale and mask steps."""
    steps: list[MaskStep] = []
    node = arg(softmax, 0, "input")
    scale_seen_below = False  # a scale step between this node and the softmax
    while isinstance(node, fx.Node) and op_of(node) != "matmul":
        if not _single_user(node):
            raise NotAttention(f"the scores ({node.name}) are used outside the attention (output_attentions?)")
        m.chain.append(node)
        op = op_of(node)
        step = _scale_step(node, values) if op in ("mul", "div") else None
        if step is not None:
            node, factor = step
            m.scale *= factor
            scale_seen_below = True
            m.recognised.append(f"scale on scores ({op})")
        elif op == "cast":
            if not widening_cast(node):
                raise NotAttention(f"'{node.name}' casts the scores to {dtype(node)}: the kernel keeps fp32 scores")
            node = node.args[0]
            m.recognised.append("cast of scores")
        elif op == "masked_fill":
            value = _fill_value(arg(node, 2, "value"), values)
            steps.append(MaskStep("fill", arg(node, 1, "mask"), value, scale_seen_below))
            node = node.args[0]
            m.recognised.append("masked_fill")
        elif op == "where":
            cond, a, b = node.args[:3]
            scores_if_true = _leads_to_matmul(a)  # where(keep, s, v) or where(masked, v, s)
            fill = b if scores_if_true else a
            steps.append(MaskStep("fill", cond, _fill_value(fill, values), scale_seen_below, negate=scores_if_true))
            node = a if scores_if_true else b
            m.recognised.append("where")
        elif op == "add" and len(node.args) == 2 and "alpha" not in node.kwargs:
            a, b = node.args
            scores, mask = (a, b) if _leads_to_matmul(a) else (b, a)
            steps.append(MaskStep("add", mask, after_scale=scale_seen_below))
            node = scores
            m.recognised.append("additive mask")
        else:
            raise NotAttention(f"'{node.name}' ({node.target}) between the scores matmul and the softmax")
    if op_of(node) != "matmul":
        raise NotAttention("the softmax input does not come from a matmul")
    if not _single_user(node):
        raise NotAttention(f"the scores ({node.name}) are used outside the attention")
    m.chain.append(node)
    return node, list(reversed(steps))


def _fill_value(value, values) -> float:
    v = _scalar_of(value, values)
    if not isinstance(v, float):
        raise NotAttention("the fill value of a mask is not a compile-time constant")
    return v


def _leads_to_matmul(node, depth: int = 12) -> bool:
    """Does this operand come (through the chain ops) from a matmul? Tells scores from masks."""
    while isinstance(node, fx.Node) and depth > 0:
        op = op_of(node)
        if op == "matmul":
            return True
        if op not in ("mul", "div", "cast", "add", "masked_fill", "where"):
            return False
        node = node.args[1] if op == "where" else node.args[0]
        depth -= 1
    return False


def _probs_chain(softmax: fx.Node, m: Match) -> fx.Node:
    """Walk from the softmax down to the P @ V matmul through casts and do-nothing dropout."""
    node = softmax
    while True:
        if not _single_user(node):
            raise NotAttention(f"the attention probabilities ({node.name}) are used outside the attention")
        user = next(iter(node.users))
        op = op_of(user)
        if op == "matmul" and user.args[0] is node:
            return user
        if op == "cast":
            if not (widening_cast(user) or casts_to_the_matmul_dtype(user)):
                raise NotAttention(f"'{user.name}' casts the probabilities to {dtype(user)}: the kernel rounds them "
                                   "only to v's dtype")
            m.recognised.append("cast of probabilities")
        elif op == "dropout" and is_identity_dropout(user):
            m.recognised.append("dropout (eval or p=0)")
        elif op == "dropout":
            raise NotAttention("dropout with p > 0 in training mode on the probabilities (the fused kernel has no "
                               "dropout; call model.eval() or set the attention dropout to 0)")
        else:
            raise NotAttention(f"the softmax feeds '{user.name}' ({user.target}), not a matmul with v")
        m.chain.append(user)
        node = user


def _check_operands(m: Match) -> None:
    q, v = meta(m.q), meta(m.v)
    k_shape = shape(m.k) if m.k is not None else tuple(shape(m.k_transposed)[:-2]) + tuple(reversed(shape(m.k_transposed)[-2:]))
    if q is None or v is None or k_shape is None:
        raise NotAttention("q, k or v has no recorded shape")
    if q.dim() not in (3, 4) or len(k_shape) != q.dim() or v.dim() != q.dim():
        raise NotAttention(f"q, k, v have {q.dim()}, {len(k_shape)}, {v.dim()} dims; the kernel takes 3-D or 4-D")
    d = q.shape[-1]
    if not provably_equal(k_shape[-1], d) or not provably_equal(v.shape[-1], d):
        raise NotAttention(f"head dims differ (q {d}, k {k_shape[-1]}, v {v.shape[-1]}); the kernel needs one")
    if is_symbolic(expr(d)):
        m.recognised.append(f"symbolic head dim {expr(d)} (the kernels take {HEAD_DIMS[0]}..{HEAD_DIMS[1]} "
                            "per call, the reference any other)")
    elif not HEAD_DIMS[0] <= d <= HEAD_DIMS[1]:
        raise NotAttention(f"head dim {d} is outside the kernels' range {HEAD_DIMS[0]}..{HEAD_DIMS[1]}")
    dtypes = {q.dtype, dtype(m.k if m.k is not None else m.k_transposed), v.dtype}
    if len(dtypes) != 1 or q.dtype not in DTYPES:
        raise NotAttention(f"q, k, v dtypes {sorted(map(str, dtypes))}: the kernel takes one of fp16, bf16, fp32")
    if q.device.type not in ("cuda", "cpu"):
        raise NotAttention(f"device {q.device} (fxopt runs attention on cuda, or on the cpu)")
    lead_q, lead_k = tuple(q.shape[:-2]), tuple(k_shape[:-2])
    if not provably_equal(lead_q, lead_k):
        groups = _head_ratio(lead_q[1], lead_k[1]) if q.dim() == 4 else None
        if groups is not None and provably_equal(lead_q[0], lead_k[0]) and provably_equal(tuple(v.shape[:-2]), lead_k):
            m.kv_groups = groups
        else:
            raise NotAttention(f"batch/head dims of q {list(lead_q)} and k {list(lead_k)} do not line up")
    elif not provably_equal(tuple(v.shape[:-2]), lead_q):
        raise NotAttention(f"batch/head dims of v {list(v.shape[:-2])} differ from q's {list(lead_q)}")


def _head_ratio(heads_q, heads_k) -> int | None:
    """Query heads per kv head when it is a whole number for every size: 4 / 2, or 2*s0 / s0 under dynamic
    shapes (where dynamo makes head counts symbols too); None otherwise."""
    ratio = sympy.simplify(sympy.sympify(expr(heads_q)) / expr(heads_k))
    return int(ratio) if ratio.is_Integer and ratio > 0 else None


def match_site(softmax: fx.Node, values: ConstantValues) -> Match:
    """The Match of a hand-written attention site around `softmax`, or NotAttention(reason). With symbolic
    sizes a mask is matched only when it is computed per call (read by the kernel; a buffer sliced to
    the sequence length is), never evaluated at compile time."""
    dim = arg(softmax, 1, "dim")
    rank = len(shape(softmax) or ())
    if not isinstance(dim, int) or dim % max(rank, 1) != rank - 1:
        raise NotAttention(f"softmax over dim {dim}, not the last (key) dim")
    m = Match(q=None, k=None, k_transposed=None, v=None, scale=1.0, facts=MaskFacts(), out=None)
    m.chain.append(softmax)
    scores, steps = _scores_chain(softmax, values, m)
    m.out = _probs_chain(softmax, m)
    m.chain.append(m.out)
    q, kt = scores.args[0], scores.args[1]
    m.q, fq = _strip_operand(q, values, m, "q")
    kt, fk = _strip_operand(kt, values, m, "k")
    if swaps_last_two(kt) and _single_user(kt):
        m.chain.append(kt)
        m.k, fk2 = _strip_operand(kt.args[0], values, m, "k")
        m.k = _peel_kv_repeat(m.k, m, "k")
        fk *= fk2
    m.k_transposed = kt
    m.scale *= fq * fk
    m.v, fv = _strip_operand(m.out.args[1], values, m, "v")
    if fv != 1.0:
        raise NotAttention("v is scaled (the kernel scales scores, not values)")
    m.v = _peel_kv_repeat(m.v, m, "v")
    m.scale = _resolved_scale(m.scale, m)
    _check_operands(m)
    score_meta = meta(scores)
    m.facts = mask_facts(steps, values, tuple(score_meta.shape), _requires_grad)
    if m.facts.finite_runtime_fill is not None and _requires_grad(scores):
        raise NotAttention("an input-dependent mask filled with a finite value (finfo.min) in training: a query "
                           "row it masks entirely gets 0 in dq and dk from eager's fill, not from the kernels")
    return m


def _resolved_scale(scale, m: Match) -> float | None:
    """The scale as the fused op takes it: a positive float, or None for 1/sqrt(head dim) when the scale
    is that expression of a symbolic head dim (proved in sympy). Any other symbolic scale is refused."""
    if isinstance(scale, float) or getattr(scale, "is_number", False):
        scale = float(scale)
        if not scale > 0 or not math.isfinite(scale):
            raise NotAttention(f"scale {scale:g} is not a positive number")
        return scale
    head_dim = expr(shape(m.q)[-1])
    if is_symbolic(head_dim) and is_inverse_sqrt(scale, head_dim):
        m.recognised.append(f"scale 1/sqrt({head_dim}) of the symbolic head dim (computed per call)")
        return None
    runtime = _runtime_scalar(scale, m.q.graph)
    if runtime is not None:
        factor, m.scale_by, m.scale_power = runtime
        m.recognised.append(f"scale {factor:g} * {m.scale_by.name}{'' if m.scale_power == 1 else '^-1'} "
                            "(a float input, read per call)")
        return _resolved_scale(factor, m)
    raise NotAttention(f"the scale {scale} depends on sizes, and not as 1/sqrt(head dim {head_dim})")


def _runtime_scalar(scale, graph: fx.Graph):
    """(c, tensor, power) when scale = c * x**power, power +-1, with x the value of a 0-d float tensor
    input read by `.item()` (a module's float attribute, which dynamo passes as a tensor under dynamic
    shapes: HF Llama's `self.scaling`); else None."""
    if not hasattr(scale, "as_coeff_Mul") or len(scale.free_symbols) != 1:
        return None
    factor, rest = scale.as_coeff_Mul()
    (symbol,) = scale.free_symbols
    power = 1 if rest == symbol else (-1 if rest == 1 / symbol else None)
    if power is None or not factor.is_number:
        return None
    for n in graph.nodes:
        v = meta(n)
        if (n.op == "call_method" and n.target == "item" and isinstance(v, torch.SymFloat)
                and v.node.expr == symbol):
            t = meta(n.args[0])
            if n.args[0].op == "placeholder" and isinstance(t, torch.Tensor) and t.dim() == 0 \
                    and t.dtype.is_floating_point:
                return float(factor), n.args[0], power
    return None


def _requires_grad(node) -> bool:  # (under no_grad, which dynamo guards, no backward is built: nothing needs one)
    v = meta(node)
    return isinstance(v, torch.Tensor) and v.requires_grad and torch.is_grad_enabled()


def match_sdpa(node: fx.Node, values: ConstantValues) -> Match:
    """An existing F.scaled_dot_product_attention call, as a Match of the same fused op."""
    q, k, v = node.args[:3]
    mask = arg(node, 3, "attn_mask")
    dropout_p = arg(node, 4, "dropout_p", 0.0)
    is_causal = arg(node, 5, "is_causal", False)
    scale = node.kwargs.get("scale")
    gqa = node.kwargs.get("enable_gqa", False)
    if dropout_p != 0:
        raise NotAttention(f"SDPA with dropout_p={dropout_p} (the fused kernel has no dropout)")
    if not all(isinstance(t, fx.Node) for t in (q, k, v)):
        raise NotAttention("SDPA operands are not tensors of the graph")
    d = expr(shape(q)[-1])
    m = Match(q=q, k=k, k_transposed=None, v=v, scale=None, facts=MaskFacts(), out=node,
              recognised=["scaled_dot_product_attention"])
    if scale is None:
        m.scale = None if is_symbolic(d) else 1.0 / math.sqrt(d)
    else:
        factor = _scalar_of(scale, values)
        if factor is None:
            raise NotAttention(f"SDPA scale {scale} is not a number or an expression of the sizes")
        m.scale = _resolved_scale(factor, m)
    if is_causal:
        tq, tk = shape(q)[-2], shape(k)[-2]
        if not provably_equal(tq, tk):
            raise NotAttention(f"SDPA is_causal with query and key lengths that may differ ({tq}, {tk}; SDPA "
                               "aligns top-left, the kernel bottom-right)")
        m.facts.causal, m.facts.described = True, "causal (is_causal=True)"
    if mask is not None:
        sdpa_mask_facts(m.facts, mask, (*shape(q)[:-1], shape(k)[-2]), _requires_grad)
    _check_operands(m)
    if m.kv_groups > 1 and not gqa:
        raise NotAttention("k/v have fewer heads than q but enable_gqa is False")
    return m


def is_candidate(node: fx.Node) -> bool:
    """Softmaxes that look like attention (a matmul above or below); not every softmax is attention."""
    if op_of(node) != "softmax":
        return False
    below = any(op_of(u) == "matmul" or op_of(u) in ("cast", "dropout") for u in node.users)
    return _leads_to_matmul(arg(node, 0, "input")) or below
