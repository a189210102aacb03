"""Causal masks sliced to a symbolic length: the one mask that is known at compile time for every length.

Model code slices a constant causal buffer to the sequence length (nanoGPT's and GPT-2's
`bias[:, :, :T, :T]`). With symbolic sizes the slice is not a compile-time constant, but its value
is: every top-left square of a lower-triangular matrix is lower-triangular. `sliced_causal` accepts
exactly that shape:
  - one `getitem` G slices a constant (a module buffer, or built from constants) to `[..., :Tq, :Tk]`
    on its last two dims, nothing else, with Tq and Tk provably the scores' query and key lengths,
    which are provably equal (dynamo has already guarded the slice's length against the buffer's);
  - between G and the mask only elementwise ops whose other operands are constants or Python scalars
    (not values of the sizes), so slicing commutes with them;
  - evaluated on the whole buffer (G without its bounds), the mask keeps exactly the causal pattern.
The facts are then those of a static causal mask: the kernel skips masked blocks and reads no mask,
and the buffer is guarded like any compile-time mask. Anything else returns None (the caller reads
the mask per call instead)."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .constant_values import call_name
from .torch_ops import meta, provably_equal

MAX_CHECKED = 8192  # longest buffer checked element by element at compile time (64 MiB of bools)

# Elementwise ops a slice commutes with (functions and methods dynamo records for mask code).
MASK_ELEMENTWISE = frozenset({
    "eq", "ne", "lt", "le", "gt", "ge", "logical_not", "invert", "bitwise_not", "neg", "to", "type", "float",
    "bool", "half", "bfloat16", "where", "masked_fill", "mul", "add", "sub", "truediv", "logical_and",
    "logical_or", "and_", "or_", "__invert__", "__eq__", "__ne__", "__and__", "__or__",
})


def _bounded_slices(node: fx.Node) -> tuple | None:
    """The index of `x[..., :a, :b]` when its last two entries end at graph values (sizes), start at 0
    (or at a size provably 0, as HF's `Tk - Tq` is without a cache) and every other entry takes the
    whole dim: (a, b), else None."""
    if node.op != "call_function" or node.target is not operator.getitem or not isinstance(node.args[1], tuple):
        return None
    index = node.args[1]
    if len(index) < 2 or not all(isinstance(i, slice) for i in index):
        return None
    *lead, rows, cols = index
    if any(i != slice(None) for i in lead):
        return None
    for s in (rows, cols):
        zero_start = s.start is None or (isinstance(s.start, fx.Node) and provably_equal(meta(s.start), 0)) \
            or (not isinstance(s.start, fx.Node) and s.start == 0)
        if not zero_start or s.step not in (None, 1) or not isinstance(s.stop, fx.Node):
            return None
    return rows.stop, cols.stop


def _sliced_getitem(node: fx.Node, values) -> fx.Node | None:
    """The one bounded slice G of a constant that `node` is computed from through elementwise ops."""
    found = []
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if values.is_constant(n):
            continue
        if _bounded_slices(n) is not None and values.is_constant(n.args[0]):
            found.append(n)
            continue
        if n.op not in ("call_function", "call_method") or call_name(n) not in MASK_ELEMENTWISE:
            return None
        if any(not isinstance(meta(a), torch.Tensor) for a in n.all_input_nodes):
            return None  # a value of the sizes (a SymInt or SymFloat operand): not the same for every length
        todo += n.all_input_nodes
    return found[0] if len(found) == 1 else None


def sliced_causal(tensor: fx.Node, keep_of, values, score_shape) -> tuple | None:
    """(buffer placeholders the fact reads) when the mask node `tensor` is a causal buffer sliced to the
    symbolic length, else None. keep_of(value, shape) -> bool tensor of the scores it keeps."""
    if not isinstance(tensor, fx.Node) or not provably_equal(score_shape[-2], score_shape[-1]):
        return None
    g = _sliced_getitem(tensor, values)
    if g is None:
        return None
    rows, cols = _bounded_slices(g)
    if not (provably_equal(meta(rows), score_shape[-2]) and provably_equal(meta(cols), score_shape[-1])):
        return None
    base = values.value(g.args[0])
    whole = base[tuple(slice(None) for _ in g.args[1])]
    length = whole.shape[-1]
    if whole.dim() < 2 or whole.shape[-2] != length or length > MAX_CHECKED:
        return None
    full = values.value_with(tensor, {g: whole})
    keep = keep_of(full, (*whole.shape[:-2], length, length))
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    if not bool((keep == causal).all()):
        return None
    return tuple(values.buffers_used(g.args[0]))
