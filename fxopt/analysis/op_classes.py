"""What kind of op a node is, and whether the pointwise fuser may take it.

This is the capability side of fusion: the pass asks here, codegen implements exactly these ops
(tests/codegen/test_pointwise_ops.py checks the two tables agree).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.fx as fx
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from .symbolic import is_symbolic, same, sizes

aten = torch.ops.aten
prims = torch.ops.prims

_UNARY = ["abs", "neg", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt",
          "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh",
          "sigmoid", "erf", "erfc", "reciprocal", "floor", "ceil", "round", "trunc", "sign", "relu",
          "isnan", "isinf", "logical_not", "bitwise_not", "gelu", "silu", "clone", "leaky_relu",
          "clamp_min", "clamp_max", "clamp", "hardtanh"]
_BINARY_TENSOR_SCALAR = ["add", "sub", "mul", "div", "eq", "ne", "lt", "le", "gt", "ge", "fmod",
                         "remainder", "bitwise_and", "bitwise_or", "bitwise_xor"]
_BINARY = ["maximum", "minimum", "atan2", "logical_and", "logical_or", "logical_xor", "hypot"]


def _collect() -> frozenset:
    ops = set()
    for name in _UNARY:
        ops.add(getattr(aten, name).default)
    for name in _BINARY_TENSOR_SCALAR:
        ops.add(getattr(aten, name).Tensor)
        ops.add(getattr(aten, name).Scalar)
    for name in _BINARY:
        ops.add(getattr(aten, name).default)
    ops |= {aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar, aten.rsub.Scalar,
            aten.clamp.Tensor, aten.where.self, aten._to_copy.default, prims.convert_element_type.default,
            aten.threshold_backward.default, aten.sigmoid_backward.default, aten.tanh_backward.default,
            aten.gelu_backward.default, aten.silu_backward.default}
    return frozenset(ops)


POINTWISE_OPS = _collect()

# Ops whose Triton lowering needs libdevice, which the Triton interpreter cannot run: on CPU tensors
# under TRITON_INTERPRET=1 they stay ATen calls (with that reason), on the GPU they fuse.
CUDA_ONLY_OPS = frozenset({
    aten.tan.default, aten.asin.default, aten.acos.default, aten.atan.default, aten.sinh.default,
    aten.cosh.default, aten.asinh.default, aten.acosh.default, aten.atanh.default, aten.atan2.default,
    aten.erfc.default, aten.pow.Tensor_Tensor, aten.pow.Scalar, aten.fmod.Tensor, aten.fmod.Scalar,
    aten.hypot.default,
})

SUPPORTED_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                              torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool})

_MATMUL = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
           aten.convolution.default, aten._scaled_dot_product_flash_attention.default,
           aten._scaled_dot_product_efficient_attention.default}
if hasattr(aten.mm, "dtype"):
    _MATMUL.add(aten.mm.dtype)  # a 16-bit mm writing fp32 (passes/matmul_casts.py)


def is_cpu_scalar(value) -> bool:
    """A 0-d CPU tensor: how dynamo passes a module's float attribute under dynamic=True. ATen reads
    it as a number next to GPU tensors; fxopt's kernels never read it from memory (passes/cpu_scalars.py)."""
    return isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dim() == 0


def tensor_devices(gm: fx.GraphModule) -> set[torch.device]:
    """The devices of the graph's tensor values (multi-output values included), CPU scalars left out."""
    devices = set()
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        devices |= {v.device for v in (val if isinstance(val, (tuple, list)) else (val,))
                    if isinstance(v, torch.Tensor) and not is_cpu_scalar(v)}
    return devices


def is_view(node: fx.Node) -> bool:
    """An ATen op whose output aliases its input (permute, expand, view, slice, ...)."""
    t = node.target
    return node.op == "call_function" and isinstance(t, torch._ops.OpOverload) and t.is_view


# ATen calls whose result the wrapper can place itself (memory_plan="apply"): op -> its out= overload.
# The matmuls (the largest activations of a transformer that are not fused kernels' outputs) by name;
# any other op through its schema (_schema_out_overload).
OUT_VARIANTS = {aten.mm.default: aten.mm.out, aten.addmm.default: aten.addmm.out, aten.bmm.default: aten.bmm.out}
_OUT_CLASSES = ("pointwise", "reduction", "matmul", "other")  # not views, random, creation, collectives, fxopt


def out_variant(node: fx.Node):
    """The out= overload the wrapper calls for this node when the plan places its result, or None: an
    ATen op returning one fresh tensor on its inputs' device, with an out= overload taking the same
    arguments plus `out`."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    if node.target in OUT_VARIANTS:
        return OUT_VARIANTS[node.target]
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or classify(node) not in _OUT_CLASSES:
        return None
    if any(isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].device != val.device
           for a in node.all_input_nodes):
        return None
    return _schema_out_overload(node.target)


@functools.lru_cache(maxsize=None)
def _schema_out_overload(op):
    """`aten.cumsum.out` for `aten.cumsum.default`, `aten.add.out` for `aten.add.Tensor`: the overload
    of the same packet whose arguments are op's (names and types) plus one `out`, returning one tensor.
    None for an op that writes an input or returns an alias (its result is not a fresh tensor)."""
    schema = op._schema
    if len(schema.returns) != 1 or schema.returns[0].alias_info is not None or any(
            a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return None
    for name in ("out", f"{op._overloadname}_out"):
        try:
            cand = getattr(op.overloadpacket, name)
        except AttributeError:
            continue
        args = cand._schema.arguments
        outs = [a for a in args if a.is_out]
        if len(outs) == 1 and len(cand._schema.returns) == 1 and [
                (a.name, str(a.type)) for a in args if not a.is_out] == [(a.name, str(a.type)) for a in schema.arguments]:
            return cand
    return None


COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d", "_dtensor")


def is_collective(node: fx.Node) -> bool:
    """A distributed collective (all_reduce, all_gather, reduce_scatter, wait_tensor, ...) as DDP and
    FSDP2 put them in graphs: stays an ATen call, issued in the program's order (collectives must run in
    the same order on every rank); only the waits move (passes/collective_waits.py)."""
    t = node.target
    return node.op == "call_function" and isinstance(t, torch._ops.OpOverload) and t.namespace in COLLECTIVE_NAMESPACES


def is_wait(node: fx.Node) -> bool:
    """The wait on an asynchronous collective's result (`wait_tensor`): where the communication must
    have finished."""
    return is_collective(node) and "wait_tensor" in str(node.target)


def classify(node: fx.Node) -> str:
    """pointwise | item | view | reduction | matmul | random | attention | creation | collective | fxopt | other."""
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
        return "other"
    if is_collective(node):
        return "collective"
    if t.namespace == "fxopt":
        return "fxopt"  # fxopt's own fused ops (attention): already a kernel, not a fallback
    if t in POINTWISE_OPS:
        return "pointwise"
    if t is aten._local_scalar_dense.default:
        return "item"
    if t.is_view:
        return "view"
    if t in _MATMUL:
        return "matmul"
    tags = set(t.tags)
    if torch.Tag.nondeterministic_seeded in tags:
        return "attention" if _attention_without_dropout(node) else "random"
    if t.name().split("::")[-1].split(".")[0] in ("sum", "mean", "amax", "amin", "var", "var_mean",
                                                   "prod", "max", "min", "argmax", "argmin", "any", "all",
                                                   "_softmax", "_log_softmax", "native_layer_norm",
                                                   "native_layer_norm_backward", "_softmax_backward_data",
                                                   "_log_softmax_backward_data", "cumsum"):
        return "reduction"
    if t.name().split("::")[-1].split(".")[0] in ("full", "empty", "zeros", "ones", "arange", "scalar_tensor",
                                                   "empty_strided", "full_like", "zeros_like", "ones_like",
                                                   "empty_like", "iota"):
        return "creation"
    return "other"


def _attention_without_dropout(node: fx.Node) -> bool:
    """An ATen attention kernel (SDPA's flash/efficient/cuDNN/CPU variants): tagged random for its dropout,
    which draws nothing at dropout_p=0."""
    if not node.target.name().split("::")[-1].startswith(("_scaled_dot_product", "_flash_attention",
                                                            "_efficient_attention")):
        return False
    names = [a.name for a in node.target._schema.arguments]
    if "dropout_p" not in names:
        return False
    i = names.index("dropout_p")
    p = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", 0.0)
    return isinstance(p, (int, float)) and p == 0


FALLBACK_REASONS = {
    "attention": "attention runs as ATen's SDPA kernel: fxopt's attention pass did not take this site "
                 "(rep.attention says why)",
    "matmul": "matmul/convolution runs as an ATen call (cuBLAS/cuDNN)",
    "reduction": "reduction: stays an ATen call (no reduction group took it)",
    "random": "random op: stays an ATen call so it draws from torch's generator",
    "creation": "creation op: stays an ATen call (allocates its own output)",
    "collective": "collective communication: stays an ATen call; collectives keep their order, a wait "
                  "moves down to its result's first use (passes/collective_waits.py)",
    "item": "reads a 0-d tensor's value on the host (.item(); of a CPU scalar input, passes/cpu_scalars.py, "
            "without a GPU sync)",
    "other": "no Triton lowering for this op yet",
}


def _tensor_vals(node: fx.Node):
    for a in node.all_input_nodes:
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor):
            yield a, v


def _int_scalar_out_of_range(node: fx.Node) -> str | None:
    """Eager wraps a Python int into the integer dtype it computes in (int8 `x < 300` compares with 44,
    uint8 `x == -1` with 255); a Triton literal outside the dtype's range is an error instead."""
    if node.target is aten.pow.Tensor_Scalar:
        return None  # an integer exponent is unrolled into products, never written as a literal
    tensors = [v for _, v in _tensor_vals(node)]
    scalars = [a for a in (*node.args, *node.kwargs.values()) if type(a) is int]
    if not tensors or not scalars:
        return None
    dtype, _ = elementwise_dtypes(*tensors, *scalars, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)
    if dtype.is_floating_point or dtype == torch.bool:
        return None
    info = torch.iinfo(dtype)
    bad = [s for s in scalars if not info.min <= s <= info.max]
    return f"integer scalar {bad[0]} is outside the range of {dtype} (eager wraps it)" if bad else None


def _int_to_half_cast(node: fx.Node, out: torch.Tensor) -> bool:
    if node.target not in (prims.convert_element_type.default, aten._to_copy.default):
        return False
    src = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    return (out.dtype in (torch.bfloat16, torch.float16) and isinstance(src, torch.Tensor)
            and not src.dtype.is_floating_point)


def _broadcasts(src, dst) -> bool:
    """Whether a shape broadcasts to another by its expressions: right-aligned, each size 1 or the same."""
    pad = len(dst) - len(src)
    return pad >= 0 and all(s == 1 or same(s, d) for s, d in zip(src, dst[pad:]))


_CLAMPS = (aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_max.default,
           aten.hardtanh.default)


def pointwise_unsupported_reason(node: fx.Node, target: str) -> str | None:
    """None when the pointwise fuser may take this node for `target`, else why it may not."""
    if node.op != "call_function" or node.target not in POINTWISE_OPS:
        return FALLBACK_REASONS.get(classify(node), FALLBACK_REASONS["other"])
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor):
        return "no tensor metadata (meta['val']) on this node"
    if out.dtype not in SUPPORTED_DTYPES:
        return f"dtype {out.dtype} has no Triton lowering"
    if any(s == 0 for s in sizes(out)):
        return "empty tensor: nothing to compute"
    for inp, v in _tensor_vals(node):
        if v.dtype not in SUPPORTED_DTYPES:
            return f"input '{inp.name}' has dtype {v.dtype}, which has no Triton lowering"
        if v.device != out.device:
            return f"input '{inp.name}' is on {v.device} while the result is on {out.device}"
        if not _broadcasts(sizes(v), sizes(out)):
            return (f"input '{inp.name}' of shape {list(sizes(v))} matches the result's {list(sizes(out))} only "
                    "through a guard on the symbolic sizes (e.g. a [B*T] view against a [T*B] one): the "
                    "kernels index by the sizes' expressions")
    for a in node.all_input_nodes:
        if isinstance(a.meta.get("val"), torch.SymFloat):  # (a SymInt operand is computed in the kernel)
            return (f"operand '{a.name}' is a float computed from sizes at run time (a SymFloat, e.g. 1/(n-1) "
                    f"of a variance's backward): kernels do not take those yet")
    if target == "interpret" and node.target in CUDA_ONLY_OPS:
        return "needs libdevice, which the Triton interpreter cannot run (fuses on the GPU)"
    if target == "interpret" and _int_to_half_cast(node, out):
        return ("integer -> bf16/fp16 cast: the Triton interpreter reinterprets the bits instead of converting "
                "(fuses on the GPU)")
    if out.dtype == torch.float64 and target == "interpret" and node.target in (aten.gelu.default,):
        return "float64 gelu is not lowered for the interpreter"
    t = node.target
    if t is aten._to_copy.default:
        extra = set(node.kwargs) - {"dtype", "memory_format", "layout", "device"}
        if extra or node.kwargs.get("layout") not in (None, torch.strided):
            return f"_to_copy with {sorted(extra) or 'a layout change'} is not a plain cast"
    if t in (aten.gelu.default, aten.gelu_backward.default):
        if node.kwargs.get("approximate", "none") not in ("none", "tanh"):
            return "unknown gelu approximation"
        if t is aten.gelu_backward.default and node.kwargs.get("approximate", "none") == "tanh":
            return "tanh-approximate gelu_backward is not lowered yet"
    if (t is aten.pow.Tensor_Scalar and not out.dtype.is_floating_point and isinstance(node.args[1], (int, float))
            and node.args[1] < 0):
        return "an integer tensor to a negative power: eager raises, so ATen runs it (and raises)"
    if t in (aten.clamp.default, aten.clamp.Tensor, aten.hardtanh.default):
        if any(isinstance(a, torch.Tensor) for a in node.args[1:]):
            return "clamp bounds given as constants tensors"
    if t in _CLAMPS and any(isinstance(a, float) and math.isnan(a) for a in (*node.args[1:], *node.kwargs.values())):
        return ("a NaN clamp bound: eager's result differs by device (NaN on the CPU; on CUDA the bound is "
                "ignored, fmax/fmin), so the node runs as eager")
    if t is aten.abs.default and out.dtype in (torch.int8, torch.int16) and target == "cuda":
        return ("abs of an int8/int16 tensor: eager's abs(-32768) wraps to -32768, and LLVM folds Triton's "
                "abs of the minimum into an unsigned value (abs(x) % 40 was 8, eager 32, on an H100)")
    wrapped = _int_scalar_out_of_range(node)
    if wrapped:
        return wrapped
    if out.dtype.is_floating_point is False and t in (aten.div.Tensor, aten.div.Scalar):
        return "integer division result"  # aten.div always returns float: unreachable, kept as a guard
    return None


# Ops that read their inputs at shifted indices rather than element by element: fused into pointwise
# kernels (codegen/cat_pieces.py) with the element-wise ops that consume them, never into reduction
# groups or recomputed chains, which keep to pointwise_unsupported_reason.
GATHERS = frozenset({aten.cat.default})
# each piece nests one more tl.where in the kernel's source (Python's parser stops at 200 nested brackets)
# and adds a pointer argument: wider cats are one ATen copy anyway
MAX_CAT_PIECES = 64


def cat_unsupported_reason(node: fx.Node, target: str) -> str | None:
    """None when a pointwise kernel can compute this cat: two or more non-empty inputs of the result's
    dtype, device and rank, fixed sizes along the cat dim (the others may be symbolic: a rotary cat
    under dynamic shapes). Each input is read from memory, at its offset along the dim."""
    out = node.meta.get("val")
    inputs = node.args[0] if node.args else []
    if not isinstance(out, torch.Tensor) or not isinstance(inputs, (list, tuple)) or len(inputs) < 2:
        return "cat of fewer than two tensors"
    if len(inputs) > MAX_CAT_PIECES:
        return f"cat of {len(inputs)} tensors stays an ATen call (a kernel takes at most {MAX_CAT_PIECES} pieces)"
    if out.dtype not in SUPPORTED_DTYPES:
        return f"dtype {out.dtype} has no Triton lowering"
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in inputs]
    if any(not isinstance(v, torch.Tensor) for v in vals):
        return "cat input without tensor metadata"
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % max(out.dim(), 1)
    if any(v.dim() == out.dim() and is_symbolic(sizes(v)[dim]) for v in vals):
        return "cat along a symbolic size stays an ATen call (the pieces' bounds must be numbers)"
    if any(v.dtype != out.dtype for v in vals):
        return "cat promoting dtypes stays an ATen call"
    if any(v.device != out.device for v in vals):
        return "cat inputs on different devices"
    if any(v.dim() != out.dim() or 0 in sizes(v) for v in vals) or 0 in sizes(out):  # sympy: no guards
        return "cat with empty inputs or inputs of another rank (legacy empty tensors) stays an ATen call"
    return None


def kernel_unsupported_reason(node: fx.Node, target: str) -> str | None:
    """The pointwise fuser's test: element-wise ops (pointwise_unsupported_reason) and GATHERS."""
    if node.op == "call_function" and node.target in GATHERS:
        return cat_unsupported_reason(node, target)
    return pointwise_unsupported_reason(node, target)
