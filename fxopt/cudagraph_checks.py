"""What a CUDA graph may be captured with, read before any call, and what a captured graph is keyed by:
the refusal rules (random ops, collectives other than NCCL's functional ones, CPU syncs, CPU inputs
other than scalars), the inputs a graph writes in place, the input signature, and the bounded LRU
cache of captured signatures (fxopt/cudagraphs.py)."""
from __future__ import annotations

import operator
from collections import OrderedDict

import torch
import torch.fx as fx

from .analysis.aliasing import written_roots
from .analysis.op_classes import is_collective, is_cpu_scalar, is_wait

MAX_GRAPHS = 8  # captured signatures kept per compiled graph (least recently used evicted)
aten = torch.ops.aten
SYNC_OPS = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.equal.default}


class Refused(Exception):
    """Why a graph cannot be captured; it then runs without CUDA graphs."""


def refusal_reason(gm: fx.GraphModule, target: str, profile: bool = False) -> str | None:
    """Why this ATen graph cannot be captured, read from the graph before any call (None: it can)."""
    if target != "cuda":
        return f"the graph runs on the CPU ({target}); CUDA graphs need CUDA tensors"
    if profile:
        return "profile=True times every launch on its own; a replayed graph has no launches to time"
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        tags = getattr(n.target, "tags", ())
        if torch.Tag.nondeterministic_seeded in tags or "rngprims" in str(n.target):
            return (f"random op {n.target} ({n.name}): fxopt does not capture random ops yet (a seeded run "
                    f"would not repeat eager's numbers); dropout in training: model.eval() or p=0 avoids it")
        if is_collective(n):
            why = collective_refusal(n)
            if why is not None:
                return f"collective {n.target} ({n.name}): {why}"
        if (n.target in SYNC_OPS or torch.Tag.data_dependent_output in tags) and not _reads_cpu_scalar(n):
            return f"{n.target} ({n.name}) reads a GPU value on the CPU (a sync), which capture cannot record"
        if torch.Tag.dynamic_output_shape in tags:
            return f"{n.target} ({n.name}) has a data-dependent output shape (the CPU waits for the GPU)"
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.op == "placeholder" and isinstance(val, torch.Tensor) and val.device.type != "cuda" \
                and not is_cpu_scalar(val):  # a CPU scalar is keyed by value (`signature`)
            return (f"input {n.name} is a {val.device.type.upper()} tensor: its value would be frozen into "
                    f"the graph at capture")
    return None


def collective_refusal(n: fx.Node) -> str | None:
    """Why this collective cannot be captured (None: it can). A functional collective on a process group
    whose CUDA backend is NCCL records its kernels into the graph being captured (NCCL's stream joins
    the capture through the event it waits on; the warm-up calls set up the communicator first), and
    a replay launches them in the graph's order, which is the program's order on every rank. Its wait
    joins the capturing stream back, so it is captured only where the collective it waits for is in
    the same graph. Gloo and other backends copy through the host, which a capture cannot record."""
    if n.target.namespace != "_c10d_functional":
        return ("fxopt captures torch.distributed._functional_collectives ops only (this one hands out a "
                "work object the graph cannot hold)")
    if is_wait(n):
        src = n.args[0]
        while isinstance(src, fx.Node) and src.target is operator.getitem:
            src = src.args[0]
        if isinstance(src, fx.Node) and is_collective(src) and not is_wait(src):
            return None  # the collective itself is checked where it is issued
        return "it waits on communication issued outside this graph, which a capture cannot wait for"
    backend = process_group_backend(_group_name(n))
    if backend != "ProcessGroupNCCL":
        return (f"its process group runs {backend or 'a backend fxopt cannot find in this process'} for CUDA "
                f"tensors; fxopt captures communication on NCCL only")
    return None


def _group_name(n: fx.Node):
    names = [a.name for a in n.target._schema.arguments]
    if "group_name" not in names:
        return None
    i = names.index("group_name")
    return n.args[i] if i < len(n.args) else n.kwargs.get("group_name")


def process_group_backend(group) -> str | None:
    """The class name of the group's backend for CUDA tensors (ProcessGroupNCCL, ProcessGroupGloo, ...),
    None where the group is not known in this process."""
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group
        return type(_resolve_process_group(group)._get_backend(torch.device("cuda"))).__name__
    except Exception:  # noqa: BLE001 (no such group here, no CUDA backend, or a torch without these)
        return None


def _reads_cpu_scalar(n: fx.Node) -> bool:
    """`.item()` of a 0-d CPU input (passes/cpu_scalars.py): a host read, not a GPU sync."""
    ins = n.all_input_nodes
    return len(ins) == 1 and ins[0].op == "placeholder" and is_cpu_scalar(ins[0].meta.get("val"))


def mutated_inputs(gm: fx.GraphModule) -> set[int]:
    """Positions of the inputs the graph writes in place (through views too): they must be read in
    place, since a write to a static copy would never reach the caller's tensor."""
    index = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    return {index[root] for root in written_roots(gm.graph) if root in index}


def signature(args, cpu_ok: bool = False) -> tuple[tuple, int]:
    """(key, device): what a captured graph is specific to. A 0-d CPU tensor is keyed by its value (the
    graph freezes it: a new value, a new graph). Refused for other CPU tensors (their values would be
    baked in), several devices, or inputs that cannot be keyed."""
    key, devices = [], set()
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            dev = a.get_device()
            if dev < 0 and not cpu_ok:
                if is_cpu_scalar(a):
                    key.append((a.dtype, repr(a.item())))  # repr: NaN keys equal, -0.0 and 0.0 do not
                    continue
                raise Refused(f"input {i} is a CPU tensor at run time: its value would be frozen into the graph")
            devices.add(dev)
            key.append((a.shape, a.stride(), a.dtype, dev))
        else:
            try:
                hash(a)
            except TypeError:
                raise Refused(f"input {i} is a {type(a).__name__}, which cannot key a captured graph") from None
            key.append((type(a), a))
    if len(devices) > 1:
        raise Refused(f"inputs on several devices {sorted(devices)}: one graph runs on one GPU")
    return tuple(key), (devices.pop() if devices else -1)


class SignatureCache:
    """A bounded LRU map from input signature to its state; evicting drops the captured graph."""

    def __init__(self, maxsize: int = MAX_GRAPHS, on_evict=None):
        if maxsize < 1:
            raise ValueError(f"fxopt: the CUDA graph cache needs room for at least one graph, got {maxsize}")
        self.maxsize, self.evicted, self.on_evict = maxsize, 0, on_evict
        self._items: OrderedDict = OrderedDict()

    def get(self, key):
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key, value):
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.maxsize:
            _, old = self._items.popitem(last=False)
            self.evicted += 1
            if self.on_evict is not None:
                self.on_evict(old)
        return value

    def entries(self) -> list:
        return list(self._items.values())

    def __len__(self):
        return len(self._items)

    def __contains__(self, key):
        return key in self._items


def saved_for_backward(gm: fx.GraphModule) -> frozenset:
    """Positions of a forward graph's outputs that aot_autograd saves for the backward (after the
    user's outputs, mutated inputs and intermediate bases: fw_metadata.num_forward); none if this
    torch does not say."""
    ctx = torch._guards.TracingContext.try_get()
    first = getattr(getattr(ctx, "fw_metadata", None), "num_forward", None)
    if not isinstance(first, int):
        return frozenset()
    outputs = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    return frozenset(range(first, len(outputs)))
