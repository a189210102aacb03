"""What a generated wrapper knows about its buffers' layouts: how it allocates them, and which values'
layouts are proven at codegen, so that views of them can be made without re-deriving the layout.

Kernel launches re-check only what can change between calls (`launch_checks`): Triton specialises a
kernel on its pointers' 16-byte alignment and its ints' values, and at most launch sites both are
fixed by construction.

Allocations go through torch's C allocator (wrapper_runtime.py) wherever the device is the guarded
one (with size and stride expressions under symbolic sizes). A value's layout is proven when the
wrapper made or checked it: inputs checked with check_layout, kernel outputs (allocated with their
meta strides), matmul results (ATen allocates them row-major) and views of these; views of proven
values are made with `reinterpret_tensor` (C, no dispatcher: ~1 us less each, and a training step
makes dozens), under symbolic sizes too (layouts compared structurally, never with a guard). A
`split` of a proven value (GPT-2's q, k, v from one matmul) is not called at all: its pieces are
reinterpret_tensor views at their storage offsets (the ATen split through its Python OpOverload cost
20-30 us per call on the H200 host).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..analysis.symbolic import (is_row_major, is_symbolic, plain_arithmetic, ptuple, row_major_strides, same,
                                 sizes, storage_offset, strides)
from .kernel import Kernel

_ATEN = torch.ops.aten
# Views the wrapper writes as Tensor methods (the same ATen op, without the Python OpOverload call:
# ~1.4 us less each) or, of proven values, with reinterpret_tensor. None moves the storage offset.
VIEW_METHODS = {_ATEN.view.default: "view", _ATEN.permute.default: "permute", _ATEN.t.default: "t",
                _ATEN.expand.default: "expand", _ATEN.unsqueeze.default: "unsqueeze", _ATEN.squeeze.dim: "squeeze"}
# ATen ops whose result is always a new row-major tensor, whatever their inputs' layouts
FRESH_CONTIGUOUS = {_ATEN.mm.default, _ATEN.mm.dtype, _ATEN.addmm.default, _ATEN.bmm.default}


def device_source(device: torch.device) -> str:
    return f'"{device}"'


def allocation(o, guarded: int | None) -> str:
    """Source allocating a kernel output like `o`: torch's C allocator for CPU tensors and for the
    guarded CUDA device (wrapper_runtime.py), torch.empty_strided with the device otherwise."""
    return _allocate(sizes(o), strides(o), o.dtype, o.device, guarded)


def scratch_allocation(shape, dtype, device: torch.device, guarded: int | None) -> str:
    """Source allocating a kernel's workspace (row-major [chunks, columns]) as `allocation` does, with
    size and stride expressions where the size is symbolic."""
    return _allocate(shape, row_major_strides(shape), dtype, device, guarded)


def _allocate(shape, stride, dtype, device: torch.device, guarded: int | None) -> str:
    size, stride = ptuple(shape), ptuple(stride)
    if device.type == "cpu":
        return f"empty_strided_cpu({size}, {stride}, {dtype})"
    if device.type == "cuda" and guarded is not None and device.index == guarded:
        return f"empty_strided_cuda({size}, {stride}, {dtype})"
    return f"empty_strided({size}, {stride}, dtype={dtype}, device={device_source(device)})"


SPLITS = {_ATEN.split_with_sizes.default, _ATEN.split.Tensor}


def known_layouts(gm: fx.GraphModule, kernels: dict[str, Kernel]) -> dict[fx.Node, tuple[fx.Node, object]]:
    """The view nodes whose base's layout is proven (see the module docstring), each with (the value
    to reinterpret, the storage-offset increment): the wrapper makes these with reinterpret_tensor and
    their meta layout (size and stride expressions under symbolic sizes). The pieces of a split of a
    proven value are among them (base: the split's input). A view of anything else (another ATen
    result, an input the wrapper does not check) keeps the view method, which checks as it goes."""
    proven, views = set(), {}
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if not _expressible_layout(val):
            continue
        origin = _origin(n, proven)
        if n.op == "placeholder":
            ok = any(u.op == "call_module" for u in n.users)  # the inputs generate_wrapper checks
        elif origin == "kernel":
            ok = _allocated_like(val, _kernel_output(n, kernels))
        elif origin == "matmul":
            ok = is_row_major(val)
        elif origin == "view":
            ok, views[n] = True, (n.args[0], 0)
        elif _split_piece(n, proven):
            base = n.args[0].args[0]
            ok, views[n] = True, (base, storage_offset(val) - storage_offset(base.meta["val"]))
        else:
            ok = False
        if ok:
            proven.add(n)
    return views


def elided_splits(gm: fx.GraphModule, known: dict) -> set[fx.Node]:
    """Split nodes the wrapper need not call: every user is a piece it makes with reinterpret_tensor."""
    return {n for n in gm.graph.nodes if n.op == "call_function" and n.target in SPLITS and n.users
            and all(u in known for u in n.users)}


def _split_piece(n: fx.Node, proven: set) -> bool:
    """`getitem(split(x, ...), i)` of a proven x: a view of x at an offset along the split dim."""
    if n.op != "call_function" or n.target is not operator.getitem or not isinstance(n.args[0], fx.Node):
        return False
    split = n.args[0]
    return split.op == "call_function" and split.target in SPLITS and split.args[0] in proven  # (expressible)


def aligned_values(gm: fx.GraphModule) -> set[fx.Node]:
    """Values whose data pointer is 16-byte aligned on every call by construction: kernel outputs (the
    caching allocator's blocks, or the memory plan's 256-byte aligned regions), matmul results and the
    attention op's results (fresh allocations), and views of these that keep the storage offset
    (VIEW_METHODS). Graph inputs are not: a caller may pass any view."""
    aligned = set()
    for n in gm.graph.nodes:
        if _origin(n, aligned):
            aligned.add(n)
    return aligned


# fxopt's own ops whose results are fresh allocations (torch.empty/empty_like in the op, or a new
# tensor from the reference path): aligned like any allocation
_FRESH_FXOPT = ("fxopt::flash_attention", "fxopt::flash_attention_backward")


def _origin(n: fx.Node, members: set) -> str | None:
    """Where the wrapper gets n's value from: "kernel" (a fused kernel's output: its call, or a getitem
    of it), "matmul" (FRESH_CONTIGUOUS), "fxopt" (the attention op's fresh results), "view" (a view of a
    value in `members` that keeps its storage offset), or None (inputs, other ATen results)."""
    if n.op == "call_module":
        return "kernel"
    if n.op != "call_function":
        return None
    if n.target is operator.getitem and isinstance(n.args[0], fx.Node):
        src = n.args[0]
        if src.op == "call_module":
            return "kernel"
        fresh = isinstance(src.target, torch._ops.OpOverload) and src.target._schema.name in _FRESH_FXOPT
        return "fxopt" if fresh else None
    if n.target in FRESH_CONTIGUOUS:
        return "matmul"
    return "view" if n.target in VIEW_METHODS and not n.kwargs and n.args[0] in members else None


def _kernel_output(n: fx.Node, kernels: dict[str, Kernel]) -> torch.Tensor:
    """The output spec the wrapper allocates a kernel value with (a single output, or a getitem's)."""
    if n.op == "call_module":
        return kernels[n.target].outputs[0]
    return kernels[n.args[0].target].outputs[n.args[1]]


def _expressible_layout(val) -> bool:
    """A tensor whose sizes and strides the wrapper can write: numbers, or + and * of size symbols."""
    return isinstance(val, torch.Tensor) and all(plain_arithmetic(d) for d in (*sizes(val), *strides(val)))


def _allocated_like(val: torch.Tensor, out: torch.Tensor) -> bool:
    """Same sizes and strides for every value of the size symbols (structural: no guard)."""
    pairs = [*zip(sizes(val), sizes(out)), *zip(strides(val), strides(out))]
    return val.dim() == out.dim() and all(same(a, b) for a, b in pairs)




def launch_checks(gm: fx.GraphModule, kernels: dict[str, Kernel], launched) -> dict[str, tuple[int, ...]]:
    """For every kernel the wrapper launches (by name): the argument positions whose specialisation can
    differ between calls, which fast_launch.FastKernel re-checks at each launch: pointers that are not
    `aligned_values` (graph inputs, other ATen results) and ints given as size expressions (symbolic
    sizes) or as per-call source. Workspaces and outputs are allocated by the wrapper and the other ints are literals in its
    source, the same on every call. Arguments are (inputs..., workspaces..., outputs..., ints)."""
    aligned = aligned_values(gm)
    checks = {}
    for n in gm.graph.nodes:
        if n.op != "call_module":
            continue
        inputs = [i for i, a in enumerate(n.args) if a not in aligned]
        for kk in launched(kernels[n.target]):
            first_int = len(n.args) + len(kk.workspaces) + len(kk.outputs)
            # a str is Python source the wrapper evaluates per call (column sums' XSTEPS): it varies too
            ints = [first_int + j for j, v in enumerate(kk.int_args) if is_symbolic(v) or isinstance(v, str)]
            checks[kk.name] = tuple(inputs + ints)
    return checks
