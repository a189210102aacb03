"""Read torch-level (dynamo) graph nodes as canonical ops, whatever spelling the model used.

Dynamo records a model's own calls: `q @ k.transpose(-2, -1)` is `operator.matmul`, `torch.matmul`,
`torch.bmm` or the `matmul` method; a cast is `.float()`, `.to(torch.float32)`, `.type(...)` or
`.type_as(x)`. Matchers ask `op_of(node)` for one name per meaning and `arg(node, i, name)` for an
argument wherever it was passed, so a pattern is written once.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

_FUNCTIONS = {
    torch.matmul: "matmul", operator.matmul: "matmul", torch.bmm: "matmul",
    operator.mul: "mul", torch.mul: "mul", operator.truediv: "div", torch.div: "div",
    operator.add: "add", torch.add: "add",
    torch.softmax: "softmax", F.softmax: "softmax",
    torch.masked_fill: "masked_fill", torch.where: "where",
    F.dropout: "dropout", torch.dropout: "dropout",
    torch.transpose: "transpose", torch.permute: "permute",
    torch.repeat_interleave: "repeat_interleave",
    operator.getitem: "getitem",
    F.scaled_dot_product_attention: "sdpa",
}
_METHODS = {
    "matmul": "matmul", "bmm": "matmul", "mul": "mul", "div": "div", "add": "add",
    "softmax": "softmax", "masked_fill": "masked_fill", "transpose": "transpose", "permute": "permute",
    "float": "cast", "half": "cast", "bfloat16": "cast", "to": "cast", "type": "cast", "type_as": "cast",
    "view": "reshape", "reshape": "reshape", "expand": "expand", "repeat_interleave": "repeat_interleave",
    "contiguous": "contiguous", "unsqueeze": "unsqueeze",
}
LOW_FLOATS = (torch.float16, torch.bfloat16)
_RANDOM_WORDS = ("rand", "dropout", "bernoulli", "normal", "multinomial")


def op_of(node) -> str | None:
    """The canonical op name of a call node, or None for anything this module does not know."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_function":
        return _FUNCTIONS.get(node.target)
    if node.op == "call_method":
        return _METHODS.get(node.target)
    return None


def is_random(node: fx.Node) -> bool:
    """Ops whose value changes from call to call: never evaluated at compile time."""
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return any(word in name for word in _RANDOM_WORDS)


def arg(node: fx.Node, index: int, name: str, default=None):
    """Argument `name`, passed positionally at `index` or by keyword."""
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get(name, default)


def module_attribute(module, target: str, default=None):
    """What a get_attr / call_module target names in `module` ("a.b" is module.a.b); `default` where a
    part is missing."""
    for part in str(target).split("."):
        module = getattr(module, part, _MISSING)
        if module is _MISSING:
            return default
    return module


_MISSING = object()


def meta(value):
    """The example value (a fake tensor) dynamo recorded for a node; plain values pass through."""
    return value.meta.get("example_value") if isinstance(value, fx.Node) else value


def shape(value) -> tuple[int, ...] | None:
    v = meta(value)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def provably_equal(a, b) -> bool:
    """Sizes (or tuples of sizes) equal for every value their symbols may take. Decided without adding
    a guard (dynamo has finished; a guard added now could be lost): "not provably equal" is not a match."""
    if isinstance(a, tuple) or isinstance(b, tuple):
        return len(a) == len(b) and all(provably_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return statically_known_true(a == b)


def dtype(value) -> torch.dtype | None:
    v = meta(value)
    return v.dtype if isinstance(v, torch.Tensor) else None


def cast_target(node: fx.Node) -> torch.dtype | None:
    """The dtype a cast node produces (only for nodes whose op_of is "cast")."""
    return dtype(node)


def upcast_source(node) -> fx.Node | None:
    """The bf16/fp16 tensor under a float32 up-cast (`.float()`, `.to(torch.float32)`, `.type_as(f32)`),
    else None. Fused ops that accumulate in fp32 anyway (attention's dot, cross-entropy) read the source."""
    if op_of(node) != "cast" or dtype(node) != torch.float32:
        return None
    src = node.args[0]
    if isinstance(src, fx.Node) and dtype(src) in LOW_FLOATS and meta(src).device == meta(node).device:
        return src
    return None


def is_identity_dropout(node: fx.Node) -> bool:
    """F.dropout(x, p, training) that does nothing: eval mode or p == 0."""
    p = arg(node, 1, "p", 0.5)
    training = arg(node, 2, "training" if node.target is F.dropout else "train", True)
    return isinstance(p, (int, float)) and (p == 0 or training is False)


def casts_to_the_matmul_dtype(cast: fx.Node) -> bool:
    """The probabilities rounded to the dtype of the P @ V result (fp32 softmax cast back to bf16 before the
    matmul), which the kernel does too, when the next user is that matmul, past do-nothing dropout (HF
    GPT-2: `.type(value.dtype)`, then `attn_dropout` in eval mode)."""
    user = next(iter(cast.users)) if len(cast.users) == 1 else None
    while user is not None and op_of(user) == "dropout" and is_identity_dropout(user):
        user = next(iter(user.users)) if len(user.users) == 1 else None
    return user is not None and op_of(user) == "matmul" and dtype(user) == dtype(cast)


def swaps_last_two(node: fx.Node) -> bool:
    """transpose(-2, -1) / transpose(2, 3) on 4-D / permute(..., last, second-last)."""
    rank = len(shape(node) or ())
    op = op_of(node)
    if op == "transpose" and len(node.args) >= 3:
        dims = {d % rank for d in node.args[1:3] if isinstance(d, int)}
        return dims == {rank - 2, rank - 1}
    if op == "permute":
        dims = permute_dims(node, rank)
        return dims == list(range(rank - 2)) + [rank - 1, rank - 2]
    return False


def permute_dims(node: fx.Node, rank: int) -> list[int] | None:
    """The dims of `x.permute(1, 0)`, `x.permute((1, 0))`, `x.permute(dims=(1, 0))` or
    `torch.permute(x, dims)`, each taken modulo rank; None where one is not a plain int."""
    dims = node.args[1:] if len(node.args) > 2 else arg(node, 1, "dims")
    if not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) for d in dims):
        return None
    return [d % rank for d in dims] if rank else None


def widening_cast(cast: fx.Node) -> bool:
    """A cast that keeps every value: to the same dtype, or from a float to a float at least as wide and
    not bf16 <-> fp16 (`.float()` of bf16 scores). Anything else (`.to(int32)`, `.half()` of fp32) changes
    values the kernel would not change."""
    src, dst = dtype(cast.args[0]) if isinstance(cast.args[0], fx.Node) else None, dtype(cast)
    if src is None or dst is None:
        return False
    widens = src.is_floating_point and dst in (torch.float32, torch.float64) and src.itemsize <= dst.itemsize
    return src == dst or widens


def new_axis_at_2(node: fx.Node) -> bool:
    """x[:, :, None] (trailing full slices or ... allowed) or x.unsqueeze(2): a pure new axis, no index that
    picks or reorders heads (x[:, [1, 0], None] is not a grouped-query repeat of x)."""
    if op_of(node) == "unsqueeze":
        return arg(node, 1, "dim") in (2, -3)
    if op_of(node) != "getitem" or not isinstance(node.args[1], tuple):
        return False
    idx = list(node.args[1])
    full = slice(None, None, None)
    while idx and (idx[-1] is Ellipsis or idx[-1] == full) and len(idx) > 3:
        idx.pop()
    return len(idx) == 3 and idx[0] == full and idx[1] == full and idx[2] is None


# calls dynamo records for `with torch.no_grad()` / `inference_mode()` / `torch.autocast(...)` regions
GRAD_MODE_SWITCHES = ("_set_grad_enabled", "_enter_inference_mode", "_exit_inference_mode")
AUTOCAST_SWITCHES = ("_enter_autocast", "_exit_autocast")


def state_switch(node: fx.Node) -> str | None:
    """"grad", "autocast" or "functorch" for a call that switches that process state, else None."""
    if node.op != "call_function":
        return None
    name = getattr(node.target, "__name__", "")
    if name in GRAD_MODE_SWITCHES:
        return "grad"
    if name in AUTOCAST_SWITCHES:
        return "autocast"
    if str(getattr(node.target, "__module__", "")).startswith("torch._C._functorch"):
        return "functorch"
    return None


def functorch_transform_inside(gm: fx.GraphModule) -> bool:
    """Whether dynamo captured a torch.func transform inside the graph (`torch.compile(torch.func.grad(f))`:
    calls of torch._C._functorch's nesting and wrapping functions). fxopt's own ops have no functorch
    rules, so the passes that make them leave such a graph as written."""
    return any(n.op == "call_function" and str(getattr(n.target, "__module__", "")).startswith(
        ("torch._C._functorch", "torch._functorch")) for n in gm.graph.nodes)


def grad_enabled_at(node: fx.Node) -> bool:
    """Whether grad mode is on where `node` runs: dynamo records `with torch.no_grad():` (and
    enable_grad, set_grad_enabled) as `torch._C._set_grad_enabled(mode)` calls and `with
    torch.inference_mode():` as `_enter_inference_mode(mode)` ... `_exit_inference_mode(ctx)`; the graph
    starts in the mode it was traced in, the compiling thread's (dynamo guards on it)."""
    enabled, saved = torch.is_grad_enabled(), []
    for n in node.graph.nodes:
        if n is node:
            break
        name = getattr(n.target, "__name__", "") if n.op == "call_function" else ""
        if n.target is torch._C._set_grad_enabled and isinstance(n.args[0], bool):
            enabled = n.args[0]
        elif name == "_enter_inference_mode":
            saved.append(enabled)
            enabled = enabled and n.args[0] is False
        elif name == "_exit_inference_mode" and saved:
            enabled = saved.pop()
    return enabled
