"""Causal masks built in the graph from a symbolic length: `torch.triu(torch.ones(T, T), 1)` and kin.

Model code often builds the mask in the forward from the sequence length T (`triu(ones(T, T),
diagonal=1)` then `masked_fill(mask, -inf)`, `tril(ones(T, T))` then `masked_fill(mask == 0, -inf)`,
the additive `full((T, T), -inf).triu(1)`). With static sizes such a mask is a compile-time constant
(attention_masks.py evaluates it); with a symbolic T it is not, but its pattern is the same for
every T when the mask is exactly
  - one `triu`/`tril` with a constant diagonal, of a constant-filled `ones`/`full` whose sizes are
    provably the scores' query and key lengths, which are provably equal;
  - then only elementwise ops whose other operands are scalars, and views that add unit leading
    dims (or expand them), so that every entry is g(inside the triangle), g not depending on T;
  - sizes all the one length symbol.
Entry (i, j) is then g applied to "j - i >= d" (triu) or "j - i <= d" (tril), for any T. The pattern
at T = 2 and T = 5 decides g and d: when the mask keeps exactly the causal entries there, it does for
every T (dynamo's symbols are >= 2). The kernel then skips masked blocks and reads no mask."""
from __future__ import annotations

import torch
import torch.fx as fx

from .constant_values import call_name
from .sliced_masks import MASK_ELEMENTWISE
from .torch_ops import meta, provably_equal

CHECKED_LENGTHS = (2, 5)
_TRIANGLES = frozenset({"triu", "tril"})
_FILLED = frozenset({"ones", "full"})
_LEADING_VIEWS = frozenset({"view", "reshape", "unsqueeze", "expand"})


def _is_call(node) -> bool:
    return isinstance(node, fx.Node) and node.op in ("call_function", "call_method")


def _diagonal(node: fx.Node):
    d = node.args[1] if len(node.args) > 1 else node.kwargs.get("diagonal", 0)
    return d if isinstance(d, int) and not isinstance(d, bool) else None


def _square_of(node: fx.Node, length) -> bool:
    """The node's value is [1, ..., 1 or any, length, length] (leading dims only broadcast)."""
    v = meta(node)
    if not isinstance(v, torch.Tensor) or v.dim() < 2:
        return False
    lead_ok = call_name(node) == "expand" or all(provably_equal(s, 1) for s in v.shape[:-2])
    return lead_ok and provably_equal(v.shape[-2], length) and provably_equal(v.shape[-1], length)


class _Walk:
    """The mask's ancestry, checked against the shape above; `ok` False at the first thing outside it."""

    def __init__(self, values, length):
        self.values, self.length = values, length
        self.triangles: list[fx.Node] = []
        self.sizes: list[fx.Node] = []
        self.ok = True

    def visit(self, node) -> None:
        if not self.ok or not isinstance(node, fx.Node):
            return
        v = meta(node)
        if isinstance(v, torch.SymInt):  # a size: must be the length itself, evaluated as given lengths
            self.ok = provably_equal(v, self.length)
            self.sizes.append(node)
            return
        name = call_name(node) if _is_call(node) else None
        if name in _TRIANGLES:
            self._triangle(node)
        elif name in _LEADING_VIEWS and _square_of(node, self.length):
            for a in node.all_input_nodes:
                self.visit(a)
        elif name in MASK_ELEMENTWISE:
            self._elementwise(node)
        else:
            self.ok = False

    def _triangle(self, node: fx.Node) -> None:
        src = node.args[0]
        self.triangles.append(node)
        self.ok = (_diagonal(node) is not None and _is_call(src) and call_name(src) in _FILLED
                   and _square_of(src, self.length) and meta(src).dim() == 2)
        for a in src.all_input_nodes if self.ok else ():
            self.visit(a) if isinstance(meta(a), torch.SymInt) else self._scalar(a)

    def _elementwise(self, node: fx.Node) -> None:
        tensors = [a for a in node.all_input_nodes if isinstance(meta(a), torch.Tensor)]
        lineage = [a for a in tensors if not self.values.is_constant(a)]
        for a in tensors:
            if a not in lineage:
                self._scalar(a)
        for a in lineage:
            self.visit(a)
        for a in node.all_input_nodes:
            if not isinstance(meta(a), torch.Tensor):
                self.ok = False  # a size (or a scalar of sizes) used as a value: it may change with T

    def _scalar(self, node: fx.Node) -> None:
        if not self.values.is_constant(node):
            self.ok = False
            return
        value = self.values.value(node)
        self.ok = self.ok and (not isinstance(value, torch.Tensor) or value.numel() == 1)


def built_causal(tensor, keep_of, values, score_shape) -> bool:
    """True when the mask node `tensor` is a triangle built in the graph over the symbolic length whose
    kept entries are the causal ones for every length. keep_of(value, shape) -> bool tensor of the
    scores it keeps."""
    length = score_shape[-1]
    if not isinstance(tensor, fx.Node) or not provably_equal(score_shape[-2], length):
        return False
    walk = _Walk(values, length)
    walk.visit(tensor)
    if not walk.ok or len(walk.triangles) != 1 or not walk.sizes:
        return False
    for n in CHECKED_LENGTHS:
        try:
            value = values.value_with(tensor, {s: n for s in walk.sizes})
        except Exception:  # noqa: BLE001 (anything that cannot be evaluated is simply not this shape)
            return False
        if not isinstance(value, torch.Tensor):
            return False
        keep = keep_of(value.cpu(), tuple(value.shape))
        if not bool((keep == torch.ones(n, n, dtype=torch.bool).tril()).all()):
            return False
    return True
