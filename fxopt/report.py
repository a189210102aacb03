"""Report: what explain() returns and what FXOPT_DUMP writes: every pass, kernel, fallback and graph."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from .pass_manager import PassRecord


@dataclass
class KernelRecord:
    name: str
    kind: str  # "pointwise" | "reduction" (attention: a later issue)
    ops: list[str]  # the ATen ops fused into it
    source: str  # the Triton source
    graph: str = "forward"
    schedule: str | None = None  # reductions: "persistent" (row in registers), "looped", "strided looped ..." or "split ...";
    # combined casts: how many it does
    standalone: str = ""  # the kernel as a file that runs on its own (kernels/<name>.py in dumps)


@dataclass
class AttentionSite:
    """One place attention was found (a softmax between two matmuls, or an SDPA call)."""

    node: str  # the node whose value the fused op replaces (the P @ V matmul, or the SDPA call)
    source: str  # the model's line of code, when dynamo recorded it
    fused: bool
    causal: bool = False
    scale: float | None = None
    mask: str = "none"  # "none" | "causal (...)" | "additive [shape]" (read by the kernel)
    kv_groups: int = 1  # query heads per kv head (grouped-query attention), 1 for multi-head
    recognised: list[str] = field(default_factory=list)  # the spellings that were folded away
    kernel: str | None = None  # what runs the fused op
    reason: str | None = None  # why a site was left unfused

    @property
    def fallback(self) -> str | None:
        """The contract's name (DESIGN.md) for `reason`: None for a fused site, else why it was not."""
        return self.reason

    def __str__(self) -> str:
        if not self.fused:
            return f"{self.node}: not fused: {self.reason}  [{self.source}]"
        gqa = f", {self.kv_groups} query heads per kv head" if self.kv_groups > 1 else ""
        scale = "1/sqrt(head dim)" if self.scale is None else f"{self.scale:.6g}"
        return (f"{self.node}: fused (causal={self.causal}, scale={scale}, mask={self.mask}{gqa}) "
                f"-> {self.kernel}; recognised: {', '.join(self.recognised) or '-'}  [{self.source}]")


@dataclass
class CastRecord:
    node: str
    from_dtype: str
    to_dtype: str
    reason: str


@dataclass
class BufferRecord:
    name: str
    nbytes: int
    first_use: int
    last_use: int
    offset: int


@dataclass
class MemoryPlan:
    naive_bytes: int  # every intermediate its own allocation
    lower_bound_bytes: int  # most bytes alive at any one node: no plan can use less
    planned_bytes: int  # the arena the plan uses
    buffers: list[BufferRecord]
    strategy: str = ""  # which placement order won
    sizes: dict[str, int] = field(default_factory=dict)  # symbolic graphs: the size values it was made for

    @property
    def ratio(self) -> float:
        return self.planned_bytes / self.lower_bound_bytes if self.lower_bound_bytes else 1.0


@dataclass
class GraphReport:
    """One compiled ATen graph (forward, backward or inference) of one captured dynamo graph."""

    name: str
    target: str
    passes: list[PassRecord] = field(default_factory=list)
    kernels: list[KernelRecord] = field(default_factory=list)
    fallbacks: list[tuple[str, str]] = field(default_factory=list)
    wrapper_source: str = ""
    captured_text: str = ""
    snapshots: dict[str, fx.GraphModule] = field(default_factory=dict)
    compile_seconds: float = 0.0
    triton_compile_seconds: float = 0.0  # part of compile_seconds: the CUDA kernels compiled up front
    cache: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    memory_plan: MemoryPlan | None = None
    roofline: list = field(default_factory=list)  # [RooflineRow] for every kernel and ATen call
    graph_svg: str = ""  # the final graph as a picture (explain and dumps only)
    # dynamic shapes: size symbol -> example value, dynamo's guards on them (text), and the per-size
    # memory plans (memory/size_plans.SizePlans; .plans fills as calls bring new sizes)
    symbols: dict[str, int] = field(default_factory=dict)
    guards: list[str] = field(default_factory=list)
    size_plans: object = None


@dataclass
class Report:
    graphs: list[GraphReport] = field(default_factory=list)
    pre_autograd: list[PassRecord] = field(default_factory=list)  # passes on the torch-level graph
    pre_autograd_notes: list[tuple[str, str]] = field(default_factory=list)  # (node, why a torch-level pass left it)
    attention: list[AttentionSite] = field(default_factory=list)
    casts: list[CastRecord] = field(default_factory=list)

    @property
    def roofline(self) -> list:
        """[RooflineRow(name, kind, flops, bytes, seconds)] of every compiled graph, in order."""
        return [r for g in self.graphs for r in g.roofline]

    @property
    def memory_plan(self) -> MemoryPlan | None:
        """The plan of the first compiled graph (each graph's is on rep.graphs[i].memory_plan)."""
        return self.graphs[0].memory_plan if self.graphs else None

    @property
    def passes(self) -> list[PassRecord]:
        return self.pre_autograd + [p for g in self.graphs for p in g.passes]

    @property
    def kernels(self) -> list[KernelRecord]:
        return [k for g in self.graphs for k in g.kernels]

    @property
    def fallbacks(self) -> list[tuple[str, str]]:
        return self.pre_autograd_notes + [f for g in self.graphs for f in g.fallbacks]

    @property
    def wrapper_source(self) -> str:
        return self.graphs[0].wrapper_source if self.graphs else ""

    def graph(self, after: str = "captured", graph: str | None = None) -> fx.GraphModule:
        """The graph as it stood after the named pass ("captured" for before any), of the first
        compiled graph or of the one named by `graph` ("forward", "backward", "inference")."""
        for g in self.graphs:
            if graph is not None and g.name != graph:
                continue
            if after in g.snapshots:
                return g.snapshots[after]
            known = sorted(g.snapshots) or ["(none kept: run through fxopt.explain)"]
            raise KeyError(f"fxopt: no pass named {after!r} in the {g.name} graph; known: {known}")
        raise KeyError(f"fxopt: no compiled graph named {graph!r}; have {[g.name for g in self.graphs]}")

    def __str__(self) -> str:
        from .report_text import report_to_text
        return report_to_text(self)

    def save(self, directory: str) -> None:
        """Write the same files FXOPT_DUMP writes: report.html, passes/, kernels/, wrapper.py."""
        from .dump import write_dump
        write_dump(self, directory)
