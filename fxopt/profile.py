"""fxopt.profile: where a compiled step's time goes, kernel by kernel, next to the roofline.

    prof = fxopt.profile(model, *inputs, warmup=3, repeat=10)
    print(prof)   # each kernel and ATen call: measured time, least time at the ceilings, % of it; MFU

The model is compiled with Options(profile=True): every wrapper runs each kernel launch and ATen call
inside `with region(name):` (codegen/wrapper.py), which this module times. Normal compiles generate
no regions, so they pay nothing.

On the GPU each region is a pair of CUDA events, read once after all steps. Events are chosen over
torch.profiler because they need no CUPTI (often missing in containers), time Triton launches and
ATen calls the same way, and read no trace format that changes between torch releases. An event pair
measures the span a line occupies on the stream: when the GPU waits for the CPU to launch (small
kernels), that wait is in the span, and the row shows it. On the CPU each region is timed with the
wall clock; Triton kernels there run in the interpreter (or as eager subgraphs), so the times say
where a CPU run spends its time, not how fast the kernels are on a GPU.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_leaves

from .analysis.roofline import Ceilings
from .backend import before_tracing, compile_dynamo_graph
from .options import Options
from .report import GraphReport, Report

_TIMER = None  # the timer of the profile() call now measuring; profiling wrappers run untimed otherwise


class _Region:
    """`with region(name):` in a profiling wrapper: timed while profile() measures, free otherwise."""

    __slots__ = ("key",)

    def __init__(self, graph_id: int, name: str):
        self.key = (graph_id, name)

    def __enter__(self):
        if _TIMER is not None:
            _TIMER.start()

    def __exit__(self, *exc_info):
        if _TIMER is not None:
            _TIMER.stop(self.key)


def attach_timer(call, record: GraphReport) -> None:
    """Bind the loaded profiling wrapper's `region` (a global of its module) to this module's timer,
    keyed by the graph so that rows of the forward and backward (or of two graph breaks) stay apart."""
    call.__globals__["region"] = functools.partial(_Region, id(record))


class _WallClock:
    """CPU: the host waits for every op, so the wall clock around a region is that region's time."""

    label = "CPU wall clock (not representative of GPU speed: Triton kernels ran in the interpreter " \
            "or as eager subgraphs)"

    def __init__(self):
        self._spans: list[tuple[tuple, float]] = []
        self._start = 0.0

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self, key: tuple) -> None:
        self._spans.append((key, time.perf_counter() - self._start))

    def spans(self) -> list[tuple[tuple, float]]:
        return self._spans

    @staticmethod
    def seconds_per_step(step, repeat: int) -> float:
        start = time.perf_counter()
        for _ in range(repeat):
            step()
        return (time.perf_counter() - start) / repeat


def _recorded_event():
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class _CudaEvents:
    """GPU: an event pair per region on the current stream; no synchronisation until all steps ran."""

    label = "CUDA events"

    def __init__(self):
        self._pairs: list[tuple[tuple, object, object]] = []
        self._start = None

    def start(self) -> None:
        self._start = _recorded_event()

    def stop(self, key: tuple) -> None:
        self._pairs.append((key, self._start, _recorded_event()))

    def spans(self) -> list[tuple[tuple, float]]:
        torch.cuda.synchronize()
        return [(key, start.elapsed_time(end) / 1e3) for key, start, end in self._pairs]

    @staticmethod
    def seconds_per_step(step, repeat: int) -> float:
        begin = _recorded_event()
        for _ in range(repeat):
            step()
        end = _recorded_event()
        torch.cuda.synchronize()
        return begin.elapsed_time(end) / 1e3 / repeat


@dataclass
class ProfileRow:
    graph: str  # "<index>_<name>" of the compiled graph (as dump file names have it): "0_forward"
    name: str  # the kernel's name, or the ATen call's node name (its wrapper line)
    kind: str  # the roofline's kind (pointwise, reduction, matmul, attention, aten); "view" for views
    calls: int  # per step
    seconds: float  # measured, per step (all its calls)
    least_seconds: float | None  # the roofline's least time per step; None for views (they move no bytes)
    flops: int  # per step, as the roofline counts them

    @property
    def percent_of_roofline(self) -> float | None:
        """least time / measured time, in percent: 100 runs at the device's ceiling."""
        if self.least_seconds is None or self.seconds <= 0:
            return None
        return 100 * self.least_seconds / self.seconds


@dataclass
class ProfileReport:
    rows: list[ProfileRow]  # in the order they first ran
    step_seconds: float  # one step (mean over the timed steps)
    timing: str  # how rows and the step were timed
    device: str  # "cuda" or "cpu"
    warmup: int
    repeat: int
    report: Report  # what the compile did (passes, kernels, roofline)
    ceilings: Ceilings = Ceilings()

    @property
    def flops(self) -> int:
        """FLOPs of one step (the roofline's counts of every timed kernel and ATen call)."""
        return sum(r.flops for r in self.rows)

    @property
    def achieved_flops_per_s(self) -> float:
        return self.flops / self.step_seconds if self.step_seconds > 0 else 0.0

    @property
    def mfu(self) -> float:
        """Model FLOP utilisation: achieved FLOP/s over the matmul peak of the ceilings (a fraction)."""
        return self.achieved_flops_per_s / self.ceilings.matmul_flops_per_s

    @property
    def attributed_seconds(self) -> float:
        """Time inside timed regions per step; the rest of the step is Python, guards and autograd."""
        return sum(r.seconds for r in self.rows)

    def __str__(self) -> str:
        return "\n".join(_summary(self) + _table(self.rows))


def profile(model, *inputs, warmup: int = 3, repeat: int = 10, dynamic: bool = False, **options) -> ProfileReport:
    """Compile `model` with fxopt, run it, and time each kernel and ATen call of every compiled graph.

    A step is `model(*inputs)`, plus the gradients of its outputs when they require grad (returned by
    torch.autograd.grad, never accumulated into .grad). `warmup` steps run untimed (at least one: it
    compiles); then `repeat` steps are timed, each whole and region by region (so the step's time
    holds the regions' and includes the hooks' own small cost). `dynamic=True` compiles with symbolic
    sizes, as torch.compile(dynamic=True) does. Options are fxopt's (precision, fuse, ...)."""
    global _TIMER
    if repeat < 1:
        raise ValueError(f"fxopt.profile: repeat={repeat}; at least one step must be timed")
    report = Report()
    opts = Options.from_kwargs(**options).replace(profile=True)
    before_tracing()
    compiled = torch.compile(model, backend=lambda gm, example: compile_dynamo_graph(gm, example, opts, report),
                             dynamic=dynamic)
    step = _step(compiled, model, inputs)
    for _ in range(max(1, warmup)):
        step()
    on_gpu = any(g.target == "cuda" for g in report.graphs)
    timer = _CudaEvents() if on_gpu else _WallClock()
    _TIMER = timer
    try:
        step_seconds = timer.seconds_per_step(step, repeat)
    finally:
        _TIMER = None
    return ProfileReport(_rows(report, timer.spans(), repeat), step_seconds, timer.label,
                         "cuda" if on_gpu else "cpu", warmup, repeat, report)


def _step(compiled, model, inputs):
    """One step: the call, then gradients of its outputs with respect to every leaf requiring grad."""
    params = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
    leaves = [t for t in (*params, *inputs) if isinstance(t, torch.Tensor) and t.requires_grad]

    def step():
        outputs = [o for o in tree_leaves(compiled(*inputs)) if isinstance(o, torch.Tensor) and o.requires_grad]
        if outputs and leaves:
            torch.autograd.grad(outputs, leaves, [torch.ones_like(o) for o in outputs], allow_unused=True)

    return step


def _rows(report: Report, spans: list[tuple[tuple, float]], repeat: int) -> list[ProfileRow]:
    """Sum the spans per (graph, region), per step, next to the graph's roofline row of that name."""
    labels = {id(g): f"{i}_{g.name}" for i, g in enumerate(report.graphs)}
    roofline = {(id(g), r.name): r for g in report.graphs for r in g.roofline}
    measured: dict[tuple, list[float]] = {}
    for key, seconds in spans:
        measured.setdefault(key, []).append(seconds)
    rows = []
    for key, times in measured.items():
        calls = len(times) // repeat
        roof = roofline.get(key)
        rows.append(ProfileRow(labels[key[0]], key[1], roof.kind if roof else "view", calls, sum(times) / repeat,
                               roof.seconds * calls if roof else None, roof.flops * calls if roof else 0))
    return rows


def _summary(prof: ProfileReport) -> list[str]:
    c = prof.ceilings
    share = prof.attributed_seconds / prof.step_seconds if prof.step_seconds > 0 else 0.0
    return [
        f"fxopt profile on {prof.device}, timed with {prof.timing}; {prof.warmup} warmup + {prof.repeat} timed steps",
        f"step {_time(prof.step_seconds)}: {_count(prof.flops)}FLOP -> {_count(prof.achieved_flops_per_s)}FLOP/s "
        f"achieved, MFU {100 * prof.mfu:.3g}% of {_count(c.matmul_flops_per_s)}FLOP/s ({c.name} matmul peak)",
        f"timed regions: {_time(prof.attributed_seconds)} ({100 * share:.0f}% of the step; the rest is Python, "
        f"guards, autograd and code between graphs)",
        "",
    ]


def _table(rows: list[ProfileRow]) -> list[str]:
    header = ["graph", "name", "kind", "calls", "measured", "roofline", "% of roofline"]
    cells = [[r.graph, r.name, r.kind, str(r.calls), _time(r.seconds),
              "-" if r.least_seconds is None else _time(r.least_seconds),
              "-" if r.percent_of_roofline is None else f"{r.percent_of_roofline:.3g}%"] for r in rows]
    widths = [max(len(line[i]) for line in [header, *cells]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [header, *cells]]


def _time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    if seconds >= 1e-6:
        return f"{seconds * 1e6:.2f} us"
    return f"{seconds * 1e9:.1f} ns"


def _count(value: float) -> str:
    """1.5e9 -> '1.5 G' (SI prefixes), so units follow: '1.5 GFLOP/s'."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}"
    return f"{value:.3g} "
