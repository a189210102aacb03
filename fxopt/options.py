"""Options: every knob fxopt has, in one dataclass, plus the one place environment variables are read."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields

PRECISIONS = (None, "fp32", "bf16", "fp16")
MEMORY_PLANS = (False, True, "apply")
VERIFY_RTOL = {"bf16": 3e-2, "fp16": 5e-3}  # verify's default tolerance per precision (1e-3 otherwise)
LOW_PRECISION_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "fp16"}  # str(dtype): no torch import here
# passes that only make the result faster and can be left out one by one (fuse=False, attention=False and
# precision=None switch off the others)
SKIPPABLE_PASSES = ("cpu_scalars_to_device", "sums_through_views", "fold_matmul_casts", "recompute_for_reductions",
                    "combine_casts", "bucket_all_reduces", "sink_collective_waits", "grad_over_logits",
                    "fuse_linear_cross_entropy")


@dataclass(frozen=True)
class Options:
    """What a user can ask of fxopt. Unknown names raise a TypeError listing these fields."""

    precision: str | None = None  # None keeps the model's dtypes; "bf16"/"fp16": mixed precision (passes/precision.py)
    precision_policy: dict | None = None  # overrides of the policy table, e.g. {"softmax": "low"} (see POLICY)
    fuse: bool = True  # fuse pointwise chains into Triton kernels
    attention: bool = True  # match hand-written attention and run fxopt's flash kernels
    memory_plan: bool | str = True  # True: plan an arena and report it; "apply": the wrapper allocates from it
    cudagraphs: bool = False  # replay compiled CUDA graphs with torch.cuda.CUDAGraph (cudagraphs.py); refusals
    # (CPU graphs, syncs, random ops) run without graphs, warn once and are listed in rep.fallbacks
    dump_dir: str | None = None  # write passes, kernels, wrapper and report.html here
    verify: bool = False  # check every pass numerically against the captured graph
    verify_rtol: float | None = None  # relative error (norm-wise) above which verify names the pass;
    # None: 1e-3, or the low dtype's rounding when precision is bf16 (3e-2) / fp16 (5e-3)
    keep_graphs: bool = False  # keep a copy of the graph after every pass (explain sets this)
    profile: bool = False  # wrappers time each kernel and ATen call in a named region (fxopt.profile sets this)
    # consecutive all-reduces of one group (DDP's python reducer: one per gradient) are issued as one
    # coalesced all-reduce per bucket of about this many MiB (passes/bucket_all_reduces.py); 0: one each
    all_reduce_bucket_mb: float = 25.0
    skip_passes: tuple = ()  # optional graph passes to leave out, by name (SKIPPABLE_PASSES): see or rule out one

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"fxopt: precision={self.precision!r} is not one of {PRECISIONS}")
        if not any(self.memory_plan is v or (isinstance(v, str) and self.memory_plan == v) for v in MEMORY_PLANS):
            raise ValueError(f"fxopt: memory_plan={self.memory_plan!r} is not one of {MEMORY_PLANS}")
        for name in ("cudagraphs", "fuse", "attention", "verify", "keep_graphs", "profile"):
            if not isinstance(getattr(self, name), bool):  # ("no" would be truthy)
                raise TypeError(f"fxopt: {name}={getattr(self, name)!r} must be True or False")
        rtol = self.verify_rtol
        if rtol is not None and (isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not rtol > 0):
            raise ValueError(f"fxopt: verify_rtol={rtol!r} must be a positive number (a relative error) or None")
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise TypeError(f"fxopt: dump_dir={self.dump_dir!r} must be a directory path or None")
        if isinstance(self.skip_passes, list):
            object.__setattr__(self, "skip_passes", tuple(self.skip_passes))
        if (not isinstance(self.skip_passes, tuple) or not all(isinstance(n, str) for n in self.skip_passes)
                or not set(self.skip_passes) <= set(SKIPPABLE_PASSES)):
            raise ValueError(f"fxopt: skip_passes={self.skip_passes!r} must be a tuple of names from "
                             f"{SKIPPABLE_PASSES}")
        mb = self.all_reduce_bucket_mb
        if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not mb >= 0:
            raise ValueError(f"fxopt: all_reduce_bucket_mb={self.all_reduce_bucket_mb!r} must be a number of MiB "
                             "(0 issues every all-reduce on its own)")
        if self.precision_policy is not None:
            from .analysis.precision_policy import check_overrides  # lazily: it loads the attention op
            check_overrides(self.precision_policy, self.precision)
            object.__setattr__(self, "precision_policy", dict(self.precision_policy))  # the caller's dict may change

    @property
    def verify_tolerance(self) -> float:
        """verify_rtol, or a default that a correct bf16/fp16 precision pass stays within."""
        return self.verify_tolerance_for(())

    def verify_tolerance_for(self, dtypes) -> float:
        """verify_rtol, or the default for a graph computing in `dtypes` under this precision: the
        lowest precision's (a graph's own fp16/bf16 chains run in fp32 and round once, where the
        captured graph rounds after every op)."""
        if self.verify_rtol is not None:
            return self.verify_rtol
        names = {self.precision} | {LOW_PRECISION_NAMES.get(str(d)) for d in dtypes}
        return max(VERIFY_RTOL.get(name, 1e-3) for name in names)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "Options":
        """Build Options from keyword arguments; unknown names are a TypeError that lists the valid ones."""
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(kwargs) - set(valid))
        if unknown:
            raise TypeError(f"fxopt: unknown option(s) {unknown}; valid options are {valid}")
        return cls(**kwargs)

    def replace(self, **changes) -> "Options":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Environment:
    """The environment variables fxopt reads, read once per compilation (never at import)."""

    dump_dir: str | None = None  # FXOPT_DUMP
    interpret: bool = False  # TRITON_INTERPRET=1: run Triton kernels on CPU tensors in the interpreter
    cache_dir: str = ""  # FXOPT_CACHE_DIR, else a per-user directory
    log_level: str | None = None  # FXOPT_LOG
    dump_all_passes: bool = False  # FXOPT_DUMP_ALL=1: dumps print passes that changed nothing too
    poison_freed: bool = False  # FXOPT_POISON_FREED=1: memory_plan="apply" wrappers NaN-fill dead arena regions
    static_launch: bool = True  # FXOPT_STATIC_LAUNCH=0: launch through Triton's launcher, not torch's C one
    compile_workers: int = 0  # FXOPT_COMPILE_WORKERS: processes compiling CUDA kernels (0: in this process)
    # FXOPT_BACKWARD_WITH_FORWARD=0: a CUDA training step's backward graph compiles at its first backward
    # call (torch's default), its kernels in the foreground, not with the forward's in the background
    backward_with_forward: bool = True
    # FXOPT_OWN_OPS_EARLY=0: the fused ops' kernels (attention, cross-entropy) start compiling with the
    # ATen graph's precompile, not as soon as the pre-autograd passes made the ops (codegen/own_op_compiles.py)
    own_ops_early: bool = True
    # FXOPT_COMPILE_SWITCH_INTERVAL: the GIL switch interval (seconds) while kernels compile on threads
    # beside the tracing main thread (codegen/gil_handoff.py); 0 leaves the interpreter's alone
    compile_switch_interval: float = 2e-4
    # FXOPT_COMPILE_GC_PAUSE=0: Python's cyclic garbage collector keeps running during fxopt's compiles
    # (gc_pause.py: paused by default; its full passes took about 0.9 s of a 24-block stack's first call)
    compile_gc_pause: bool = True

    @classmethod
    def read(cls) -> "Environment":
        cache = os.environ.get("FXOPT_CACHE_DIR") or _default_cache_dir()
        return cls(
            dump_dir=os.environ.get("FXOPT_DUMP") or None,
            interpret=os.environ.get("TRITON_INTERPRET", "0") == "1",
            cache_dir=cache,
            log_level=_log_level(),
            dump_all_passes=_switch("FXOPT_DUMP_ALL", False),
            poison_freed=_switch("FXOPT_POISON_FREED", False),
            static_launch=_switch("FXOPT_STATIC_LAUNCH", True),
            compile_workers=_worker_count(os.environ.get("FXOPT_COMPILE_WORKERS", "")),
            backward_with_forward=_switch("FXOPT_BACKWARD_WITH_FORWARD", True),
            own_ops_early=_switch("FXOPT_OWN_OPS_EARLY", True),
            compile_switch_interval=_seconds("FXOPT_COMPILE_SWITCH_INTERVAL", 2e-4),
            compile_gc_pause=_switch("FXOPT_COMPILE_GC_PAUSE", True),
        )


def _switch(name: str, default: bool) -> bool:
    """A 0/1 environment variable; anything else is an error naming it ("no" was read as the default)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if raw not in ("0", "1"):
        raise ValueError(f"fxopt: {name}={raw!r}: set it to 1 (on) or 0 (off)")
    return raw == "1"


def _log_level() -> str | None:
    raw = os.environ.get("FXOPT_LOG", "").strip()
    if raw and raw.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError(f"fxopt: FXOPT_LOG={raw!r} is not a log level; use debug, info, warning or error")
    return raw or None


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"fxopt: {name}={raw!r} is not a number of seconds; set it to 0 (off) or e.g. 0.0002")
    return value


def _worker_count(raw: str) -> int:
    """FXOPT_COMPILE_WORKERS, else 0. Off by default: on the H200 host the workers did not shorten a
    cold first call (GPT-2 and Llama blocks, training) and lengthened inference by 3-4 s, waiting
    for the attention workers' torch import (benchmarks/results/2026-12-04-h200.md); on an H100 host,
    with every kernel found in their cache, first calls were 2.5-4 s longer (2026-12-05-h100-b.md)."""
    if not raw.strip():
        return 0
    if not raw.strip().isdigit():
        raise ValueError(f"fxopt: FXOPT_COMPILE_WORKERS={raw!r} is not a count; set it to 0 (compile in this "
                         "process) or a number of worker processes")
    return int(raw)


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    user = os.environ.get("USER") or str(os.getuid())
    return os.path.join(base, f"fxopt-{user}")


def backward_with_forward(options: Options, env: Environment, example_inputs) -> bool:
    """Whether a training step's backward graph compiles right after its forward, not at the first
    backward call (torch.compile's default; explain() always wants it now): on CUDA, where both graphs'
    kernels then compile in the background at once (compile.py). Not yet with cudagraphs=True: that
    combination has not been run on a GPU (benchmarks/results/2026-12-04-h200-b.md)."""
    on_cuda = any(getattr(t, "is_cuda", False) is True for t in example_inputs)  # tensors, fake ones too
    return on_cuda and env.backward_with_forward and not options.cudagraphs
