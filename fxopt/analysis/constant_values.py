"""Compile-time values of torch-level nodes that depend only on constants and module buffers.

Masks in model code are often built in the graph (`torch.ones(T, T).tril()`, `full(-inf).triu(1)`)
or sliced from a registered buffer (GPT-2's `bias[:, :, :T, :T]`). With static shapes their value is
fixed, so fxopt computes it once from the example inputs and turns it into a fact (causal or not).
A buffer can still be changed in place later; whoever relies on a buffer's value records a guard
(see `buffers_used`) that is checked on every call.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from .torch_ops import is_random, module_attribute

# Ops whose result may share memory with their input: a write into the result writes into the input.
_VIEW_NAMES = frozenset({
    "getitem", "view", "view_as", "reshape", "expand", "expand_as", "transpose", "permute", "t", "unsqueeze",
    "squeeze", "narrow", "select", "slice", "as_strided", "diagonal", "unflatten", "flatten", "split", "chunk",
    "unbind", "movedim", "swapaxes", "contiguous", "to", "type_as", "detach", "alias", "real", "imag", "mT", "T",
})
# In-place writes dynamo records as functions (methods ending in "_" are in-place by convention).
_INPLACE_FUNCTIONS = frozenset({"setitem", "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow",
                                "iand", "ior", "ixor", "ilshift", "irshift"})


_OPERATOR_FUNCTIONS = frozenset(v for v in vars(operator).values() if callable(v))


def call_name(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def _writes_in_place(node: fx.Node) -> bool:
    name = call_name(node)
    if node.op == "call_method":
        return name.endswith("_") and not name.endswith("__")
    if node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            return True
        if node.target in _OPERATOR_FUNCTIONS:  # operator.and_ / or_ / not_ make new values
            return name in _INPLACE_FUNCTIONS
        return name in _INPLACE_FUNCTIONS or (name.endswith("_") and not name.endswith("__"))
    return False


def _reachable(start: fx.Node, step):
    """start and every node reachable from it by `step(node) -> nodes`, each once."""
    seen, stack = set(), [start]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            yield n
            stack.extend(step(n))


def written_in_place(node: fx.Node) -> bool:
    """Does the graph write into this value, directly or through a view of it? Then its value at
    compile time is not the value the graph reads later (HF Llama writes the padding into a clone of
    its constant causal mask with `mask[..., :n] = ...`)."""
    views = _reachable(node, lambda n: [u for u in n.users if call_name(u) in _VIEW_NAMES and u.args and u.args[0] is n])
    return any(_writes_in_place(user) and user.args and user.args[0] is n for n in views for user in n.users)


def _grapharg_value(node: fx.Node):
    """The real tensor dynamo recorded for a placeholder (a weak reference in its GraphArg), or None."""
    grapharg = node.meta.get("grapharg")
    ref = getattr(grapharg, "_example", None)
    value = ref() if callable(ref) else None
    return value if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor) else None


def buffer_value(node: fx.Node, example):
    """The value of a placeholder dynamo lifted from a module's registered buffers (not a user input,
    not a parameter), or None. Dynamo's DDP optimizer compiles each piece of a split graph on fake
    example inputs; the real buffer is then the one dynamo's GraphArg still refers to, if it matches the
    fake example's layout."""
    grapharg = node.meta.get("grapharg")
    source = getattr(getattr(grapharg, "source", None), "name", "")
    source = source() if callable(source) else source
    if not ("_buffers[" in str(source) or "_buffers_" in node.name) or not isinstance(example, torch.Tensor):
        return None
    if isinstance(example, FakeTensor):
        real = _grapharg_value(node)
        same = real is not None and (real.shape, real.stride(), real.dtype) == (example.shape, example.stride(),
                                                                                  example.dtype)
        example = real if same and real.device.type == example.device.type else None
    if example is None or isinstance(example, torch.nn.Parameter) or example.requires_grad:
        return None
    return example


def _call(node: fx.Node, value_of):
    """Run a call node on the values `value_of` gives its arguments."""
    args = fx.node.map_arg(node.args, value_of)
    kwargs = fx.node.map_arg(node.kwargs, value_of)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return node.target(*args, **kwargs)


class ConstantValues:
    def __init__(self, gm: fx.GraphModule, example_inputs):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        examples = list(example_inputs) if example_inputs is not None else []
        self.gm = gm
        self.index = {n: i for i, n in enumerate(placeholders)}
        values = {n: buffer_value(n, ex) for n, ex in zip(placeholders, examples)}
        self.buffers = {n: v for n, v in values.items() if v is not None}
        self._constant: dict[fx.Node, bool] = {}
        self._value: dict[fx.Node, object] = {}
        # whether a pass may give this graph new constants (buffers aot_autograd lifts to inputs): not a
        # higher-order op's body, whose operands the op passes explicitly
        self.takes_new_constants = True

    @classmethod
    def for_body(cls, body: fx.GraphModule, operands, outer: "ConstantValues") -> "ConstantValues":
        """The values of a higher-order op's body (a torch.utils.checkpoint region): its placeholders are
        the op's operands, so a body placeholder is a constant buffer when its operand is one of the outer
        graph, with the outer graph's input index (guards watch the outer input)."""
        values = cls(body, None)
        values.takes_new_constants = False
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        pairs = [(p, o) for p, o in zip(placeholders, operands) if isinstance(o, fx.Node)]
        values.index = {p: outer.index[o] for p, o in pairs if o in outer.index}
        values.buffers = {p: outer.buffers[o] for p, o in pairs if o in outer.buffers and outer.is_constant(o)}
        return values

    def is_constant(self, value) -> bool:
        if not isinstance(value, fx.Node):
            return not isinstance(value, (list, tuple)) or all(self.is_constant(v) for v in value)
        if value not in self._constant:
            self._constant[value] = self._decide(value)
        return self._constant[value]

    def _decide(self, node: fx.Node) -> bool:
        if written_in_place(node):
            return False
        if node.op == "placeholder":
            return node in self.buffers
        if node.op == "get_attr":
            return True
        if node.op not in ("call_function", "call_method") or is_random(node):
            return False
        return all(self.is_constant(a) for a in node.all_input_nodes)

    def value(self, value):
        """The compile-time value (only for `is_constant` nodes)."""
        if not isinstance(value, fx.Node):
            return value
        if value not in self._value:
            self._value[value] = self._evaluate(value)
        return self._value[value]

    def _evaluate(self, node: fx.Node):
        if node.op == "placeholder":
            return self.buffers[node]
        if node.op == "get_attr":
            return module_attribute(self.gm, node.target)
        return _call(node, self.value)

    def value_with(self, node: fx.Node, override: dict):
        """`node`'s value with the nodes in `override` standing for given values (which may make a
        non-constant node computable: sliced_masks evaluates a sliced mask on its whole buffer)."""
        if node in override:
            return override[node]
        if self.is_constant(node):
            return self.value(node)
        override[node] = _call(node, lambda a: self.value_with(a, override))
        return override[node]

    def buffers_used(self, node: fx.Node) -> list[fx.Node]:
        """The buffer placeholders a constant node's value comes from (what a guard must watch)."""
        return [n for n in _reachable(node, lambda n: n.all_input_nodes) if n in self.buffers]
