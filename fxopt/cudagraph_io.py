"""The inputs and outputs of a captured CUDA graph: static input buffers, and outputs copied out
of graph memory after each replay (the next replay overwrites it), or lent.

The copy rule: every output whose memory the graph owns is copied once per replay, one copy per
storage (outputs that alias each other, a view and its base, keep aliasing, with the same strides
and storage offsets); an output that aliases an input is rebuilt as a view of the caller's tensor.
Cost: one device-to-device copy of the output bytes and one allocation per output storage per call.

The lending rule: a forward graph's tensors saved for the backward (no user sees them; autograd
holds them until the backward ran) are handed out in graph memory instead, over a storage of their
own that does not own the memory, so the graph can tell when the last of them died
(StorageWeakRef). While any is alive the graph is not replayed (the caller runs the graph uncaptured
instead), so a replay never overwrites what a pending backward will read. The backward graph reads
lent tensors where they are (Lending.pointers) instead of copying them into static buffers: saved
activations then exist once, in the forward graph's memory, instead of three times (graph memory,
the caller's copy, the backward's static input).

The same rule lends the outputs a caller sees (`lend_users`, cudagraphs.LEND_OUTPUTS) while the
caller lets them go before its next call (a training step's gradients, a benchmark loop): no copy, no
allocation, no memory beyond the graph's. kept_by_caller() says when one outlived that; the graph
then copies them instead (cudagraphs.GraphedCallable).
"""
from __future__ import annotations

import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .analysis.op_classes import is_cpu_scalar


class Outputs:
    """How each output leaves the graph: copied out of graph memory (one copy per storage, so
    outputs that alias each other still do), rebuilt over the caller's input, or a plain value."""

    def __init__(self, outs, inputs: list, lend: frozenset = frozenset(), lend_users: bool = False):
        owner = {}
        for i, t in enumerate(inputs):
            if isinstance(t, torch.Tensor) and t.numel() > 0:
                owner.setdefault(t.untyped_storage().data_ptr(), (i, t.data_ptr()))
        spans: dict[int, list] = {}
        for o in outs:
            if isinstance(o, torch.Tensor) and o.numel() > 0 and o.untyped_storage().data_ptr() not in owner:
                start, end = o.data_ptr(), o.data_ptr() + _extent(o) * o.element_size()
                span = spans.setdefault(o.untyped_storage().data_ptr(), [start, end, o])
                span[0], span[1] = min(span[0], start), max(span[1], end)
        group, self.srcs = {}, []
        for base, (start, end, o) in spans.items():
            start -= (start - base) % 16  # so every dtype's offset into the copy stays whole
            group[base] = (len(self.srcs), start)
            self.srcs.append(_view(o.untyped_storage(), start - base, torch.uint8, (end - start,), (1,)))
        # a storage the user sees is lent only with lend_users; the others (saved only) when in `lend`
        users = {o.untyped_storage().data_ptr() for i, o in enumerate(outs) if i not in lend
                 and isinstance(o, torch.Tensor) and o.numel() > 0}
        self.visible = [base in users for base in group]
        self.lendable = [lend_users or base not in users for base in group]
        saved_bases = {base for base in group if base not in users}
        self.pointers = {o.data_ptr() for o in outs if isinstance(o, torch.Tensor) and o.numel() > 0
                         and o.untyped_storage().data_ptr() in saved_bases}  # where a backward may read them
        self._lent: list[tuple[StorageWeakRef, bool]] = []  # (the lent storage, whether a user sees it)
        self.index = 0  # capture order among the graphs sharing a pool (Lending.next_index)
        self.owner = None  # a weak reference to the callable that replays the graph
        self.specs = []  # (kind, where, offset, dtype, shape, stride)
        for o in outs:
            if not isinstance(o, torch.Tensor):
                self.specs.append(("value", o, 0, None, None, None))
                continue
            meta = (o.dtype, tuple(o.shape), o.stride())
            base = o.untyped_storage().data_ptr()
            if o.numel() == 0:
                self.specs.append(("empty", o.device, 0, *meta))
            elif base in owner:
                i, ptr = owner[base]
                self.specs.append(("input", i, o.data_ptr() - ptr, *meta))
            else:
                g, start = group[base]
                self.specs.append(("copy", g, (o.data_ptr() - start) // o.element_size(), *meta))

    def lent_alive(self) -> bool:
        """Whether a tensor lent by the last replay is still alive (the next replay would overwrite it)."""
        if self._lent and all(ref.expired() for ref, _ in self._lent):
            self._lent = []
        return bool(self._lent)

    def kept_by_caller(self) -> bool:
        """Whether an output the caller sees, lent by the last replay, is still alive."""
        return any(visible and not ref.expired() for ref, visible in self._lent)

    def materialize(self, args) -> tuple:
        """Outputs for this replay: copies, or lent storages for the lendable ones, then views over
        them or over the caller's inputs. The views are built straight over each storage (no byte
        view in between): a training step materializes a few hundred outputs per replay, and 120 lent
        outputs took 1.45 ms of host with a byte view each, 0.76 ms without (development CPU)."""
        storages, todo, fresh, self._lent = [], [], [], []
        for src, lendable, visible in zip(self.srcs, self.lendable, self.visible):
            if lendable:
                storage = torch._C._construct_storage_from_data_pointer(src.data_ptr(), src.device, src.numel())
                self._lent.append((StorageWeakRef(storage), visible))
            else:
                buf = torch.empty(src.numel(), dtype=torch.uint8, device=src.device)
                todo.append(src)
                fresh.append(buf)
                storage = buf.untyped_storage()
            storages.append(storage)
        if todo:
            torch._foreach_copy_(fresh, todo)
        outs = []
        for kind, where, offset, dtype, shape, stride in self.specs:
            if kind == "copy":
                outs.append(_view(storages[where], offset, dtype, shape, stride))
            elif kind == "input":
                arg = args[where]
                storage = arg.untyped_storage()
                offset = (arg.data_ptr() + offset - storage.data_ptr()) // dtype.itemsize
                outs.append(_view(storage, offset, dtype, shape, stride))
            elif kind == "empty":
                outs.append(torch.empty_strided(shape, stride, dtype=dtype, device=where))
            else:
                outs.append(where)
        return tuple(outs)


def _extent(t: torch.Tensor) -> int:
    """Elements from the first to the last one the tensor reads (views may skip or repeat some)."""
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))


def _view(storage, offset: int, dtype, shape, stride) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, shape, stride)


def static_buffer(arg: torch.Tensor):
    """(buffer laid out like arg, flat span or None). Overlapping layouts (expanded inputs) cannot be
    copied element by element, so their whole span is copied as a flat range instead."""
    if torch._debug_has_internal_overlap(arg) == 0:
        return torch.empty_strided(arg.shape, arg.stride(), dtype=arg.dtype, device=arg.device), None
    flat = torch.empty(_extent(arg), dtype=arg.dtype, device=arg.device)
    return flat.as_strided(arg.shape, arg.stride()), flat


class Lending:
    """What the graphs of one compiled callable lent (see the module docstring): the forward graphs'
    lendable outputs, whose addresses a backward graph may read in place, and captured forward
    graphs dropped (re-captured, evicted, refused) while tensors they lent were alive, kept until
    those die so their memory is not handed to another graph."""

    def __init__(self):
        self.outputs: "weakref.WeakSet[Outputs]" = weakref.WeakSet()
        self.retired: list = []
        self.captured = 0
        _LENDINGS.add(self)

    def next_index(self) -> int:
        self.captured += 1
        return self.captured

    def alive_after(self, index: int) -> list["Outputs"]:
        """The outputs of graphs captured after graph `index` (in a shared pool) with a lent tensor
        alive. A later capture takes its memory from what the pool had free, which includes the
        scratch of every earlier graph: replaying the earlier graph may overwrite what it lent."""
        return [o for o in list(self.outputs) if o.index > index and o.lent_alive()]

    def pointers(self) -> set[int]:
        return {p for o in list(self.outputs) for p in o.pointers}

    def retire(self, captured) -> None:
        self.prune()
        if captured is not None and captured.outputs.lent_alive():
            self.retired.append(captured)

    def prune(self) -> None:
        """Let go of retired graphs whose lent tensors all died (their memory returns to the pool)."""
        self.retired = [c for c in self.retired if c.outputs.lent_alive()]


_LENDINGS: "weakref.WeakSet[Lending]" = weakref.WeakSet()


def lent_pointers() -> set[int]:
    """Where any compiled callable's forward graphs lent tensors saved for a backward. A backward is
    not always compiled with its forward: compiled autograd (DDP's python reducer) compiles it as a
    graph of its own, apart from the forward's Lending, and it reads those tensors all the same."""
    return {p for lending in list(_LENDINGS) for p in lending.pointers()}


class Captured:
    """A captured graph with how it reads its inputs (direct: in place; copies: into static buffers) and its outputs."""

    def __init__(self, graph, direct, copies, outputs: Outputs):
        self.graph, self.direct, self.copies, self.outputs = graph, direct, copies, outputs


class Entry:
    """One input signature: warm-up calls seen, inputs seen at more than one address, its graph."""

    def __init__(self, cpu_ok: bool = False):
        self.calls, self.ptrs, self.moved, self.captured = 0, None, set(), None
        self.cpu_ok = cpu_ok  # a backend that runs on CPU tensors (tests): CPU tensors are graph inputs

    def graph_inputs(self, args) -> list[int]:
        """Positions of the tensors the graph reads from memory: not the 0-d CPU tensors, which the
        signature keys by value (read on the host, at capture)."""
        return [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and (self.cpu_ok or not is_cpu_scalar(a))]

    def observe(self, args) -> None:
        read = set(self.graph_inputs(args))
        ptrs = [a.data_ptr() if i in read else None for i, a in enumerate(args)]
        self.calls += 1
        if self.ptrs is not None:
            self.moved.update(i for i, (p, q) in enumerate(zip(ptrs, self.ptrs)) if p != q)
        self.ptrs = ptrs
