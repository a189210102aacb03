"""torch dtypes as Triton spells them, and the dtype a value is computed in inside a kernel."""
from __future__ import annotations

import math

import torch

TL_DTYPE = {
    torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
    torch.float64: "tl.float64", torch.int64: "tl.int64", torch.int32: "tl.int32", torch.int16: "tl.int16",
    torch.int8: "tl.int8", torch.uint8: "tl.uint8", torch.bool: "tl.int1",
}
LOW_PRECISION = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """bf16/fp16 values are computed in fp32 inside kernels; everything else in its own dtype."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


def literal(value, dtype: torch.dtype) -> str:
    """A Python scalar written as a literal of `dtype` in Triton source."""
    if dtype == torch.bool:
        return "True" if value else "False"
    if dtype.is_floating_point:
        v = float(value)
        if math.isnan(v):
            return 'float("nan")'
        if math.isinf(v):
            return 'float("inf")' if v > 0 else 'float("-inf")'
        return repr(v)
    return str(int(value))


def cast_via(source: torch.dtype | None, out: torch.dtype) -> str | None:
    """The Triton dtype a cast from `source` to `out` must pass through to round or wrap as eager's
    does, or None. Eager converts float64 and integers to bf16/fp16 through float32 (two roundings;
    the GPU's one-step cvt rounds 2^24 + 2^16 + 1 differently), and floats to 8/16-bit integers through
    int64 (wrapping: -1.5 -> uint8 255; the GPU's cvt to a narrow integer saturates negatives to 0)."""
    if source is None or source == torch.bool:
        return None
    if out in LOW_PRECISION and (source == torch.float64 or not source.is_floating_point):
        return "tl.float32"
    if out in (torch.int8, torch.uint8, torch.int16) and source.is_floating_point:
        return "tl.int64"
    return None
