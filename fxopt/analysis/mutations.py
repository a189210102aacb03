"""Which values of a torch-level (dynamo) graph are written in place.

A pass that moves or shares reads of a value must not move one across a write: the precision pass
shares one cast of a value among its consumers (placed before the first), cancels a round trip through
a model's `.float()`, and in inference hoists a parameter's cast before the graph runs. A value written
in place (`u.add_(10)`, `x[:, :3] = ...`, `emb.weight` renormalised by `F.embedding(max_norm=...)`), or
any view of its storage, is read where the model reads it instead.
"""
from __future__ import annotations

import operator

import torch.fx as fx
import torch.nn.functional as F

# torch-level ops whose result shares args[0]'s storage (a write through one is a write to the other)
_VIEWS = frozenset({
    "view", "view_as", "reshape", "transpose", "t", "permute", "unsqueeze", "squeeze", "expand", "expand_as",
    "narrow", "select", "__getitem__", "getitem", "flatten", "unflatten", "split", "chunk", "unbind", "diagonal",
    "as_strided", "detach", "movedim", "swapaxes", "swapdims", "unfold", "contiguous", "view_as_real",
    "view_as_complex",
})
_IN_PLACE_OPERATORS = frozenset({
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
    operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
    operator.imatmul, operator.setitem,
})


# functions that renormalise their weight argument in place when given max_norm: (weight, max_norm) positions
_RENORMALISING = {F.embedding: (1, 3), F.embedding_bag: (1, 3)}


def _renormalised(node: fx.Node):
    """The weight F.embedding(..., max_norm=...) writes (dynamo keeps the call whole), else None."""
    spec = _RENORMALISING.get(node.target) if node.op == "call_function" else None
    if spec is None:
        return None
    weight_at, norm_at = spec
    max_norm = node.args[norm_at] if len(node.args) > norm_at else node.kwargs.get("max_norm")
    weight = node.args[weight_at] if len(node.args) > weight_at else node.kwargs.get("weight")
    return weight if max_norm is not None else None


def _name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        return getattr(node.target, "__name__", "")
    return ""


def writes_in_place(node: fx.Node) -> bool:
    """`x.add_(...)`, `torch.embedding_renorm_(w, ...)`, `x += y`, `x[i] = y`: the node writes its first
    argument."""
    if node.op == "call_function" and node.target in _IN_PLACE_OPERATORS:
        return True
    name = _name(node)
    return name.endswith("_") and not name.endswith("__")


def storage_root(value) -> fx.Node | None:
    """The node whose storage `value` views (itself when it is not a view)."""
    while isinstance(value, fx.Node) and _name(value) in _VIEWS and value.args:
        value = value.args[0]
    return value if isinstance(value, fx.Node) else None


class Mutations:
    """The storages a graph writes in place, by their root values."""

    def __init__(self, graph: fx.Graph):
        self.roots: set[fx.Node] = set()
        for n in graph.nodes:
            written = []
            if writes_in_place(n) and n.args:
                written.append(n.args[0])
            if isinstance(n.kwargs.get("out"), fx.Node):  # torch.add(a, b, out=c)
                written.append(n.kwargs["out"])
            written.append(_renormalised(n))
            self.roots.update(r for r in map(storage_root, written) if r is not None)

    def written(self, value) -> bool:
        """Whether `value`, or any value sharing its storage, is written in place somewhere in the graph."""
        return storage_root(value) in self.roots
