"""The Triton compiles fxopt's own ops (attention, cross-entropy) will ask for, found while their graph
compiles, so the precompile pool (or the compile workers) can do them before the first call, instead of
each first launch doing its own one after another.

An own op's kernels are chosen at run time from its inputs' layouts (tile configs, TMA or not,
decode or not), so the way to know which it compiles is to run it: each fxopt-op node of a CUDA graph
is called, as the wrapper will call it (codegen/direct_calls.py), on stand-in tensors with the node's
shapes, strides and dtypes, inside `compile_pool.capturing()`, which records every compile and skips
it (its launch does not run). The stand-ins are views of one scratch buffer, so this borrows one
input's worth of device memory for a moment, and the outputs the op allocates, up to STAND_IN_LIMIT.
Nodes whose values cannot be stood in for (symbolic sizes, a runtime scale tensor whose value picks
the path, too large) compile at their first launch.
"""
from __future__ import annotations

import inspect
import logging
import operator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from . import compile_pool, direct_calls
from .wrapper import own_op_callee

log = logging.getLogger("fxopt")
# Most device memory a node's stand-in call may take for its inputs and the outputs it allocates (also
# at most a quarter of what is free): a cross-entropy over a 128K vocabulary would borrow 8 GiB, kept
# reserved by the caching allocator afterwards; such a node's kernels compile at its first launch.
STAND_IN_LIMIT = 1 << 30


def own_op_compiles(gm: fx.GraphModule) -> list[tuple[object, str]]:
    """(JITFunction, serialised specialisation) of every kernel compile the graph's fxopt ops would do."""
    found = []
    for n in gm.graph.nodes:
        callee = own_op_callee(n) if n.op == "call_function" else None
        if callee is not None and callee not in _NOT_STOOD_IN and _inputs_stand(n):
            args, kwargs = _node_values(n.args), _node_values(n.kwargs)
            found.extend(_stand_in_call(n.name, callee, args, kwargs, n.meta.get("val")))
    return found


# Ops a stand-in call would really run: the LM head's loss does its matmuls (seconds of GPU time at a 128K
# vocabulary) around the cross-entropy kernels, which compile at its first launch.
_NOT_STOOD_IN = frozenset({"linear_cross_entropy"})

# Backward op of a forward op: (its name, the names of the forward's outputs, {gradient argument: the
# output it is the gradient of}); every other argument of the backward is the forward's of that name.
_BACKWARDS = {
    "flash_attention": ("flash_attention_backward", ("out", "lse"), {"dout": "out"}),
    "cross_entropy": ("cross_entropy_backward", ("loss", "stats"), {"grad_loss": "loss"}),
}


def backward_compiles(gm: fx.GraphModule) -> list[tuple[object, str]]:
    """The compiles the backward graph's fxopt ops will ask for, predicted from a training step's forward
    graph: each own op whose statistics (output 1) the forward saves for the backward is followed there
    by its backward op on the same inputs and outputs, and a gradient laid out like the output (a guess:
    a gradient laid out otherwise asks for another kernel, which then compiles with the backward graph).
    Attention's are the longest compiles fxopt has: they start with the forward graph's, before the
    backward graph exists (compiled next, or at the first backward call)."""
    found = []
    for n in gm.graph.nodes:
        forward = own_op_callee(n) if n.op == "call_function" else None
        if forward not in _BACKWARDS or not _saves_statistics(n) or not _inputs_stand(n):
            continue
        if not isinstance(n.meta.get("val"), (tuple, list)):
            continue
        found.extend(_backward_stand_in_call(n.name, forward, _node_values(n.args), _node_values(n.kwargs),
                                             n.meta["val"]))
    return found


def _backward_stand_in_call(name: str, forward: str, args, kwargs, outputs) -> list[tuple[object, str]]:
    """The backward op's stand-in call for a forward op called with `args`/`kwargs` that gave `outputs`."""
    callee, out_names, grads = _BACKWARDS[forward]
    fwd = inspect.signature(getattr(direct_calls, forward)).bind(*args, **kwargs).arguments
    values = {**fwd, **dict(zip(out_names, outputs))}
    values.update({grad: values[of] for grad, of in grads.items()})
    params = inspect.signature(getattr(direct_calls, callee)).parameters
    call_kwargs = {p: values[p] for p in params if p in values}
    grads_out = [t for t in fwd.values() if isinstance(t, torch.Tensor)]  # at most one per input
    return _stand_in_call(f"{name} (backward, predicted)", callee, (), call_kwargs, grads_out)


def before_autograd_compiles(gm: fx.GraphModule, training: bool) -> list[tuple[object, str]]:
    """The compiles the fused ops of a torch-level graph (after the pre-autograd passes, before
    aot_autograd) will ask for: as own_op_compiles and backward_compiles on the ATen graphs, from the
    values dynamo recorded. aot_autograd and the post-grad passes take a GPT-2 block's first call
    about half a second; its attention kernel's compile can run meanwhile. `training`: the forward
    keeps its statistics and the backward follows (inference makes no statistics at all)."""
    found = []
    for n in gm.graph.nodes:
        name = own_op_callee(n) if n.op == "call_function" else None
        if name is None or not _inputs_stand(n, _example):
            continue
        forward = _FORWARD_OF.get(name, name) if training else name
        args, kwargs = fx.node.map_arg(n.args, _example), fx.node.map_arg(n.kwargs, _example)
        outputs = n.meta.get("example_value")
        found.extend(_stand_in_call(n.name, forward, args, kwargs, outputs))
        if training and forward in _BACKWARDS and isinstance(outputs, (tuple, list)):
            found.extend(_backward_stand_in_call(n.name, forward, args, kwargs, outputs))
    return found


_FORWARD_OF = {"flash_attention_out_only": "flash_attention"}  # training keeps the statistics


def _example(node: fx.Node):
    return node.meta.get("example_value")


def _saves_statistics(n: fx.Node) -> bool:
    return any(u.target is operator.getitem and u.args[1] == 1 and any(w.op == "output" for w in u.users)
               for u in n.users)


def _inputs_stand(n: fx.Node, value=None) -> bool:
    """Whether stand-ins can take the place of `n`'s inputs: CUDA tensors of static sizes, none a runtime
    scalar (scale_by: its value picks the path)."""
    tensors = [(value or _value)(a) for a in n.all_input_nodes]
    if not all(isinstance(t, torch.Tensor) and t.is_cuda and t.dim() > 0 for t in tensors):
        return False
    return not any(isinstance(s, torch.SymInt) for t in tensors for s in (*t.shape, *t.stride()))


def _node_values(arg):
    return fx.node.map_arg(arg, _value)


def _value(node: fx.Node):
    """A node's value: its meta's, or for a constant (attention's ALiBi slopes) the tensor itself."""
    if "val" not in node.meta and node.op == "get_attr":
        return getattr(node.graph.owning_module, node.target, None)
    return node.meta.get("val")


def _stand_in_call(name: str, callee: str, args, kwargs, out_val) -> list[tuple[object, str]]:
    """Call direct_calls.`callee` on stand-ins for the tensors of `args`/`kwargs` (node values),
    recording the compiles it asks for instead of doing them."""
    # The forward graph of a training step compiles inside aot_autograd's fake mode: real tensors
    # only with the dispatch modes set aside.
    with _disable_current_modes(), compile_pool.capturing() as captured:
        stand_ins = _stand_ins(name, (args, kwargs), out_val)
        if stand_ins is None:
            log.debug("fxopt: %s (%s) has no stand-ins: its kernels compile at its first launch", name, callee)
            return []
        try:
            getattr(direct_calls, callee)(*stand_ins[0], **stand_ins[1])
        except Exception as exc:  # what was captured before stays useful; the rest compiles at launch
            log.debug("fxopt: stand-in call of %s stopped: %s", name, exc)
    log.debug("fxopt: stand-in call of %s (%s) asked for %s", name, callee,
              [fn.fn.__name__ for fn, _ in captured] or "no compile")
    return captured


def _stand_ins(name: str, values, out_val):
    """`values` with every tensor a view of one shared buffer; None if that borrows too much."""
    tensors = [t for t in pytree.tree_leaves(values) if isinstance(t, torch.Tensor)]
    extent = max(_extent_bytes(t) for t in tensors)
    needed = extent + sum(t.numel() * t.element_size() for t in _tensors(out_val))
    if needed > min(STAND_IN_LIMIT, torch.cuda.mem_get_info(tensors[0].device)[0] // 4):
        log.debug("fxopt: %s: %d MiB of stand-ins is too much to borrow at compile time", name, needed >> 20)
        return None
    buffer = torch.empty(extent + 16, dtype=torch.uint8, device=tensors[0].device)
    return pytree.tree_map_only(torch.Tensor, lambda t: _view(buffer, t), values)


def _tensors(val) -> list[torch.Tensor]:
    """The tensors of a node's value (a tensor, or a tuple of them and other things)."""
    if isinstance(val, torch.Tensor):
        return [val]
    return [t for t in val if isinstance(t, torch.Tensor)] if isinstance(val, (tuple, list)) else []


def _extent_bytes(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))) * t.element_size()


def _view(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`like`'s sizes, strides and 16-byte misalignment (the TMA kernels need aligned pointers: a view
    starting mid-buffer must ask for the kernel the real call will) over `buffer` (16 bytes spare)."""
    size = like.element_size()
    n = len(buffer) // size
    offset = int(like.storage_offset()) % max(1, 16 // size)
    return buffer[:n * size].view(like.dtype).as_strided(like.shape, like.stride(), offset)
