"""Liveness of the buffers the wrapper allocates, in final node order.

A buffer is born at the node that writes it (a fused kernel's output, or an ATen call that is not a
view) and dies at the last node that reads it or any view of it. Graph inputs are not buffers the
wrapper allocates; graph outputs (and views of them) live to the end, and are marked so the planner
never lets later buffers reuse their memory.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .op_classes import is_view


@dataclass
class Interval:
    name: str
    nbytes: int
    first_use: int  # position of the node that writes it
    last_use: int  # position of the last node that reads it (or a view of it)
    is_output: bool = False


def _tensor_bytes(val) -> int:
    if not isinstance(val, torch.Tensor):
        return 0
    # the storage the tensor spans: a strided tensor needs the furthest element + 1
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(val.shape, val.stride())) if val.numel() else 0
    return span * val.element_size()


def _owner(node: fx.Node, owners: dict) -> fx.Node | None:
    """The buffer-owning node a value lives in: itself, or what its view chain starts from."""
    while node is not None and node not in owners:
        if is_view(node) or (node.op == "call_function" and node.target is operator.getitem
                             and node.args[0].op != "call_module"):
            node = node.args[0] if isinstance(node.args[0], fx.Node) else None
        else:
            return None
    return node


def buffer_intervals(gm: fx.GraphModule) -> list[Interval]:
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    owners: dict[fx.Node, Interval] = {}
    for n in nodes:
        if n.op == "call_module" and isinstance(n.meta.get("val"), tuple):
            for u in n.users:  # a multi-output kernel writes one buffer per getitem
                owners[u] = Interval(u.name, _tensor_bytes(u.meta.get("val")), position[n], position[n])
        elif n.op == "call_module" or (n.op == "call_function" and not is_view(n)
                                      and n.target is not operator.getitem):
            size = _tensor_bytes(n.meta.get("val"))
            if size:
                owners[n] = Interval(n.name, size, position[n], position[n])
    end = len(nodes) - 1
    for n in nodes:
        for a in n.all_input_nodes:
            owner = _owner(a, owners)
            if owner is None:
                continue
            iv = owners[owner]
            if n.op == "output":
                iv.last_use, iv.is_output = end, True
            else:
                iv.last_use = max(iv.last_use, position[n])
    return sorted(owners.values(), key=lambda iv: (iv.first_use, iv.name))
