"""Find attention written by hand (or as an SDPA call) and replace it with fxopt's fused op.

Runs on the torch-level graph dynamo captured, before aot_autograd, so autograd sees one
`fxopt::flash_attention` node and derives one `fxopt::flash_attention_backward` node from it. What
counts as a site and which spellings are accepted is `attention_match.py`; this module rewrites the
matches, guards the buffers their masks came from, and reports every site (fused or not, and why).
"""
from __future__ import annotations

import logging
import math
import operator
import os
import re

import torch
import torch.fx as fx

from ..analysis.attention_masks import MaskFacts, NotAttention
from ..analysis.constant_values import ConstantValues
from ..analysis.torch_ops import dtype, functorch_transform_inside, grad_enabled_at, meta, op_of, shape
from ..attention.op import flash_attention
from ..buffer_guards import InputGuard, UnspecialisedGraph
from ..pass_manager import PassContext, PassResult
from ..report import AttentionSite
from .attention_match import Match, is_candidate, match_sdpa, match_site
from .example_values import fake_mode, fill_missing_values
from .graph_edit import erase_unused

_log = logging.getLogger("fxopt.attention")

FUSED_OP = flash_attention._opoverload  # torch.ops.fxopt.flash_attention.default


def _call(graph, op_or_method, *args):
    if isinstance(op_or_method, str):
        return graph.call_method(op_or_method, args)
    return graph.call_function(op_or_method, args)


def _runtime_mask(graph: fx.Graph, facts: MaskFacts) -> tuple[fx.Node | None, dict]:
    """(the mask node the kernel reads, the op's causal_fold options). A -inf fill alone is read as the bool
    mask of the scores it keeps (the condition itself, or its negation: one select per score in the
    kernels, mask_tiles.add_mask); otherwise an additive mask (a fill becomes where(cond, fill, 0)). A finite
    causal fill beside it (attention_masks.fold_finite_causal) is the kernels' to fold (causal_fold): applied
    before the input mask m, eager's masked keys hold fill + m ("adds"); applied after it, the fill alone
    ("replaces"). An additive causal tensor of several (or unknown) values is added to m here ("in_mask")."""
    mask = facts.runtime_mask
    step = facts.runtime_fill
    if mask is None and step is not None and facts.folded_causal is None and dtype(step.tensor) == torch.bool \
            and step.value == -math.inf:
        return (step.tensor if step.negate else graph.call_function(torch.logical_not, (step.tensor,))), {}
    if mask is None and step is not None:  # (a finite fill is fp32's finfo.min here: attention_masks.FOLDED_FILL)
        hit, miss = (0.0, step.value) if step.negate else (step.value, 0.0)
        mask = graph.call_function(torch.where, (step.tensor, hit, miss))
    if facts.folded_causal is None:
        return mask, {}
    causal, causal_first, fill = facts.folded_causal
    if fill is not None:
        return mask, {"causal_fold": "adds" if causal_first or causal.kind == "add" else "replaces",
                      "causal_fill": fill}
    if dtype(mask) in (torch.float16, torch.bfloat16):  # a causal value may fit fp32 only
        mask = _call(graph, "float", mask)
    return graph.call_function(operator.add, (causal.tensor, mask)), {"causal_fold": "in_mask"}  # (additions commute)


def _slopes_constant(gm: fx.GraphModule, m: Match) -> fx.Node | None:
    """The site's per-head position-bias slopes, float32 [H] on q's device, as a `torch.tensor` of their
    values in the graph (aot_autograd makes it a constant of the ATen graph; its example value comes with
    the other inserted nodes', `_fill_example_values`); None without slopes."""
    slopes = m.facts.key_slopes
    if slopes is None:
        return None
    heads = shape(m.q)[-3] if len(shape(m.q)) == 4 else shape(m.q)[0]  # rank 3: [B * H, T, D] runs as heads
    values = slopes.to(torch.float32).expand(heads).tolist()
    return gm.graph.call_function(torch.tensor, (values,), {"dtype": torch.float32, "device": meta(m.q).device})


def rewrite(gm: fx.GraphModule, m: Match) -> fx.Node:
    """Insert the fused op before the P @ V matmul and hand it that matmul's uses."""
    graph = gm.graph
    rank = len(shape(m.q))
    out_dtype = dtype(m.out)
    with graph.inserting_before(m.out):
        k = m.k if m.k is not None else _call(graph, "transpose", m.k_transposed, -2, -1)
        mask, fold = _runtime_mask(graph, m.facts)
        q, v = m.q, m.v
        if rank == 3:
            q, k, v = (_call(graph, "unsqueeze", t, 0) for t in (q, k, v))
            if mask is not None:
                mask = _call(graph, "unsqueeze", mask, 0) if len(shape(mask) or ()) == 3 else mask
        runtime = (m.scale_by, m.scale_power) if m.scale_by is not None else ()
        slopes = _slopes_constant(gm, m)
        options = dict(fold)
        if slopes is not None:
            options["key_slopes"] = slopes
        if m.facts.safe_softmax:
            options["safe_softmax"] = True
        elif m.facts.runtime_fill is not None:  # eager's fill backward: rows masked entirely get 0 in dq, dk
            options["mask_is_fill"] = True
        fused = graph.call_function(FUSED_OP, (q, k, v, mask, m.scale, bool(m.facts.causal), *runtime), options)
        out = graph.call_function(operator.getitem, (fused, 0))
        if rank == 3:
            out = _call(graph, "squeeze", out, 0)
        if out_dtype != dtype(m.q):
            out = _call(graph, "to", out, out_dtype)
    m.out.replace_all_uses_with(out)
    erase_unused(graph, m.chain)
    return fused


def _source_line(node: fx.Node) -> str:
    """'file.py:63  y = att @ v': where the model wrote this node (from dynamo's stack trace)."""
    lines = (node.meta.get("stack_trace") or "").splitlines()
    for i in range(len(lines) - 1, -1, -1):
        found = re.match(r'\s*File "(.+)", line (\d+)', lines[i])
        if found:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"{os.path.basename(found.group(1))}:{found.group(2)}  {code}"
    return ""


def _kernel_name(m: Match) -> str:
    device = meta(m.q).device.type
    if device == "cuda":
        return "fxopt flash attention (Triton; split-KV decode when Tq <= 16 and keys are long)"
    return "fxopt flash attention (Triton kernels under TRITON_INTERPRET=1, else torch ops on the CPU)"


CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint


def _checkpoint_bodies(gm: fx.GraphModule):
    """(body name, body module, its operands) of each torch.utils.checkpoint region dynamo captured as
    a tag_activation_checkpoint call: attention inside is matched like attention outside, and aot_autograd
    still recomputes the region (the fused op included) in the backward."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is CHECKPOINT and node.args and node.args[0].op == "get_attr":
            body = getattr(gm, node.args[0].target, None)
            if isinstance(body, fx.GraphModule):
                yield node.args[0].target, body, node.args[1:]


def _sites_in_subgraphs(gm: fx.GraphModule, matched: set[str]) -> list[AttentionSite]:
    """Attention inside other higher-order-op bodies (torch.cond branches, ...): listed as not fused,
    with the reason, so no site goes unreported."""
    sites = []
    for name, sub in gm.named_modules():
        if not name or name in matched or not isinstance(sub, fx.GraphModule):
            continue
        for node in sub.graph.nodes:
            if node.op in ("call_function", "call_method") and is_candidate(node):
                sites.append(AttentionSite(
                    node=f"{name}.{node.name}", source=_source_line(node), fused=False,
                    reason=f"inside the subgraph '{name}' of a higher-order op other than torch.utils.checkpoint: "
                           "attention is not matched inside those yet; it runs as written"))
    return sites


def _fill_example_values(gm: fx.GraphModule) -> None:
    """Dynamo's example values for the nodes the rewrite inserted (the fused op, k's transpose): the
    fused op's kernels start compiling from them before aot_autograd (codegen/own_op_compiles.py)."""
    mode = fake_mode(gm)
    if mode is None:
        return
    try:
        fill_missing_values(gm.graph, mode)
    except Exception as exc:  # noqa: BLE001 (the values only let compiles start early; precision fills its own)
        _log.debug("fxopt attention: no example values for the fused nodes: %s", exc)


class FuseAttention:
    """Pre-autograd pass: hand-written attention and SDPA calls -> torch.ops.fxopt.flash_attention, in
    the graph and inside its torch.utils.checkpoint regions."""

    name = "fuse_attention"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        if functorch_transform_inside(gm):
            ctx.note("(graph)", "attention not fused: a torch.func transform is inside the graph (fxopt's op has no "
                     "functorch rules)")
            return PassResult(gm, False, {})
        values = ConstantValues(gm, ctx.example_inputs)
        fused = self._fuse_in(gm, values, ctx, prefix="", root=gm)
        matched = set()
        for name, body, operands in _checkpoint_bodies(gm):
            n = self._fuse_in(body, ConstantValues.for_body(body, operands, values), ctx, prefix=f"{name}.", root=gm)
            if n:
                body.recompile()
            fused += n
            matched.add(name)
        ctx.attention.extend(_sites_in_subgraphs(gm, matched))
        if fused:
            _fill_example_values(gm)
        return PassResult(gm, fused > 0, {"fused": fused, "unfused": sum(not s.fused for s in ctx.attention)})

    def _fuse_in(self, gm: fx.GraphModule, values: ConstantValues, ctx: PassContext, prefix: str,
                 root: fx.GraphModule) -> int:
        fused = 0
        for node in list(gm.graph.nodes):
            if node.graph is not gm.graph or node.op not in ("call_function", "call_method"):
                continue  # erased by an earlier rewrite
            kind = op_of(node)
            if kind not in ("softmax", "sdpa") or (kind == "softmax" and not is_candidate(node)):
                continue
            site = AttentionSite(node=prefix + node.name, source=_source_line(node), fused=False)
            try:
                m = match_site(node, values) if kind == "softmax" else match_sdpa(node, values)
                _same_grad_mode(m)
            except NotAttention as why:
                site.reason = str(why)
                ctx.attention.append(site)
                continue
            except Exception as exc:  # noqa: BLE001 (matching only reads the graph: the site stays as written)
                first = (str(exc).strip().splitlines() or [""])[0]
                site.reason = f"the matcher failed ({type(exc).__name__}: {first}); left as written"
                _log.warning("fxopt attention: %s at %s", site.reason, site.node)
                ctx.attention.append(site)
                continue
            site.node, site.fused, site.causal, site.scale = prefix + m.out.name, True, m.facts.causal, m.scale
            site.mask, site.kv_groups, site.kernel = m.facts.described, m.kv_groups, _kernel_name(m)
            site.recognised = list(dict.fromkeys(m.recognised))
            self._guard(ctx, values, m, site, root)
            rewrite(gm, m)
            ctx.attention.append(site)
            fused += 1
        return fused

    @staticmethod
    def _guard(ctx: PassContext, values: ConstantValues, m: Match, site: AttentionSite, root: fx.GraphModule) -> None:
        """Guard the buffers the site's facts were read from; before the first such rewrite, keep the graph as
        it is (earlier rewrites depend on no buffer) for calls whose buffers differ (buffer_guards.py)."""
        if m.facts.buffers and ctx.unspecialised is None:
            ctx.unspecialised = UnspecialisedGraph(root)
        for buf in m.facts.buffers:
            ctx.input_guards.append(InputGuard.of(values.index[buf], buf.name, values.buffers[buf], site.node))


def _same_grad_mode(m: Match) -> None:
    """The fused op runs at the site's output in that node's grad mode: a site whose scores, softmax and
    output sit in different no_grad / enable_grad / inference_mode regions would give gradients where
    eager gives none (or none where eager gives some), so it stays as written."""
    modes = {grad_enabled_at(n) for n in (*m.chain, m.out)}
    if len(modes) > 1:
        raise NotAttention("its nodes sit in different grad-mode regions (no_grad / enable_grad / inference_mode); "
                           "left as written")
