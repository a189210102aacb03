"""Which reductions the fuser may take, and the facts codegen needs about each one."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .op_classes import SUPPORTED_DTYPES
from .symbolic import hint, is_symbolic, shape_env_of_value, sizes

aten = torch.ops.aten

ROW_IN_REGISTERS = 8192  # widest row (elements) a kernel keeps whole in registers (a persistent reduction)
# node.meta key set by passes/fuse_reductions.py on a sum over every row dim that it put into a row
# group (a weight or bias gradient): codegen accumulates it across the rows each program walks.
COLUMN_SUM = "fxopt_column_sum"

REDUCTION_KINDS = {
    aten.sum.dim_IntList: "sum", aten.sum.default: "sum", aten.mean.dim: "mean", aten.mean.default: "mean",
    aten.amax.default: "amax", aten.amin.default: "amin",
}


@dataclass(frozen=True)
class ReductionInfo:
    kind: str  # sum | mean | amax | amin
    dims: tuple[int, ...]  # reduced dims of the input, sorted, non-negative
    keepdim: bool
    in_shape: tuple  # ints, or sympy expressions of dynamo's size symbols (analysis/symbolic.py)
    device: str

    @property
    def key(self):
        """Nodes of one reduction group share this: the input shape, the reduced dims, the device."""
        return (self.in_shape, self.dims, self.device)

    @property
    def rnumel(self) -> int:
        n = 1
        for d in self.dims:
            n *= self.in_shape[d]
        return n


def kept_shape(shape, dims) -> tuple[int, ...]:
    return tuple(1 if d in dims else s for d, s in enumerate(shape))


def dropped_shape(shape, dims) -> tuple[int, ...]:
    return tuple(s for d, s in enumerate(shape) if d not in dims)


def reduction_info(node: fx.Node) -> ReductionInfo | None:
    if node.op != "call_function" or node.target not in REDUCTION_KINDS:
        return None
    x = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if not isinstance(x, torch.Tensor):
        return None
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if node.target in (aten.sum.default, aten.mean.default) or dims is None or len(dims) == 0:
        dims = range(x.dim())
    keepdim = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    if node.target in (aten.sum.default, aten.mean.default):
        keepdim = False
    norm = tuple(sorted({d % x.dim() for d in dims})) if x.dim() else ()
    return ReductionInfo(REDUCTION_KINDS[node.target], norm, keepdim, sizes(x), str(x.device))


def reduction_unsupported_reason(node: fx.Node, target: str) -> str | None:
    info = reduction_info(node)
    if info is None:
        return "not a reduction fxopt generates"
    x = node.args[0].meta["val"]
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor) or out.dtype not in SUPPORTED_DTYPES or x.dtype not in SUPPORTED_DTYPES:
        return f"reduction over dtype {x.dtype} has no Triton lowering"
    if out.dtype == torch.bool:
        return "a reduction to bool (sum(dtype=torch.bool) is a logical any) is left to ATen"
    if any(s == 0 for s in info.in_shape):
        return "empty reduction: left to ATen, which defines (or rejects) it"
    if x.dim() == 0:
        return "reduction of a 0-d tensor is a copy"
    if info.kind in ("amax", "amin") and not (x.dtype.is_floating_point or x.dtype in (torch.int32, torch.int64)):
        return f"{info.kind} over {x.dtype} is not lowered"
    return None


def is_column_sum_of(node: fx.Node, key) -> bool:
    """Whether `node` sums a tensor of the row group `key`'s shape over every dim the group keeps (the
    weight and bias gradients of a norm's backward), so that the group's row kernel can produce it as
    a column epilogue: rows reduced over the trailing dims and short enough to stay in registers (codegen
    keeps the row kernel persistent; a symbolic row length by its example value), a floating-point result."""
    info = reduction_info(node)
    shape, dims, device = key
    if info is None or info.kind != "sum" or info.in_shape != shape or info.device != device:
        return False
    xdims = tuple(d for d in range(len(shape)) if d not in dims)
    rnumel = 1
    for d in dims:  # a symbolic row length: its example value decides (codegen/column_sums.py serves any)
        rnumel *= hint(shape[d], shape_env_of_value(node.args[0].meta["val"])) if is_symbolic(shape[d]) else shape[d]
    return (bool(xdims) and info.dims == xdims and reduces_trailing_dims(shape, dims)
            and rnumel <= ROW_IN_REGISTERS and node.meta["val"].dtype.is_floating_point)


def reduces_trailing_dims(shape, dims) -> bool:
    """Whether `dims` are the last dims of `shape` (rows, as a norm or softmax reduces them)."""
    return tuple(dims) == tuple(range(len(shape) - len(dims), len(shape)))
