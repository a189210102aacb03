"""A 16-bit matmul whose only use is a cast up to float32 becomes one matmul that writes float32.

Mixed-precision training computes every weight gradient as a bf16/fp16 matmul and casts it up to the
float32 master weight (`_to_copy(mm(a, b), dtype=float32)`): a separate kernel per Linear that reads
and writes the whole gradient again, one more launch and one more buffer on every step. `aten.mm.dtype`
(`torch.mm(a, b, out_dtype=torch.float32)`) has cuBLAS keep its float32 accumulator and write it
directly: no cast kernel, and no rounding to 16 bits before the cast (the result is closer to float64
than the cast's, never further).

Only on CUDA graphs: `mm.dtype` has no CPU kernel, and the interpreter runs CPU graphs.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..pass_manager import PassContext, PassResult

aten, prims = torch.ops.aten, torch.ops.prims
_LOW = (torch.bfloat16, torch.float16)
_MM_DTYPE = getattr(aten.mm, "dtype", None)  # torch >= 2.8


def up_cast_to_fp32(node: fx.Node) -> fx.Node | None:
    """The tensor `node` casts to float32 (and nothing else: same device, layout, memory format), or None."""
    if node.op != "call_function":
        return None
    if node.target is prims.convert_element_type.default and node.args[1:] == (torch.float32,) and not node.kwargs:
        return node.args[0]
    if node.target is aten._to_copy.default and len(node.args) == 1 and node.kwargs.get("dtype") is torch.float32:
        if set(node.kwargs) <= {"dtype", "layout", "device", "memory_format"}:
            src = node.args[0].meta.get("val")
            same_device = node.kwargs.get("device") in (None, getattr(src, "device", None))
            plain_layout = node.kwargs.get("layout") in (None, torch.strided)
            keeps_format = node.kwargs.get("memory_format") in (None, torch.preserve_format)
            if same_device and plain_layout and keeps_format:
                return node.args[0]
    return None


def foldable_matmul(node: fx.Node) -> bool:
    """A 16-bit mm on CUDA whose result is read by nothing but casts to float32."""
    val = node.meta.get("val")
    return (node.op == "call_function" and node.target is aten.mm.default and isinstance(val, torch.Tensor)
            and val.dtype in _LOW and val.device.type == "cuda"
            and all(up_cast_to_fp32(u) is node for u in node.users))


@dataclass(frozen=True)
class FoldMatmulCasts:
    name: str = "fold_matmul_casts"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        folded = 0
        if ctx.device_type != "cuda" or _MM_DTYPE is None:
            return PassResult(gm, False, {"folded": 0})
        for mm in list(gm.graph.nodes):
            if not mm.users or not foldable_matmul(mm):
                continue
            a, b = mm.args
            with gm.graph.inserting_after(mm):
                wide = gm.graph.call_function(_MM_DTYPE, (a, b, torch.float32))
            with getattr(mm.meta["val"], "fake_mode", None) or contextlib.nullcontext():
                wide.meta["val"] = _MM_DTYPE(a.meta["val"], b.meta["val"], torch.float32)
            for cast in list(mm.users):
                cast.replace_all_uses_with(wide)
                gm.graph.erase_node(cast)
            gm.graph.erase_node(mm)
            folded += 1
        if folded:
            gm.graph.lint()
            gm.recompile()
        return PassResult(gm, bool(folded), {"folded": folded})
