"""The pass contract and the PassManager that runs a stage's passes under instruments.

Instruments wrap every pass: wall time, node counts, `graph.lint()`, a text snapshot (and a copy of
the graph when asked), and with `verify=True` a numerical check against the captured graph, so the
first pass that breaks numerics is named together with the node that went wrong.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from .errors import VerifyError
from .options import Environment, Options
from .printing import graph_to_text


@dataclass
class PassResult:
    gm: fx.GraphModule
    changed: bool
    stats: dict[str, int] = field(default_factory=dict)


@dataclass
class PassContext:
    """What a pass may read besides the graph: options, the target, and where to leave notes."""

    options: Options
    env: Environment
    graph_name: str = "forward"  # forward | backward | inference | torch (pre-autograd)
    target: str = "cuda"  # cuda | interpret | eager (CPU tensors without TRITON_INTERPRET)
    notes: list[tuple[str, str]] = field(default_factory=list)  # (node name, reason) for nodes left alone
    inspect: bool = False  # someone will read the report (explain, dumps): print graphs after each pass
    example_inputs: list | None = None  # pre-autograd only: the real inputs dynamo compiled for
    attention: list = field(default_factory=list)  # AttentionSite records from the attention matcher
    casts: list = field(default_factory=list)  # CastRecord of every cast the precision pass inserted
    input_guards: list = field(default_factory=list)  # InputGuard: facts about inputs checked every call
    unspecialised: object = None  # buffer_guards.UnspecialisedGraph: what runs when an input guard fails
    donated: frozenset = frozenset()  # backward only: inputs it may consume (aot.donated_backward_inputs)

    def note(self, node_name: str, reason: str) -> None:
        self.notes.append((node_name, reason))

    @property
    def device_type(self) -> str:
        """The device kernels are generated for: CPU graphs run (or are interpreted) on the CPU."""
        return "cpu" if self.target in ("interpret", "eager") else "cuda"


class Pass(Protocol):
    name: str

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult: ...


@dataclass
class PassRecord:
    name: str
    seconds: float
    nodes_before: int
    nodes_after: int
    stats: dict[str, int]
    graph: str = "forward"
    changed: bool = False
    text: str = ""  # the graph after the pass, printed as Python
    max_rel_error: float | None = None  # set by verify=True


def snapshot(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of the graph whose tensors (parameters, buffers, constants) are shared, not copied.

    The graph is what a snapshot is for; copying a constant tensor would double its memory, and a
    compile runs under aot_autograd's fake mode, where cloning a real tensor's storage fails."""
    memo = {}
    for module in gm.modules():
        for value in (*vars(module).values(), *module._parameters.values(), *module._buffers.values()):
            if isinstance(value, torch.Tensor):
                memo[id(value)] = value
    return copy.deepcopy(gm, memo)


def count_nodes(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op not in ("placeholder", "output"))


def lazy_code(gm: fx.GraphModule) -> fx.GraphModule:
    """The same graph in a module that makes its Python code only when it is run or printed.

    Passes recompile the module after changing its graph, so that it stays runnable, and recompiling an
    eager GraphModule generates and compiles the whole graph's code: a 24-block GPT-2 backward paid that
    after each pass, every fused submodule's code again with it (2.5 of its 7.1 s of compile, CPU machine),
    and nothing ran that code between passes (verify runs the graph node by node, through fx.Interpreter)."""
    if isinstance(gm, _LazyGraphModule):
        return gm
    lazy = _LazyGraphModule(gm, gm.graph, type(gm).__name__)
    lazy.meta = gm.meta
    for name, value in vars(gm).items():  # attributes a compiler set on the module, such as a shape env
        if name not in vars(lazy) or name == "shape_env":
            setattr(lazy, name, value)
    return lazy


@dataclass
class PassManager:
    """Runs passes in order. A failing pass raises with the list of passes that ran before it."""

    passes: list[Pass]
    verifier: Callable[[fx.GraphModule, str], float] | None = None  # returns max rel error or raises

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> tuple[fx.GraphModule, list[PassRecord], dict]:
        records: list[PassRecord] = []
        snapshots: dict[str, fx.GraphModule] = {}
        gm = lazy_code(gm)
        if ctx.options.keep_graphs:
            snapshots["captured"] = snapshot(gm)
        for p in self.passes:
            before = count_nodes(gm)
            start = time.perf_counter()
            try:
                result = p(gm, ctx)
                result.gm.graph.lint()
            except VerifyError:
                raise
            except Exception as exc:
                ran = [r.name for r in records] or ["(none)"]
                raise type(exc)(f"{exc}\n[fxopt] pass '{p.name}' failed on the {ctx.graph_name} graph; "
                                f"passes that ran before it: {', '.join(ran)}") from exc
            seconds = time.perf_counter() - start
            gm = result.gm
            if ctx.options.keep_graphs:
                gm.recompile()  # (snapshots are printed as code)
            record = PassRecord(p.name, seconds, before, count_nodes(gm), dict(result.stats),
                                ctx.graph_name, result.changed,
                                graph_to_text(gm, f"after {p.name}") if ctx.inspect else "")
            if self.verifier is not None:
                record.max_rel_error = self.verifier(gm, p.name)
            records.append(record)
            if ctx.options.keep_graphs:
                snapshots[p.name] = snapshot(gm)
        gm.recompile()  # (lazy: the code is made when the graph is first run or printed)
        return gm, records, snapshots
