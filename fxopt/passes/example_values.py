"""Example values (dynamo's fake tensors, `node.meta["example_value"]`) for nodes the pre-autograd passes
insert: later passes read them (precision's dtype decisions), and so do the early compiles of the fused
ops' kernels (codegen/own_op_compiles.before_autograd_compiles)."""
from __future__ import annotations

import contextlib

import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensor

from ..analysis.torch_ops import state_switch


def fake_mode(gm: fx.GraphModule):
    """The fake mode dynamo traced in: new values are computed in it, never on real data."""
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        if isinstance(value, FakeTensor):
            return value.fake_mode
    return None


def run_on_fakes(node: fx.Node, mode):
    """The node's value computed from its inputs' example values (what dynamo recorded, re-done), the
    way dynamo computes them: under the Python dispatcher, so composite ops (F.linear) decompose with
    symbolic sizes instead of asking C++ for a concrete numel(). Size symbols it makes (a slice at a
    symbolic offset under `backed_size_oblivious` makes unbacked ones) belong to no trace: the shape
    environment is told to forget them, or aot_autograd's trace refused them as pending."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["example_value"])
    shape_env = getattr(mode, "shape_env", None)
    forget = getattr(shape_env, "ignore_fresh_unbacked_symbols", contextlib.nullcontext)
    with mode, enable_python_dispatcher(), forget():
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        return node.target(*args, **kwargs)


def fill_missing_values(graph: fx.Graph, mode) -> None:
    """Nodes an earlier pass inserted (the fused attention op) get their example values. Calls that change
    the process's state (grad mode, inference mode, autocast, functorch levels: dynamo records no value for
    them) are not run: run here they switched the compiling thread's grad mode, so a graph ending in
    `torch.set_grad_enabled(False)` was compiled for inference. Grad mode is restored whatever runs."""
    with torch.set_grad_enabled(torch.is_grad_enabled()):
        for node in graph.nodes:
            if (node.op in ("call_function", "call_method") and "example_value" not in node.meta
                    and state_switch(node) is None):
                node.meta["example_value"] = run_on_fakes(node, mode)
