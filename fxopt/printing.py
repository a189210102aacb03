"""Graphs printed as Python with a `# bf16[8, 1024] cuda` comment per value, for dumps and reports."""
from __future__ import annotations

import torch
import torch.fx as fx

from .analysis.symbolic import is_row_major

_SHORT_DTYPE = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "b8", torch.complex64: "c64", torch.complex128: "c128",
}


def describe_value(val) -> str:
    """'bf16[8, 1024] cuda' for a tensor, a tuple of those for tuples, the type name otherwise."""
    if isinstance(val, torch.Tensor):
        dtype = _SHORT_DTYPE.get(val.dtype, str(val.dtype).replace("torch.", ""))
        shape = ", ".join(str(s) for s in val.shape)
        layout = "" if val.dim() < 2 or is_row_major(val) else f" stride={tuple(val.stride())}"  # (no guard)
        return f"{dtype}[{shape}]{layout} {val.device.type}"
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(describe_value(v) for v in val) + ")"
    if val is None:
        return "None"
    return type(val).__name__


def target_name(target) -> str:
    """aten.add.Tensor for ATen overloads, the qualified name for Python callables."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::')[-1]}.{target._overloadname}"
    if isinstance(target, str):
        return target
    mod = getattr(target, "__module__", "") or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", repr(target))
    return f"{mod}.{name}" if mod and mod not in ("builtins", "_operator") else name


def format_arg(arg) -> str:
    if isinstance(arg, fx.Node):
        return arg.name
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(format_arg(a) for a in arg)
        return f"[{inner}]" if isinstance(arg, list) else f"({inner}{',' if len(arg) == 1 else ''})"
    if isinstance(arg, dict):
        return "{" + ", ".join(f"{k!r}: {format_arg(v)}" for k, v in arg.items()) + "}"
    return repr(arg)


def graph_to_text(gm: fx.GraphModule, title: str = "") -> str:
    """The graph as Python, one line per node, each value commented with dtype, shape and device."""
    lines = [f"# {title}"] if title else []
    params = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    lines.append(f"def forward({', '.join(params)}):")
    for n in gm.graph.nodes:
        key = "val" if "val" in n.meta else "example_value"  # (dynamo's torch-level graphs: example_value)
        comment = f"  # {describe_value(n.meta[key])}" if key in n.meta else ""
        if n.op == "placeholder":
            lines.append(f"    # {n.name}: {describe_value(n.meta.get(key))}")
        elif n.op == "output":
            lines.append(f"    return {format_arg(n.args[0])}")
        elif n.op == "get_attr":
            lines.append(f"    {n.name} = self.{n.target}{comment}")
        else:
            args = [format_arg(a) for a in n.args] + [f"{k}={format_arg(v)}" for k, v in n.kwargs.items()]
            callee = f"self.{n.target}" if n.op == "call_module" else target_name(n.target)
            lines.append(f"    {n.name} = {callee}({', '.join(args)}){comment}")
    for name, sub in gm.named_children():
        if isinstance(sub, fx.GraphModule):
            lines.append("")
            lines.append(graph_to_text(sub, title=f"submodule {name}").replace("def forward", f"def {name}"))
    return "\n".join(lines) + "\n"
