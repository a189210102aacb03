"""CUDA graphs (Options.cudagraphs): replay each compiled graph as one graph launch, so a small batch
stops paying one CPU launch per kernel.

Per compiled graph (forward, backward or inference) and per input signature (shapes, strides, dtypes):
  calls 1..WARMUP_CALLS  run the compiled graph uncaptured (lazy initialisation, Triton and cuBLAS,
                         happens outside capture; until the pool's first capture on the capture
                         stream, allocating from the pool: CudaGraphs.warmup) and note every input's
                         address;
  the next call          capture, then replay. Inputs whose address never changed (parameters,
                         buffers, tensors an optimizer updates in place) are read where they are;
                         the others are copied into static buffers before each replay;
  later calls            replay. A static input at a new address is re-captured as a copied one:
                         a graph never reads memory its caller no longer means.
Outputs are handed out in the graph's memory, lent (cudagraph_io): the graph is not replayed over
a lent tensor that is still alive (that call runs uncaptured), so a caller's earlier results never
change; an output aliasing an input is rebuilt as a view of the caller's tensor. A forward's tensors
saved for the backward are lent (LEND_SAVED) and the backward reads them in place; the outputs a
caller sees are lent (LEND_OUTPUTS) until a caller keeps one alive into a later call (`y = f(x)` in a
loop holds the last y during the call): that callable's graphs are then captured again, copying them.
The graphs of one compiled callable (forward, backward, every shape) share one memory pool per
device: as large as the largest graph's scratch plus every graph's outputs (kept alive by the graph,
so no later capture allocates over them). A later capture may take its outputs from an earlier
graph's scratch, so a graph is not replayed while a tensor lent by a graph captured after it is
alive (Lending.alive_after): it is captured again around that memory. Replays run one after another
on one stream (autograd runs a backward on its forward's stream), so scratch is otherwise free.
The callable holds the pool for its
lifetime as a `torch.cuda.MemPool` plus an anchor graph captured into it: the device allocator counts
the MemPool as a user, but torch 2.11's pinned-host allocator counts only captured graphs and refuses
(`use_count > 0` assertion) a capture into a pool whose graphs were all destroyed, which is what a
re-capture (the old graph is dropped first) or an eviction would otherwise do.
"""
from __future__ import annotations

import warnings
import weakref

import torch
import torch.fx as fx

from . import cudagraph_workspaces
from .compile import choose_target
from .cudagraph_checks import (MAX_GRAPHS, Refused, SignatureCache, mutated_inputs,
                               refusal_reason, saved_for_backward, signature)
from .cudagraph_io import Captured, Entry, Lending, Outputs, lent_pointers, static_buffer
from .cudagraph_recovery import release_generator, stop_routing
from .options import Environment
from .report import GraphReport

WARMUP_CALLS = 2  # uncaptured calls per signature before capture
_warned: set[str] = set()


SHARE_POOL = True  # False: a private pool per captured graph (benchmarks/cudagraph_memory.py compares)
LEND_SAVED = True  # False: tensors saved for the backward are copied out like every output
LEND_OUTPUTS = True  # False: the outputs a caller sees are always copied out of graph memory
WARMUP_IN_POOL = True  # False: every warm-up allocates from the caller's stream cache (cudagraph_memory compares)


class CudaGraphs:
    """torch.cuda.CUDAGraph capture and replay; the graphs captured through one instance share a
    memory pool per device (see the module docstring)."""

    cpu_ok = False
    # the capture stream per device: cuBLAS keeps a workspace per (handle, stream), so captures on a
    # stream of their own keep theirs in the pool (ARCHITECTURE.md)
    _streams: dict[int, torch.cuda.Stream] = {}

    def __init__(self, share_pool: bool | None = None):
        self.share_pool = SHARE_POOL if share_pool is None else share_pool
        self.pools: dict[int, tuple] = {}  # device -> (MemPool, anchor graph)
        self.captured_into: set[int] = set()  # devices whose shared pool holds a captured graph of ours

    def pool(self, device: int):
        """The pool id to capture into on this device (None: a private pool for this graph). A new
        shared pool starts with an anchor graph (one memset) held as long as the pool: torch 2.11's
        pinned-host allocator counts the graphs captured into a pool and refuses a capture into one
        whose graphs were all destroyed (an evicted or re-captured graph was the last)."""
        if not self.share_pool:
            return None
        if device not in self.pools:
            with torch.cuda.device(device):
                pool = torch.cuda.MemPool()
                anchor, _ = self._record(lambda _: torch.zeros(1, device=device), [], device, pool.id)
                self.pools[device] = (pool, anchor)
        return self.pools[device][0].id

    def busy(self) -> bool:
        """Called inside someone else's capture: run plainly, the outer graph records it."""
        return torch.cuda.is_current_stream_capturing()

    def _stream(self, device: int) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def warmup(self, fn, args, device: int):
        """Until the first capture into the device's shared pool, a warm-up runs where the capture
        will: on the capture stream, allocating from the pool, so the blocks it frees are the ones
        the capture takes next (as Inductor's CUDA-graph trees warm up). On the caller's stream they
        would stay cached by the general allocator beside the pool: a training step's footprint held
        twice. After a capture, warm-ups (a new shape, a re-capture) run on the caller's stream: an
        uncaptured call allocating in the pool could be handed a graph's scratch, which its replay
        overwrites."""
        with torch.cuda.device(device):
            if not (WARMUP_IN_POOL and self.share_pool and device not in self.captured_into
                    and hasattr(torch.cuda, "use_mem_pool")):
                return fn(args)
            self.pool(device)
            pool, caller, side = self.pools[device][0], torch.cuda.current_stream(), self._stream(device)
            # the side stream waits for everything the caller queued: the inputs, and the caller's reads of
            # pool blocks it freed since (no record_stream: the capture could not reuse a block whose
            # event it cannot query, and captures synchronize first)
            side.wait_stream(caller)
            with torch.cuda.stream(side), torch.cuda.use_mem_pool(pool):
                outs = fn(args)
            caller.wait_stream(side)
            return outs

    def capture(self, fn, args, device: int):
        pool = self.pool(device)
        if pool is not None:
            self.captured_into.add(device)
        return self._record(fn, args, device, pool)

    def _record(self, fn, args, device: int, pool):
        """Capture fn(args) on the side stream into `pool` (None: a private pool). On failure the side
        stream is retired, the device's generator released (a capture that never ended leaves it
        "capturing") and the pool's allocation routing ended (`stop_routing`)."""
        with torch.cuda.device(device):
            graph, side = torch.cuda.CUDAGraph(), self._stream(device)
            pool = torch.cuda.graph_pool_handle() if pool is None else pool  # known, to end its routing
            torch.cuda.synchronize()
            with torch.cuda.stream(side):
                try:
                    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                except BaseException:
                    self._abandon(device, pool)
                    raise
                try:
                    outs = fn(args)
                except BaseException:
                    try:
                        graph.capture_end()
                    except Exception:  # noqa: BLE001 (the capture is already invalid; keep the first error)
                        release_generator(device)
                        stop_routing(device, pool)
                    self._streams.pop(device, None)  # a failed capture retires its stream
                    raise
                try:
                    graph.capture_end()
                except BaseException:
                    self._abandon(device, pool)
                    raise
        return graph, outs

    def _abandon(self, device: int, pool) -> None:
        """After a capture that failed to begin or end: the generator is left capturing, the pool
        still routed to and the stream in capture mode; release, end and retire them."""
        release_generator(device)
        stop_routing(device, pool)
        self._streams.pop(device, None)

    def replay(self, graph, device: int) -> None:
        graph.replay()


class GraphedCallable:
    """The boxed callable aot_autograd gets: the compiled graph, replayed as CUDA graphs."""

    def __init__(self, fn, name: str, record: GraphReport, mutated: set[int], backend=None,
                 warmup: int = WARMUP_CALLS, max_graphs: int | None = None, lending: Lending | None = None,
                 lend: frozenset = frozenset()):
        # an instance attribute: dynamo's aot_autograd helper wraps the compiled backward with
        # functools.wraps, which copies the instance's __dict__ (a class attribute would be lost and
        # aot_autograd would call this unboxed)
        self._boxed_call = True
        self.fn, self.name, self.record, self.mutated = fn, name, record, mutated
        self.backend = backend if backend is not None else CudaGraphs()
        self.warmup = warmup
        self.cache = SignatureCache(MAX_GRAPHS if max_graphs is None else max_graphs, self._evicted)
        # outputs saved for the backward, lent instead of copied (cudagraph_io); shared with the backward
        self.lending, self.lend = (lending if lending is not None else Lending()), (lend if LEND_SAVED else frozenset())
        # until a caller keeps an output into its next call; a forward copying its saved tensors
        # (LEND_SAVED off) copies every output, as before lending
        self.lend_users = LEND_OUTPUTS and (LEND_SAVED or not lend)
        self.kept_at: int | None = None  # the call at which one was kept
        self.calls = 0
        self.refused: str | None = None
        self.captures = self.recaptures = self.held_back = self.workspace_retirements = self.overlaps = 0
        self.workspaces_cleared = False  # set when someone frees cuBLAS's workspaces (cudagraph_workspaces)
        cudagraph_workspaces.watch(self)
        self._note = len(record.notes)
        record.notes.append(f"cudagraphs: enabled, nothing captured yet (capture at call {warmup + 1} of each "
                            f"input signature)")

    def __call__(self, args):
        self.calls += 1
        if self.lending.retired:  # a graph dropped while it lent: kept only as long as that lives
            self.lending.prune()
        if self.refused is not None:
            return self.fn(args)
        try:
            key, device = signature(args, self.backend.cpu_ok)
        except Refused as why:
            self.refuse(str(why))
            return self.fn(args)
        if self.backend.busy():
            return self.fn(args)
        if self.workspaces_cleared:
            self._retire_all()
        entry = self.cache.get(key)
        if entry is None:
            entry = self.cache.put(key, Entry(self.backend.cpu_ok))
        cap = entry.captured
        if cap is not None:
            moved = [i for i, ptr in cap.direct if args[i].data_ptr() != ptr]
            if not moved:
                if cap.outputs.kept_by_caller():  # the caller keeps results: copy them from now on
                    self._stop_lending_outputs()
                    return self.fn(args)
                if cap.outputs.lent_alive():  # a pending backward still reads what the last replay lent
                    self.held_back += 1
                    self._update_note()
                    return self.fn(args)
                later = self.lending.alive_after(cap.outputs.index) if getattr(self.backend, "share_pool", True) else []
                if not later:
                    return self._replay(cap, args, device)
                self.overlaps += 1  # captured again below, around what the later graphs lent
                if self._give_way(later):
                    return self.fn(args)
            entry.moved.update(moved)
            self.lending.retire(cap)
            entry.captured, cap = None, None
            self.recaptures += 1
        else:
            entry.observe(args)
            if entry.calls <= self.warmup:
                return self.backend.warmup(self.fn, args, device)
        try:
            entry.captured = self._capture(entry, args, device)
        except Refused as why:
            self.refuse(str(why))
            return self.fn(args)
        except Exception as exc:  # noqa: BLE001 (any capture failure: run uncaptured, say why)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            self.refuse(f"capture failed ({type(exc).__name__}: {first}); the graph may sync with the CPU")
            return self.fn(args)
        self.captures += 1
        self._update_note()
        return self._replay(entry.captured, args, device)

    def _capture(self, entry: Entry, args, device: int) -> Captured:
        tensors = entry.graph_inputs(args)
        lent = lent_pointers() if entry.moved else set()  # a forward graph's memory: read in place
        copied = [i for i in tensors if i in entry.moved and args[i].data_ptr() not in lent]
        stale = sorted(self.mutated.intersection(copied))
        if stale:
            raise Refused(f"input {stale[0]} is written in place by the graph but arrives at a new address on "
                          f"some calls: a captured graph would write to a stale copy")
        static, copies = list(args), []
        for i in copied:
            buf, flat = static_buffer(args[i])
            static[i] = buf
            copies.append((i, buf, flat))
        graph, outs = self.backend.capture(self.fn, list(static), device)
        direct = [(i, args[i].data_ptr()) for i in tensors if i not in copied]
        outputs = Outputs(outs, static, self.lend, self.lend_users)
        outputs.index, outputs.owner = self.lending.next_index(), weakref.ref(self)
        if any(outputs.lendable):
            self.lending.outputs.add(outputs)
        return Captured(graph, direct, copies, outputs)

    def _replay(self, cap: Captured, args, device: int) -> tuple:
        for i, buf, flat in cap.copies:
            if flat is None:
                buf.copy_(args[i])
            else:
                flat.copy_(args[i].as_strided((flat.numel(),), (1,)))
        self.backend.replay(cap.graph, device)
        outs = cap.outputs.materialize(args)
        args.clear()
        return outs

    def _give_way(self, later: list) -> bool:
        """This graph may not replay over what graphs captured after it lent (Lending.alive_after):
        it is captured again, around that memory. A callable whose caller keeps such an output stops
        lending them (else the two would take turns re-capturing); True if that dropped this
        callable's own graphs (the call then runs uncaptured)."""
        switched = set()
        for o in later:
            owner = o.owner() if o.owner is not None else None
            if owner is not None and owner.lend_users and o.kept_by_caller():
                owner._stop_lending_outputs(owner.calls if owner is self else owner.calls + 1)
                switched.add(id(owner))
        return id(self) in switched

    def _stop_lending_outputs(self, since: int | None = None) -> None:
        """A caller kept an output the last replay lent into this call: the graphs lent in place,
        so each is dropped (its memory kept while what it lent lives) and captured again, after the
        warm-up, copying the outputs a caller sees."""
        self.lend_users, self.kept_at = False, self.calls if since is None else since
        self._drop_graphs()
        self._update_note()

    def _retire_all(self) -> None:
        """cuBLAS's workspaces were freed since the last call: every graph's matmuls point at freed
        memory, so none replays again (those with lent outputs live until the outputs die); each
        signature warms up and captures anew."""
        self.workspaces_cleared = False
        if not len(self.cache):
            return
        self._drop_graphs()
        self.workspace_retirements += 1
        self._update_note()

    def _drop_graphs(self) -> None:
        """Forget every captured graph (its memory goes, or waits in Lending while it lent tensors live)."""
        for entry in self.cache.entries():
            self.lending.retire(entry.captured)
        self.cache = SignatureCache(self.cache.maxsize, self._evicted)

    def _evicted(self, entry: Entry) -> None:
        self.lending.retire(entry.captured)
        if entry.captured is not None:
            self._update_note()

    def refuse(self, reason: str) -> None:
        """Run without graphs from now on; the reason goes to the report and, once, to a warning."""
        self.refused = reason
        self._drop_graphs()
        refuse(self.record, self.name, reason, self._note)

    def _update_note(self) -> None:
        self.record.notes[self._note] = (
            f"cudagraphs: captured {self.captures} graph(s) ({len(self.cache)} kept of at most "
            f"{self.cache.maxsize}, {self.cache.evicted} evicted, {self.recaptures - self.overlaps} re-captured "
            f"after a static input moved, {self.overlaps} around memory a later graph lent, all retired "
            f"{self.workspace_retirements} time(s) after cuBLAS's workspaces were freed); " + (f"tensors saved for the backward lent, not copied (held back from a replay "
                                 f"{self.held_back} time(s) while a backward was pending); other " if self.lend else "")
            + self._outputs_note())

    def _outputs_note(self) -> str:
        if self.lend_users:
            return "outputs lent in graph memory (a caller keeping one into its next call switches to copies)"
        if self.kept_at is not None:
            return f"outputs copied out after each replay (since call {self.kept_at}: a caller kept one)"
        return "outputs copied out after each replay"


def refuse(record: GraphReport, name: str, reason: str, note: int | None = None) -> None:
    """Record a refusal (report fallbacks, the graph's cudagraphs note) and warn once per reason."""
    record.fallbacks.append(("cudagraphs", reason))
    if note is None:
        record.notes.append(f"cudagraphs: refused: {reason}")
    else:
        record.notes[note] = f"cudagraphs: refused: {reason}"
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"fxopt: cudagraphs: the {name} graph runs without CUDA graphs: {reason}", stacklevel=3)


def graphed_compiler(compiler, report, options):
    """Wrap an aot_autograd graph compiler so every graph it compiles replays as CUDA graphs; the
    graphs of one compiled callable (forward, backward, inference) capture into one shared pool."""
    backend, lending = CudaGraphs(), Lending()

    def compile_graph(gm: fx.GraphModule, example_inputs, *, graph_name: str):
        target = choose_target(gm, Environment.read())
        reason = refusal_reason(gm, target, options.profile)  # read before the passes rewrite gm
        mutated = mutated_inputs(gm)
        lend = saved_for_backward(gm) if graph_name == "forward" else frozenset()
        first = len(report.graphs)
        call = compiler(gm, example_inputs, graph_name=graph_name)
        record = next((g for g in report.graphs[first:] if g.name == graph_name), None)
        if record is None:  # compile_aten_graph always records one; keep going if that ever changes
            record = GraphReport(name=graph_name, target=target)
        if reason is not None:
            refuse(record, graph_name, reason)
            return call
        return GraphedCallable(call, graph_name, record, mutated, backend, lending=lending, lend=lend)

    return compile_graph

