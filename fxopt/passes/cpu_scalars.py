"""A 0-d CPU tensor input that only feeds elementwise math on the GPU becomes a GPU scalar made from
its value, so that math fuses into the GPU kernels.

Under `dynamic=True` dynamo passes a module's float attribute (an RMSNorm's `self.eps`) as a 0-d
float64 CPU tensor. Eager reads it as a scalar; in the ATen graph it arrives as a CPU cast
(`convert_element_type(eps, float32)`) feeding `add(variance, eps)` on the GPU. Left so, the cast runs
as an ATen call on the CPU and the add cannot join the GPU kernel (its input is on another device),
and the graph, holding two devices, loses the wrapper's device guard and C allocator: twice the host
time of the static graph for a Llama block on the H200 (benchmarks/results/2026-12-01-h200-i.md).

The rewrite: `s = eps.item()` (a CPU read, no GPU sync), `q = scalar_tensor(s, dtype, device)` (a
cast of the input becomes such a scalar in the cast's dtype: same rounding, no cast kernel), and the
scalar's elementwise chain (`chain`: pointwise nodes whose values are 0-d CPU tensors computed
from it) is computed from q on the GPU. Same values: the chain's ops see the same number in the same
dtype, and a 0-d tensor takes part in type promotion the same way on either device. Only where every
use of the chain is itself pointwise on the GPU (so nothing downstream, no graph output, sees the
value change device); other uses of the input keep reading the CPU tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ..analysis.op_classes import POINTWISE_OPS, is_cpu_scalar, tensor_devices
from ..pass_manager import PassContext, PassResult

aten, prims = torch.ops.aten, torch.ops.prims


def _cpu_scalar(node: fx.Node) -> bool:
    return is_cpu_scalar(node.meta.get("val"))


def _on_gpu_pointwise(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return (node.op == "call_function" and node.target in POINTWISE_OPS and isinstance(val, torch.Tensor)
            and val.device.type == "cuda")


def scalar_chain(p: fx.Node) -> tuple[list[fx.Node], set[fx.Node]] | None:
    """(chain, frontier) for a CPU scalar input p: the pointwise nodes computing 0-d CPU values from p
    (in graph order), and the GPU pointwise nodes that read p or the chain. None when anything else
    reads the chain's values, or nothing on the GPU reads them."""
    chain, frontier, stack = set(), set(), [p]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in chain or u in frontier:
                continue
            if u.op == "call_function" and u.target in POINTWISE_OPS and _cpu_scalar(u):
                if any(isinstance(a, fx.Node) and a is not p and a not in chain and not _cpu_scalar(a)
                       for a in u.all_input_nodes):
                    return None
                chain.add(u)
                stack.append(u)
            elif _on_gpu_pointwise(u):
                frontier.add(u)
            elif n is not p:  # a chain value read by an ATen op, a graph output, ...: leave it on the CPU
                return None
    if not frontier:
        return None
    order = {n: i for i, n in enumerate(p.graph.nodes)}
    return sorted(chain, key=order.__getitem__), frontier


def _graph_cuda_device(gm: fx.GraphModule) -> torch.device | None:
    devices = {d for d in tensor_devices(gm) if d.type == "cuda"}
    return devices.pop() if len(devices) == 1 else None


def _fake_like(node: fx.Node, fake_mode) -> torch.Tensor:
    """node's value recomputed on fake tensors (its inputs' values as they now are)."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
    with fake_mode:
        return node.target(*args, **kwargs)


def _cast_dtype(node: fx.Node, p: fx.Node) -> torch.dtype | None:
    """The dtype node casts p to, when it is nothing but that cast (no device or layout change)."""
    if node.target is prims.convert_element_type.default and node.args[0] is p and not node.kwargs:
        return node.args[1]
    if node.target is aten._to_copy.default and node.args == (p,) and set(node.kwargs) <= {"dtype", "device"}:
        if node.kwargs.get("device") in (None, torch.device("cpu")):
            return node.kwargs.get("dtype")
    return None


@dataclass(frozen=True)
class ScalarsToDevice:
    name: str = "cpu_scalars_to_device"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        device = _graph_cuda_device(gm) if ctx.device_type == "cuda" else None
        moved = 0
        for p in [n for n in gm.graph.nodes if n.op == "placeholder"] if device else []:
            val = p.meta.get("val")
            found = scalar_chain(p) if _cpu_scalar(p) and val.dtype.is_floating_point else None
            if found is None:
                continue
            chain, frontier = found
            fake_mode = next(iter(frontier)).meta["val"].fake_mode
            with gm.graph.inserting_before(next(n for n in gm.graph.nodes if n.op != "placeholder")):
                s = gm.graph.call_function(aten._local_scalar_dense.default, (p,))  # before every reader

            def scalar(dtype: torch.dtype) -> fx.Node:
                """`scalar_tensor(s, dtype)` on the GPU: s rounded to dtype, as a cast of p rounds it."""
                with gm.graph.inserting_after(s):
                    q = gm.graph.call_function(aten.scalar_tensor.default, (s,), {"dtype": dtype, "device": device})
                with fake_mode:
                    q.meta["val"] = torch.empty((), dtype=dtype, device=device)
                return q

            for cast in [n for n in chain if _cast_dtype(n, p) is not None]:  # made in their dtype: no cast kernel
                cast.replace_all_uses_with(scalar(_cast_dtype(cast, p)))
                gm.graph.erase_node(cast)
                chain.remove(cast)
            readers = [u for u in (*chain, *frontier) if p in u.all_input_nodes]
            if readers:
                q = scalar(val.dtype)
                for u in readers:
                    u.replace_input_with(p, q)
            for n in chain:
                n.meta["val"] = _fake_like(n, fake_mode)
            moved += 1
        if moved:
            gm.graph.lint()
            gm.recompile()
        return PassResult(gm, bool(moved), {"moved": moved})
