"""The whole graph as a readable Python module: allocate outputs, launch kernels, call ATen for the rest.

The module defines `call(args)` (boxed: it clears `args` so inputs can be freed early) and frees every
intermediate after its last use. With a memory plan to apply (Options(memory_plan="apply")), the fused
kernels' intermediate outputs are views of one uint8 arena allocated per call, at the plan's byte
offsets; with poison on (FXOPT_POISON_FREED=1) each such region is filled with 0xFF bytes (NaN in every
float dtype) right after its last use, so a read after that shows up as NaN. It runs on its own:
`python wrapper.py` calls it on random inputs of the compiled shapes. Values keep their fx node names,
so a wrapper line can be found in the graph dumps.

With symbolic sizes (dynamic shapes) the first lines bind each size symbol from the inputs
(`s0 = primals_1.shape[0]`); shapes, strides, numels and grids are expressions over them, so one
wrapper serves every size. An applied memory plan is then looked up per call (`PLANS.offsets(s0, s1)`:
one concrete plan per distinct size, memory/size_plans.py).
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from ..analysis.liveness import buffer_intervals, inplace_pairs, tensor_bytes
from ..analysis.op_classes import is_view, out_variant, tensor_devices
from ..analysis.symbolic import expr, hint, pexpr, ptuple, shape_env_of, sizes, strides, symbol_bindings
from ..report import BufferRecord, MemoryPlan
from .kernel import Kernel, kernel_definitions
from .wrapper_layouts import (FRESH_CONTIGUOUS, VIEW_METHODS, allocation, elided_splits, known_layouts,
                              scratch_allocation)
from .wrapper_layouts import device_source as _dev
from .wrapper_text import HEADER, KERNELS_END, KERNELS_HEADER, MAIN, PROFILE_HEADER


def format_value(a, names) -> str:
    """Python source for an argument of an ATen call."""
    if isinstance(a, fx.Node):
        return names[a]
    if isinstance(a, torch.SymInt):
        return pexpr(expr(a))
    if isinstance(a, (list, tuple)):
        inner = ", ".join(format_value(x, names) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, torch.device):
        return f"torch.device({_dev(a)})"
    if isinstance(a, (torch.dtype, torch.layout, torch.memory_format)):
        return str(a)
    if isinstance(a, float) and (math.isinf(a) or math.isnan(a)):
        return f'float("{a}")'
    if a is None or isinstance(a, (bool, int, float, str)):
        return repr(a)
    if isinstance(a, complex):  # a complex op's scalar (polar's backward multiplies by 1j)
        return f"complex({format_value(a.real, names)}, {format_value(a.imag, names)})"
    raise NotImplementedError(f"cannot print argument {a!r} of type {type(a).__name__}")


_ATEN = torch.ops.aten
# ATen calls the wrapper writes as their torch functions, for the same reason (~1-1.6 us less each)
TORCH_FUNCTIONS = {_ATEN.mm.default: "torch.mm", _ATEN.addmm.default: "torch.addmm", _ATEN.bmm.default: "torch.bmm",
                   _ATEN.cat.default: "torch.cat", _ATEN._local_scalar_dense.default: "torch.Tensor.item",
                   _ATEN.scalar_tensor.default: "torch.scalar_tensor"}
_SAME_KWARGS = {_ATEN.scalar_tensor.default}  # whose torch function takes the ATen op's keyword arguments


def _callee(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        ns = target.namespace
        prefix = ns if ns in ("aten", "prims") else f"torch.ops.{ns}"
        return f"{prefix}.{target._schema.name.split('::')[-1]}.{target._overloadname}"
    if getattr(target, "__module__", None) == "_operator":  # SymInt arithmetic (operator.mul, ...)
        return f"operator.{target.__name__}"
    if getattr(target, "__module__", "").startswith("torch") and target.__name__.startswith("sym_"):
        return f"torch.{target.__name__}"
    raise NotImplementedError(f"cannot call {target!r} from the wrapper")


def own_op_callee(n: fx.Node) -> str | None:
    """The codegen/direct_calls.py function a wrapper calls for a node of fxopt's own ops (None for
    others): the op's name, `flash_attention_out_only` where nothing reads the log-sum-exp (inference:
    the statistics are not made at all), a pass's variant's own name (passes/grad_over_logits.py)."""
    if hasattr(n.target, "writes_over"):
        return n.target.__name__
    if not (isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "fxopt"):
        return None
    name = n.target._schema.name.split("::")[-1]
    if name == "flash_attention" and all(u.target is operator.getitem and u.args[1] == 0 for u in n.users):
        return "flash_attention_out_only"
    return name


def _last_uses(gm: fx.GraphModule) -> dict[fx.Node, list[fx.Node]]:
    """For each node, the values whose last use it is (never graph outputs)."""
    nodes = list(gm.graph.nodes)
    outputs = set(nodes[-1].all_input_nodes)
    last: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            last[a] = n
    frees: dict[fx.Node, list[fx.Node]] = {}
    for value, user in last.items():
        if value not in outputs and value.op != "get_attr":
            frees.setdefault(user, []).append(value)
    return frees


_ABSOLUTE_OFFSET_VIEWS = (torch.ops.aten.as_strided.default, torch.ops.aten.as_strided_.default,
                          torch.ops.aten.as_strided_scatter.default)


def _storage_offset_bases(gm: fx.GraphModule) -> set[str]:
    """Values an ATen as_strided (or as_strided_scatter, and its out= result) indexes: its storage_offset
    counts from the start of the storage, for an arena view the arena's, so such a value keeps its own
    allocation (a sweep found as_strided_scatter's window clamped 64 floats early, memory_plan="apply")."""
    bases = set()
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in _ABSOLUTE_OFFSET_VIEWS:
            bases.add(n.name)
            base = n.args[0]
            while isinstance(base, fx.Node):
                bases.add(base.name)
                base = base.args[0] if is_view(base) and base.args else None
    return bases


def _arena_slots(gm: fx.GraphModule, kernels: dict[str, Kernel], plan: MemoryPlan | None,
                 mode: str) -> tuple[dict[str, tuple[BufferRecord, object]], torch.device | None]:
    """The planned buffers the wrapper places in the arena: kernel outputs and out=-capable ATen results
    named in the plan whose compiled layout spans exactly the planned bytes, on one device (the kernels'
    if any: an ATen result on the CPU, a scalar in a CUDA graph, does not pick it)."""
    if plan is None or mode != "triton" or not plan.buffers:
        return {}, None
    records = {b.name: b for b in plan.buffers}
    absolute = _storage_offset_bases(gm)
    device = next((kernels[n.target].outputs[0].device for n in gm.graph.nodes
                   if n.op == "call_module" and kernels[n.target].outputs), None)
    slots = {}
    for n in gm.graph.nodes:
        if out_variant(n) is not None and isinstance(n.meta.get("val"), torch.Tensor):
            named = [(n.name, n.meta["val"])]  # an ATen call the wrapper makes through its out= overload
        elif n.op != "call_module":
            continue
        elif isinstance(n.meta["val"], tuple) and len(n.meta["val"]) > 1:
            k = kernels[n.target]
            outs = {u.args[1]: u.name for u in n.users}
            named = [(outs[i], o) for i, o in enumerate(k.outputs) if i in outs]
        else:
            named = [(n.name, kernels[n.target].outputs[0])]
        for name, o in named:
            rec = records.get(name)
            if rec is None or rec.nbytes != tensor_bytes(o) or rec.nbytes == 0 or name in absolute:
                continue
            device = device or o.device
            if o.device == device:
                slots[name] = (rec, o)
    for dying, born in getattr(plan, "inplace", ()):  # in place only where the compiled layouts agree
        if dying in slots and born in slots:
            a, b = slots[dying][1], slots[born][1]
            if (sizes(a), strides(a), a.element_size()) != (sizes(b), strides(b), b.element_size()):
                del slots[born]
    return slots, device


def generate_wrapper(gm: fx.GraphModule, kernels: dict[str, Kernel], graph: str,
                     mode: str, filename: str = "wrapper.py", profile: bool = False,
                     plan: MemoryPlan | None = None, poison: bool = False, reuse: bool = True) -> str:
    """Python source of the wrapper module. mode: "triton" launches kernels, "eager" runs subgraphs.
    profile: bracket every launch and ATen call with a named timing region (for fxopt.profile).
    plan: a memory plan to apply (kernel outputs become arena views); poison: fill each arena region
    with 0xFF bytes after its last use (debugging: a later read sees NaN); reuse: False (memory_plan=False)
    keeps a kernel from writing in place of a dying input where no plan is applied."""
    names: dict[fx.Node, str] = {n: n.name for n in gm.graph.nodes}
    guarded = cuda_device_index(gm) if mode == "triton" else None
    slots, arena_device = _arena_slots(gm, kernels, plan, mode)
    arena = "arena" if "arena" not in names.values() else "arena_"
    replaced = {dying: born for dying, born in getattr(plan, "inplace", ()) if born in slots}
    # without an applied plan the same pairs hold: the kernel writes into the dying buffer itself
    reused = {} if plan is not None or mode != "triton" or not reuse else _reused_buffers(gm)
    dies: dict[int, list[BufferRecord]] = {}
    for rec, _ in slots.values():
        if rec.name not in replaced:  # a region written in place lives on in its successor: no poison
            dies.setdefault(rec.last_use, []).append(rec)
    # the arena's name is needed until the last view is made (and, with poison, the last region filled)
    arena_end = max((max(rec.first_use, rec.last_use if poison else 0) for rec, _ in slots.values()),
                    default=-1)
    body, specs = [], []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    unpack = ", ".join(n.name for n in placeholders)
    body.append(f"{unpack}{',' if len(placeholders) == 1 else ''} = args" if placeholders else "pass")
    body.append("args.clear()")
    bindings = symbol_bindings(gm)
    clash = {s.name for s in bindings} & set(names.values())
    if clash:
        raise NotImplementedError(f"size symbols {sorted(clash)} share a name with graph values")
    body += [f"{sym.name} = {src}  # size symbol" for sym, src in bindings.items()]
    frees = _last_uses(gm)
    known = known_layouts(gm, kernels) if mode == "triton" else {}
    elided = elided_splits(gm, known)  # made as reinterpret_tensor pieces where the split stands
    shape_env = shape_env_of(gm)
    for n in placeholders:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            example = tuple(hint(s, shape_env) for s in val.shape), tuple(hint(s, shape_env) for s in val.stride())
            specs.append(f"({example[0]}, {example[1]}, {val.dtype}, {_dev(val.device)})")
            if any(u.op == "call_module" for u in n.users):
                body.append(f"check_layout({n.name}, {ptuple(sizes(val))}, {ptuple(strides(val))}, {n.name!r})")
        elif isinstance(val, (torch.SymInt, int)):  # a size passed as a number (dynamic shapes): its example
            specs.append(str(hint(val, shape_env)))
        else:
            specs.append("None")
    per_size = slots and plan.buffers[0].offset is None  # symbolic sizes: offsets looked up per call
    if slots:
        nbytes = f"{arena}_bytes" if per_size else plan.planned_bytes
        if per_size:
            body.append(f"{arena}_bytes, {arena}_at = PLANS.offsets({', '.join(f'{s.name}={s.name}' for s in bindings)})"
                        f"  # the plan for these sizes (made at their first call)")
        body.append(f"{arena} = torch.empty({nbytes}, dtype=torch.uint8, device={_dev(arena_device)})"
                    f"  # the memory plan's arena ({plan.strategy}): {len(slots)} intermediates are views of it")
    for position, n in enumerate(gm.graph.nodes):
        if n.op == "call_module":
            launch = _launch(n, kernels[n.target], names, mode, slots, arena, replaced, guarded, reused)
            body += _timed(launch, kernels[n.target].name, profile)
        elif n in elided:
            for piece in n.users:
                base, offset = known[piece]
                body.append(_reinterpret(piece, names[base], offset))
        elif n.op == "call_function" and n.target is operator.getitem:
            if n.args[0].op != "call_module" and n.args[0] not in elided:
                body.append(f"{n.name} = {names[n.args[0]]}[{n.args[1]}]")
                body += _conformed(n, n.args[0])
        elif n.op == "call_function":
            args = [format_value(a, names) for a in n.args]
            args += [f"{k}={format_value(v, names)}" for k, v in n.kwargs.items()]
            if n.name in slots:  # the plan places this ATen result: its out= overload writes the arena view
                body.append(_arena_view(n.name, slots[n.name], arena, replaced))
                body += _timed([f"{_callee(out_variant(n))}({', '.join(args + [f'out={n.name}'])})"], n.name, profile)
            elif n in known:  # a view of a value whose layout is proven: made in C from its meta value
                body += _timed([_reinterpret(n, args[0], 0)], n.name, profile)
            elif n.target in VIEW_METHODS and not n.kwargs:
                rest = ", ".join(args[1:])
                body += _timed([f"{n.name} = {args[0]}.{VIEW_METHODS[n.target]}({rest})"], n.name, profile)
            elif n.target in TORCH_FUNCTIONS and (not n.kwargs or n.target in _SAME_KWARGS):
                body += _timed([f"{n.name} = {TORCH_FUNCTIONS[n.target]}({', '.join(args)})"], n.name, profile)
            else:
                own = own_op_callee(n)
                callee = f"fxopt_ops.{own}" if own else _callee(n.target)
                body += _timed([f"{n.name} = {callee}({', '.join(args)})"], n.name, profile)
                body += _conformed(n, n)
        elif n.op == "get_attr":
            continue  # constants are module globals, set when the wrapper is loaded
        elif n.op == "output":
            outs = n.args[0] if isinstance(n.args[0], (tuple, list)) else [n.args[0]]
            body.append(f"return ({''.join(format_value(o, names) + ', ' for o in outs)})")
            continue
        dead = [names[v] for v in frees.get(n, []) if _holds_value(v) and v not in elided]
        if dead:
            body.append(f"del {', '.join(dead)}")
        if poison:
            for rec in dies.get(position, []):
                body.append(f"{arena}[{_span(rec, arena)}].fill_(0xFF)  # poison {rec.name}: "
                            f"dead after node {position}, a later read sees NaN")
        if position == arena_end:
            body.append(f"del {arena}  # every planned buffer is placed; its memory goes when the last view dies")
    uses_libdevice = any("libdevice." in k.full_source() for k in kernels.values())
    libdevice = "from triton.language.extra import libdevice" if uses_libdevice else ""
    extra = "\nimport operator" if bindings or "operator." in "".join(body) else ""  # (operator.sub(20, s0))
    if any(own_op_callee(n) for n in gm.graph.nodes if n.op == "call_function"):
        extra += "\nfrom fxopt.codegen import direct_calls as fxopt_ops"
    src = KERNELS_HEADER.format(graph=graph, filename=filename, libdevice=libdevice)
    if mode == "triton":
        src += kernel_definitions(kernels.values())
    src += "\n" + KERNELS_END + HEADER.format(extra=extra)
    if profile:
        src += PROFILE_HEADER
    if guarded is not None:  # the whole call on the graph's device (wrapper_runtime.py says why)
        body = body[:2] + [f"with device_guard({guarded}):"] + [f"    {line}" for line in body[2:]]
    src += "\n\ndef call(args):\n" + "".join(f"    {line}\n" for line in body)
    src += f"\n\nINPUT_SPECS = [{', '.join(specs)}]\n" + MAIN
    return src


def cuda_device_index(gm: fx.GraphModule) -> int | None:
    """The index of the one CUDA device a graph's tensors live on (its wrapper runs under a device guard
    and allocates through the current device); None for CPU graphs, and for graphs with no CUDA index
    or more than one device (those allocate with an explicit device). Kernel outputs are the values of
    the graph's call_module nodes, so the nodes' values cover them. 0-d CPU tensors (scalars dynamo
    passes for float attributes, passes/cpu_scalars.py) do not count: no kernel reads them."""
    devices = tensor_devices(gm)
    if len(devices) != 1:
        return None
    (device,) = devices
    return device.index if device.type == "cuda" else None


def _timed(lines: list[str], name: str, profile: bool) -> list[str]:
    """The lines as they are, or (profiling wrappers) inside a region named like its roofline row."""
    if not profile:
        return lines
    return [f"with region({name!r}):"] + [f"    {line}" for line in lines]


def _reinterpret(n: fx.Node, base: str, offset) -> str:
    """`n = reinterpret_tensor(base, ...)`: n's meta sizes and strides, `offset` elements past base's."""
    val = n.meta["val"]
    return f"{n.name} = reinterpret_tensor({base}, {ptuple(sizes(val))}, {ptuple(strides(val))}, {pexpr(offset)})"


def _conformed(n: fx.Node, call: fx.Node) -> list[str]:
    """`n = conform_layout(n, size, stride)` (wrapper_runtime.py) for an ATen result that kernels or views
    index with its meta strides, unless the op's layout is sure (matmuls, fxopt's own ops, views); `call`
    is the node that ran (n's source for a getitem)."""
    val = n.meta.get("val")
    if (not isinstance(val, torch.Tensor) or call.target in FRESH_CONTIGUOUS or is_view(call)
            or own_op_callee(call) is not None
            or not any(u.op == "call_module" or (u.op == "call_function" and is_view(u)) for u in n.users)):
        return []
    return [f"{n.name} = conform_layout({n.name}, {ptuple(sizes(val))}, {ptuple(strides(val))})"]


def _holds_value(node: fx.Node) -> bool:
    """Multi-output kernel calls are unpacked straight into their getitem names: nothing to free."""
    return not (node.op == "call_module" and isinstance(node.meta.get("val"), tuple))


def _span(rec: BufferRecord, arena: str) -> str:
    """The arena slice of a planned buffer: fixed offsets, or per-call ones (symbolic sizes)."""
    if rec.offset is None:
        at = f"{arena}_at[{rec.name!r}]"
        return f"{at}:{at} + {pexpr(rec.nbytes)}"
    return f"{rec.offset}:{rec.offset + rec.nbytes}"


def _in_place_of(name: str, replaced) -> str:
    dying = [d for d, b in (replaced or {}).items() if b == name]
    return f", in place of {dying[0]}" if dying else ""


def _arena_view(name: str, slot, arena: str, replaced) -> str:
    """`name = arena[a:b].view(dtype).as_strided(size, stride)`: a planned buffer's place in the arena."""
    rec, o = slot
    return (f"{name} = {arena}[{_span(rec, arena)}].view({o.dtype}).as_strided({ptuple(sizes(o))}, "
            f"{ptuple(strides(o))})  # planned: {rec.nbytes} bytes, alive nodes {rec.first_use}-{rec.last_use}"
            f"{_in_place_of(name, replaced)}")


def _reused_buffers(gm: fx.GraphModule) -> dict[str, tuple[str, bool]]:
    """{born: (dying, same dtype)}: kernels writing into a dying input without an applied plan (inplace_pairs);
    one of another dtype is viewed as the output's (else an int64 argmax reused for float64 stayed int64)."""
    dtype = {n.name: getattr(n.meta.get("val"), "dtype", None) for n in gm.graph.nodes}
    return {born: (dying, dtype[dying] == dtype[born]) for dying, born in inplace_pairs(gm, buffer_intervals(gm))}


def _launch(n: fx.Node, k: Kernel, names, mode: str, slots=None, arena: str = "arena",
            replaced=None, guarded: int | None = None, reused=None) -> list[str]:
    """Allocate the group's outputs (planned ones as arena views) and launch its kernel (or call its
    subgraph in eager mode)."""
    val = n.meta["val"]
    multi = isinstance(val, tuple) and len(val) > 1
    if multi:
        getitems = {u.args[1]: u for u in n.users}
        outs = [names[getitems[i]] if i in getitems else f"_{n.name}_unused{i}" for i in range(len(val))]
    else:
        outs = [names[n]]
    args = ", ".join(names[a] for a in n.args)
    if mode == "eager":
        lhs = ", ".join(outs) + ("," if len(outs) == 1 and multi else "")
        call = f"subgraph_{n.target}({args})"
        return [f"{lhs} = {call}" if multi else f"{outs[0]} = {call}"]
    lines = []
    for name, o in zip(outs, k.outputs):
        if slots and name in slots:
            lines.append(_arena_view(name, slots[name], arena, replaced))
            continue
        if reused and name in reused:  # (a reshaped matmul result: the same bytes under the output's shape)
            dying, same_dtype = reused[name]
            source = dying if same_dtype else f"{dying}.view({o.dtype})"  # (equal element sizes)
            lines.append(f"{name} = reinterpret_tensor({source}, {ptuple(sizes(o))}, {ptuple(strides(o))}, 0)"
                         f"  # in place: {dying} dies at this kernel")
            continue
        lines.append(f"{name} = {allocation(o, guarded)}")
    scratch = [f"ws_{n.name}_{i}" for i in range(len(k.workspaces))]
    for name, (shape, dtype) in zip(scratch, k.workspaces):
        lines.append(f"{name} = {scratch_allocation(shape, dtype, k.outputs[0].device, guarded)}  # per-chunk partials")
    if k.alternative is not None:  # a symbolic row: persistent when this call's row fits in registers
        a = k.alternative
        launch = lambda kk: f"{kk.name}[{kk.grid_source()}]({args}, {', '.join(outs)}{kk.launch_suffix()})"  # noqa: E731
        lines.append(f"if {k.alternative_when}:")
        lines += ["    " + line for line in a.setup] + ["    " + launch(a), "else:"]
        lines += ["    " + line for line in k.setup] + ["    " + launch(k)]
        return lines
    lines += k.setup  # per-call block sizes (symbolic row lengths)
    if k.prologue is not None:
        p = k.prologue
        lines.append(f"{p.name}[{p.grid_source()}]({args}, {''.join(w + ', ' for w in scratch)}{', '.join(outs)}"
                     f"{p.launch_suffix()})")
    for kk in [kk for kk in (k, k.epilogue) if kk is not None]:
        lines.append(f"{kk.name}[{kk.grid_source()}]({args}, {''.join(w + ', ' for w in scratch)}{', '.join(outs)}"
                     f"{kk.launch_suffix()})")
    if scratch:
        lines.append(f"del {', '.join(scratch)}")
    return lines
