"""Where time will go: FLOPs and bytes of every kernel and ATen call, and the least time the device's
ceilings allow for each (the larger of bytes / bandwidth and FLOPs / rate).

Counting rules (stated so the numbers can be checked by hand):
- a fused kernel moves each pointer input once (the whole tensor it points into) and each output once;
  it does one FLOP per element per pointwise op and per reduced element per reduction;
- mm/addmm/bmm/baddbmm: 2*M*N*K (+ M*N for the add); convolution: 2 * output elements * Cin/groups * kernel
  area; flash/efficient SDPA: 4 * B * H * Sq * Sk * D;
- other ATen calls: bytes of their tensor inputs and outputs, no FLOPs.
Ceilings default to what this project measured on an H200 (benchmarks/results: ~4.24 TB/s copy,
~790 TFLOP/s bf16 matmul); vector math at 67 TFLOP/s fp32 (datasheet).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .op_classes import is_view
from .reductions import reduction_info
from .symbolic import hint

aten = torch.ops.aten


@dataclass(frozen=True)
class Ceilings:
    name: str = "H200 (measured)"
    bytes_per_s: float = 4.24e12
    matmul_flops_per_s: float = 7.9e14
    vector_flops_per_s: float = 6.7e13


@dataclass
class RooflineRow:
    name: str
    kind: str  # pointwise | reduction | matmul | aten
    flops: int
    bytes: int
    seconds: float  # the least time the ceilings allow

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else 0.0

    bound: str = "memory"  # which ceiling sets `seconds`


def _bytes(val) -> int:
    if isinstance(val, torch.Tensor):
        return hint(val.numel()) * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(_bytes(v) for v in val)
    return 0


def _numel(node: fx.Node) -> int:
    v = node.meta.get("val")
    return hint(v.numel()) if isinstance(v, torch.Tensor) else 0


def matmul_flops(node: fx.Node) -> int:
    t, args = node.target, node.args
    shape = lambda a: tuple(hint(s) for s in a.meta["val"].shape)  # noqa: E731  (example sizes)
    if t is aten.mm.default or t is getattr(aten.mm, "dtype", None):  # mm.dtype: fp32 out (matmul_casts.py)
        (m, k), (_, n) = shape(args[0]), shape(args[1])
        return 2 * m * n * k
    if t is aten.addmm.default:
        (m, k), (_, n) = shape(args[1]), shape(args[2])
        return 2 * m * n * k + m * n
    if t in (aten.bmm.default, aten.baddbmm.default):
        a, b = (args[0], args[1]) if t is aten.bmm.default else (args[1], args[2])
        (bs, m, k), (_, _, n) = shape(a), shape(b)
        return 2 * bs * m * n * k + (bs * m * n if t is aten.baddbmm.default else 0)
    if t is aten.convolution.default:
        w = shape(args[1])  # [Cout, Cin / groups, *kernel]: each output element sums Cin/groups * kernel terms
        return 2 * _numel(node) * w[1] * math.prod(w[2:])
    if t in (aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default):
        b, h, sq, d = shape(args[0])
        return 4 * b * h * sq * shape(args[1])[2] * d
    if getattr(t, "namespace", "") == "fxopt":
        name = t.name()
        if "flash_attention" in name:
            return attention_flops(node)
        if "linear_cross_entropy" in name:
            return linear_cross_entropy_flops(node)
        if "cross_entropy" in name:
            return cross_entropy_flops(node)
    return 0


def _fxopt_op_kind(target) -> str | None:
    """fxopt's own fused ops by family: "attention" or "loss"; None for everything else."""
    if getattr(target, "namespace", "") != "fxopt":
        return None
    return "attention" if "flash_attention" in target.name() else "loss"


def cross_entropy_flops(node: fx.Node) -> int:
    """fxopt's fused cross-entropy on [N, V] logits: about 4 per logit forward (max, subtract, exp,
    sum), 3 backward (exp, subtract, scale)."""
    name = node.target.name()
    logits = node.args[1 if "backward" in name else 0].meta["val"]
    return (3 if "backward" in name else 4) * hint(logits.numel())


def linear_cross_entropy_flops(node: fx.Node) -> int:
    """The LM head's matmul, one more per gradient the op makes (grads bits), and the loss's 7 per logit."""
    hidden, weight = node.args[0].meta["val"], node.args[1].meta["val"]
    grads = node.args[6] if len(node.args) > 6 else 0
    logits = hint(hidden.shape[0]) * hint(weight.shape[0])
    return logits * (2 * hint(hidden.shape[1]) * (1 + bin(grads).count("1")) + 7)


def attention_flops(node: fx.Node) -> int:
    """fxopt's flash attention: 2 matmuls forward (QK^T, PV), 5 backward (S and dP recomputed, dQ,
    dK, dV); causal does about half the work."""
    name = node.target.name()
    first = 1 if "backward" in name else 0  # backward(dout, q, k, v, ...)
    q, k = node.args[first].meta["val"], node.args[first + 1].meta["val"]
    b, h, sq, d = (hint(s) for s in q.shape)
    forward = 4 * b * h * sq * hint(k.shape[2]) * d
    causal = bool(node.args[-1])
    work = forward * (2.5 if "backward" in name else 1)
    return int(work / 2 if causal else work)


def kernel_flops(sub: fx.GraphModule) -> int:
    flops = 0
    for n in sub.graph.nodes:
        if n.op != "call_function" or is_view(n):
            continue
        info = reduction_info(n)
        flops += _numel(n.args[0]) if info else _numel(n)
    return flops


def roofline(gm: fx.GraphModule, kernel_names: dict | None = None, ceilings: Ceilings = Ceilings()) -> list[RooflineRow]:
    """One row per fused kernel (named by `kernel_names[submodule]` when given) and per ATen call."""
    rows, kernel_names = [], kernel_names or {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            sub = gm.get_submodule(n.target)
            flops = kernel_flops(sub)
            nbytes = sum(_bytes(a.meta.get("val")) for a in n.all_input_nodes) + _bytes(n.meta.get("val"))
            kind = "reduction" if any(reduction_info(s) for s in sub.graph.nodes) else "pointwise"
            rate = ceilings.vector_flops_per_s
        elif n.op == "call_function" and n.target is not operator.getitem and not is_view(n):
            flops = matmul_flops(n)
            nbytes = sum(_bytes(a.meta.get("val")) for a in n.all_input_nodes) + _bytes(n.meta.get("val"))
            kind = _fxopt_op_kind(n.target) or ("matmul" if flops else "aten")
            rate = ceilings.matmul_flops_per_s
        else:
            continue
        memory_s, compute_s = nbytes / ceilings.bytes_per_s, flops / rate
        name = kernel_names.get(n.target, n.name) if n.op == "call_module" else n.name
        rows.append(RooflineRow(name, kind, flops, nbytes, max(memory_s, compute_s),
                                "compute" if compute_s > memory_s else "memory"))
    return rows
