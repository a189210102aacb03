"""Mixed precision: matmuls and attention in bf16/fp16, numerically sensitive ops in fp32, by policy.

Runs on the torch-level graph (after attention matching), before autograd: the pass only inserts
`.to(dtype)` nodes, and aot_autograd derives the backward casts from them, so the gradients reaching
the fp32 parameters are fp32. Parameters, graph inputs and graph outputs keep their dtypes. Which op
computes where is the table in analysis/precision_policy.py; ops outside it follow their inputs.

    before (fp32 model)                          after precision="bf16"
    ln = layer_norm(x, (64,), w1, b1)            ln = layer_norm(x, (64,), w1, b1)        # fp32: norm
    h = linear(ln, w2, b2)                       to = ln.to(bf16); to_1 = w2.to(bf16); to_2 = b2.to(bf16)
                                                 h = linear(to, to_1, to_2)               # bf16: linear
    g = gelu(h)                                  g = gelu(h)                              # bf16: follows
    y = add(x, g)                                y = add(x, g)                            # fp32: promotion
    p = softmax(y, -1)                           p = softmax(y, -1)                       # fp32 already
    return (h,)                                  to_3 = h.to(float32); return (to_3,)    # interface dtype

A cast costs no pass of its own where a kernel is next to it: each one is shared by all its
consumers, an exact round trip (a model's `.float()` of a bf16 value cast back to bf16) is cancelled,
and after autograd the post-grad fusion folds `convert_element_type` into the neighbouring kernel.
Left alone are casts between a parameter or matmul and a matmul or output: a parameter's cast in
training (every call, as torch.autocast), the fp32 output of a last matmul, bf16 weight gradients
into fp32. In inference `cached_casts.lift_parameter_casts` turns parameter casts into cached inputs.
A node that cannot take the new dtypes (an op that insists on equal dtypes) gets its inputs cast back
and is noted. Every inserted cast is recorded in `rep.casts` with its reason.
"""
from __future__ import annotations

import contextlib
import logging
import math
from collections import Counter
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..analysis.mutations import Mutations, op_name, storage_root, written_by
from ..analysis.precision_policy import FP32, LOW, category_of, feeds_reduction, policy_with
from ..analysis.torch_ops import dtype, functorch_transform_inside, meta, op_of, state_switch
from ..pass_manager import PassContext, PassResult
from ..report import CastRecord
from .attention import FUSED_OP
from .example_values import fake_mode, fill_missing_values, run_on_fakes

LOW_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
LABELS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
ATTENTION_OPERANDS = 3  # the fused attention op casts q, k, v; its additive mask keeps its precision


def _value_dtypes(value):
    """A tensor's dtype, a tuple of them for tuple values (split, the attention op), else None."""
    if isinstance(value, torch.Tensor):
        return value.dtype
    if isinstance(value, (tuple, list)):
        return tuple(_value_dtypes(v) for v in value)
    return None


def _node_dtypes(node: fx.Node):
    return _value_dtypes(node.meta.get("example_value"))


@contextlib.contextmanager
def _meta_errors_unlogged():
    """Fake tensors log every meta kernel that raises; here a rejected dtype is an expected answer."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    disabled, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = disabled


def _operands(node: fx.Node) -> list[fx.Node]:
    """The inputs a policy casts: every input, except the fused attention op's additive mask (the
    kernel adds it in fp32; SDPA, by contrast, wants its float mask in the query's dtype) and what the
    node writes in place (a write into a cast would be lost)."""
    inputs = node.args[:ATTENTION_OPERANDS] if node.target is FUSED_OP else node.all_input_nodes
    written = written_by(node)
    return [n for n in inputs if isinstance(n, fx.Node) and n not in written]


def _exact_source(value: fx.Node, to: torch.dtype) -> fx.Node | None:
    """x when `value` is x.float() of a bf16/fp16 x and `to` is x's dtype: the round trip is exact."""
    if op_of(value) != "cast" or dtype(value) != torch.float32 or to not in LOW_DTYPES.values():
        return None
    source = value.args[0]
    return source if isinstance(source, fx.Node) and dtype(source) == to else None


class _Casts:
    """Inserts `.to(dtype)` nodes: one per (value, dtype), exact round trips cancelled, each recorded. A
    value the graph writes in place (analysis/mutations.py) gets a cast of its own at each consumer,
    and no round trip through it is cancelled: a shared cast made before `u.add_(10)` would be read
    after it, and `y = h.float(); y.add_(10)` is no longer h."""

    def __init__(self, graph: fx.Graph, mode, records: list):
        self.graph, self.mode, self.records = graph, mode, records
        self.made: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}
        self.each: list[fx.Node] = []  # casts of values written in place, one per consumer
        self.bypassed: set[fx.Node] = set()  # the model's casts that a cancelled round trip skipped
        self.mutations = Mutations(graph)

    def to(self, value: fx.Node, to: torch.dtype, before: fx.Node, reason: str) -> fx.Node:
        written = self.mutations.written(value)
        source = None if written else _exact_source(value, to)
        if source is not None and not self.mutations.written(source):
            self.bypassed.add(value)
            return source
        if written or (value, to) not in self.made:
            with self.graph.inserting_before(before):
                cast = self.graph.call_method("to", (value, to))
            cast.meta["example_value"] = run_on_fakes(cast, self.mode)
            self.records.append(CastRecord(cast.name, LABELS[dtype(value)], LABELS[to], reason))
            if written:
                self.each.append(cast)
                return cast
            self.made[(value, to)] = cast
        return self.made[(value, to)]

    def erase_bypassed(self) -> None:
        for node in self.bypassed:
            if not node.users:
                self.graph.erase_node(node)


@dataclass(frozen=True)
class MixedPrecision:
    """Pre-autograd pass: casts by policy so matmuls/attention run in `low`, sensitive ops in fp32."""

    low: torch.dtype
    policy: dict
    name: str = "precision"

    @classmethod
    def from_options(cls, options) -> "MixedPrecision":
        return cls(LOW_DTYPES[options.precision], policy_with(options.precision_policy))

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        mode = fake_mode(gm)
        if mode is None:
            return PassResult(gm, False, {})
        region = _region_inside(gm)
        if region:
            ctx.note("(graph)", f"precision= left this graph as written: {region}")
            return PassResult(gm, False, {})
        graph = gm.graph
        fill_missing_values(graph, mode)
        original = {n: _node_dtypes(n) for n in graph.nodes}
        casts = _Casts(graph, mode, ctx.casts)
        stats = Counter()
        shared = _returned_together(graph)
        for node in list(graph.nodes):
            if node.op == "output":
                self._restore_outputs(node, original, casts)
            elif node.op in ("call_function", "call_method"):
                recorded = [original.get(n) for n in node.all_input_nodes]  # the input dtypes dynamo saw
                stats[self._place(node, casts)] += 1
                if any(n not in original or _node_dtypes(n) != original[n] for n in node.all_input_nodes):
                    stats["kept"] += self._refresh(node, original, casts, ctx, recorded)
                _keep_storage_dtype(node, original, casts, shared)
        casts.erase_bypassed()
        stats = {"casts": len(casts.made) + len(casts.each), "low": stats[LOW], "fp32": stats[FP32],
                 "kept": stats["kept"], "round_trips_cancelled": len(casts.bypassed)}
        return PassResult(gm, bool(casts.made or casts.each or casts.bypassed), stats)

    def _where(self, node: fx.Node) -> str | None:
        """LOW, FP32, or None (follow the inputs), by the policy table."""
        category = category_of(node)
        if category is None or (category == "exp_log_pow" and not feeds_reduction(node)):
            return None
        return self.policy[category] if self.policy[category] in (LOW, FP32) else None

    def _place(self, node: fx.Node, casts: _Casts) -> str | None:
        """Cast the node's float inputs to the dtype the policy wants it to compute in."""
        where = self._where(node)
        if where is None or isinstance(node.kwargs.get("out"), fx.Node):  # (an out= tensor keeps its dtype)
            return None
        to = self.low if where == LOW else torch.float32
        castable = (torch.float32, torch.float16, torch.bfloat16) if where == LOW else tuple(LOW_DTYPES.values())
        reason = f"{node.name} ({category_of(node)}) computes in {LABELS[to]}"
        for value in _operands(node):
            if dtype(value) in castable and dtype(value) != to:
                node.replace_input_with(value, casts.to(value, to, node, reason))
        return where

    def _refresh(self, node: fx.Node, original: dict, casts: _Casts, ctx: PassContext,
                 recorded_inputs: list) -> int:
        """Recompute the node's value from its new inputs. An op that rejects them (one that insists
        on equal dtypes) gets its inputs cast back to what they were, and is noted; returns 1 then.
        An op that cannot be re-run on fake tensors at all also gets its inputs back and, with every
        input in its recorded dtype again, keeps the value dynamo recorded for it (a safety net: the
        one case seen, F.linear over symbolic sizes on torch 2.11, came from re-running without the
        Python dispatcher)."""
        recorded = node.meta.get("example_value")
        try:
            with _meta_errors_unlogged():
                node.meta["example_value"] = run_on_fakes(node, casts.mode)
            why = _refused(node)
            if why is None:
                return 0
        except Exception as exc:  # the op's own dtype check, raised on fake tensors
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        reason = f"{node.name} ({node.target}) does not take the new dtypes: kept in its own"
        if not _restore_recorded(node, recorded_inputs, original, casts, reason):  # (its own casts undone too)
            written = written_by(node)
            for value in node.all_input_nodes:
                if value in original and _node_dtypes(value) != original[value] and value not in written:
                    node.replace_input_with(value, casts.to(value, original[value], node, reason))
        try:
            node.meta["example_value"] = run_on_fakes(node, casts.mode)
        except Exception:  # not a dtype question: every input back to its recorded dtype, dynamo's value
            if recorded is None or not _restore_recorded(node, recorded_inputs, original, casts, reason):
                raise
            node.meta["example_value"] = recorded
        ctx.note(node.name, f"precision: kept in its original dtypes ({why})")
        return 1

    @staticmethod
    def _restore_outputs(output: fx.Node, original: dict, casts: _Casts) -> None:
        """Graph outputs keep the model's dtypes (a bf16 logits tensor is returned as fp32)."""
        def restore(value: fx.Node) -> fx.Node:
            was = original.get(value)
            if isinstance(was, torch.dtype) and was in LABELS and _node_dtypes(value) != was:
                return casts.to(value, was, output, "graph output keeps the model's dtype")
            return value
        output.args = (fx.node.map_arg(output.args[0], restore),)


# ops whose real kernels want the written tensor's dtype in the source where their fake ones do not check:
# (name, position of the source argument)
_SAME_DTYPE_SOURCES = {"index_add": 3, "index_add_": 3, "index_copy": 3, "index_copy_": 3, "index_put": 2,
                       "index_put_": 2, "setitem": 2}
_FILLS = {"masked_fill", "masked_fill_", "where", "fill_", "full_like", "clamp", "clamp_min", "clamp_max",
          "index_fill", "index_fill_"}
# a fill made in the graph: where its value is among the maker's arguments
_CONSTANT_MAKERS = {torch.full: 1, torch.tensor: 0, torch.scalar_tensor: 0}


def _refused(node: fx.Node) -> str | None:
    """Why a node re-run on fake tensors with its new dtypes would still be wrong: an op whose real
    kernel insists on equal dtypes where its meta does not (index_add of a low-precision source into an
    fp32 tensor), or a fill that the new dtype cannot hold (dynamo baked `finfo(s.dtype).min` of the fp32
    scores: in fp16 it is -inf, and a row masked everywhere becomes NaN instead of eager's average), or
    an op given a low-precision and an fp32 tensor whose result is not their promotion (its kernel wants
    one dtype: grid_sample of bf16 features on an fp32 grid, batch_norm with fp32 running statistics)."""
    name = op_name(node)
    values = [_constant_fill(v) for v in (*node.args, *node.kwargs.values())]
    if name in _SAME_DTYPE_SOURCES and len(node.args) > _SAME_DTYPE_SOURCES[name]:
        source = node.args[_SAME_DTYPE_SOURCES[name]]
        if isinstance(source, fx.Node) and isinstance(node.args[0], fx.Node) and dtype(source) != dtype(node.args[0]):
            return f"{name} needs its source in the written tensor's dtype"
    out = node.meta.get("example_value")
    if name in _FILLS and isinstance(out, torch.Tensor) and out.dtype in LABELS and out.dtype != torch.float32:
        largest = torch.finfo(out.dtype).max
        for v in values:
            if isinstance(v, float) and math.isfinite(v) and abs(v) > largest:
                return f"the fill {v:g} overflows {LABELS[out.dtype]}"
    floats = {v.dtype for v in map(meta, node.all_input_nodes)
              if isinstance(v, torch.Tensor) and v.dim() > 0 and v.dtype in LABELS}
    own = isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "fxopt"  # (attention's
    if len(floats) > 1 and not own and not _promotes(name):  # additive mask stays fp32 by design: _operands)
        return f"{name} is given mixed float dtypes and is not an elementwise op that promotes them"
    return None


_OPERATORS = {"truediv": "div", "floordiv": "floor_divide", "mod": "remainder"}  # Python operators' ATen names


def _promotes(name: str) -> bool:
    """Whether an op of this name is elementwise (ATen's pointwise tag) and so takes mixed float dtypes
    by type promotion; other ops' kernels mostly want one dtype (their meta functions do not check)."""
    packet = getattr(torch.ops.aten, _OPERATORS.get(name, name.rstrip("_")), None)
    return packet is not None and any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())


def _returned_together(graph: fx.Graph) -> set[fx.Node]:
    """Storages the graph returns through more than one output (`y, y.t(), y[1]`): the caller sees them
    alias, and a write to one shows in the others."""
    returned = Counter()
    for out in graph.find_nodes(op="output"):
        fx.node.map_arg(out.args[0], lambda v: returned.update([storage_root(v)]))
    return {r for r, times in returned.items() if times > 1}


def _keep_storage_dtype(node: fx.Node, original: dict, casts: _Casts, shared: set) -> None:
    """A value the graph writes in place keeps the dtype the model gave it: where the policy changed it
    (`s = x @ w` now bf16, then `s.masked_fill_(m, finfo(float32).min)` or `s[idx] = y`), it is cast
    back right where it is made and every use reads that one cast, so the write lands where the model's
    later reads look (a write into a per-reader cast was lost) and in the dtype it was written for. So
    does a value returned through several outputs (`shared`): cast once, they are views of one tensor
    as in eager (cast per output, they were separate tensors)."""
    was, written = original.get(node), casts.mutations.written(node)
    if not (isinstance(was, torch.dtype) and was in LABELS and _node_dtypes(node) != was
            and (written or node in shared) and storage_root(node) is node):
        return
    why = "is written in place" if written else "is returned through several views"
    cast = casts.to(node, was, node.next, f"{node.name} {why}: keeps the model's {LABELS[was]}")
    node.replace_all_uses_with(cast, delete_user_cb=lambda user: user is not cast)
    casts.mutations.roots.add(cast)


def _constant_fill(value):
    """A fill's value: a Python float, or the float a 0-d tensor made in the graph holds (HF GPT-2's
    `torch.full([], finfo(s.dtype).min)`, `torch.tensor(-1e9)`)."""
    at = _CONSTANT_MAKERS.get(value.target) if isinstance(value, fx.Node) and value.op == "call_function" else None
    return value.args[at] if at is not None and len(value.args) > at else value


def _restore_recorded(node: fx.Node, recorded_inputs: list, original: dict, casts: _Casts, reason: str) -> bool:
    """Put each input of `node` back to the dtype dynamo recorded for it (False: the inputs no longer
    line up with the recorded ones, nothing changed)."""
    inputs = list(node.all_input_nodes)
    if len(inputs) != len(recorded_inputs):
        return False
    written = written_by(node)
    for value, want in zip(inputs, recorded_inputs):
        if isinstance(want, torch.dtype) and want in LABELS and _node_dtypes(value) != want and value not in written:
            node.replace_input_with(value, _uncast(value, want, original) or casts.to(value, want, node, reason))
    return True


def _uncast(value: fx.Node, want: torch.dtype, original: dict) -> fx.Node | None:
    """The source of a cast this pass inserted, when the source already has the wanted dtype: an input
    put back reads the original value itself, not a round trip through the low dtype."""
    if value in original or value.op != "call_method" or value.target != "to":
        return None
    source = value.args[0]
    return source if isinstance(source, fx.Node) and _node_dtypes(source) == want else None


def _region_inside(gm: fx.GraphModule) -> str | None:
    """Why the policy cannot be placed on this graph, or None. Casts are placed by the policy table
    alone and shared between readers, so they would override a user's own autocast region, carry one
    grad-mode region's (no_grad, inference_mode) cast into another, or be made outside a torch.func
    transform's level."""
    if functorch_transform_inside(gm):
        return "a torch.func transform is inside it"
    switches = {state_switch(n) for n in gm.graph.nodes}
    if "autocast" in switches:
        return "it opens a torch.autocast region of its own (autocast decides those dtypes)"
    if "grad" in switches:
        return "it switches grad mode inside (no_grad / enable_grad / inference_mode)"
    return None
