"""Measurement helpers for benchmarks/run.py: backends, timing, memory, correctness, copy ceiling, cold first call."""
from __future__ import annotations

import copy
import datetime
import gc
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import triton

from .workloads import tensors

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST_CALL_MARK = "FIRST_CALL_JSON "
BACKENDS = ("eager", "inductor", "fxopt", "sdpa")  # sdpa: the workload's anchor, run eagerly
# Asked for by name only: fxopt (Inductor) compiled with dynamic=True in the same process as "fxopt"
# ("inductor"): the host's speed differs between processes by more than issue 9's 10%, so static and
# dynamic alternate in one
OPTIONAL_BACKENDS = ("fxopt_dynamic", "inductor_dynamic")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# allclose tolerances against eager, per dtype (compiled kernels compute in fp32 and round once, eager
# rounds after every op, so a chain of ops differs by a few ulps of the output)
TOLERANCES = {torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (1e-3, 1e-3), torch.float32: (1.3e-5, 1e-5)}


# ---------------------------------------------------------------- environment
def header(device: str) -> dict:
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except Exception:
            return ""
    # BENCH_COMMIT first: a snapshot run inside another checkout would otherwise report that one's HEAD
    commit = os.environ.get("BENCH_COMMIT") or git("rev-parse", "--short", "HEAD") or "unknown"
    if "BENCH_COMMIT" not in os.environ and commit != "unknown" and git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    if device == "cuda":
        dev_name = torch.cuda.get_device_name()
    else:
        dev_name = f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": commit,
            "device": dev_name, "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(),
            "command": "python -m benchmarks.run " + shlex.join(sys.argv[1:]),
            "triton_interpret": os.environ.get("TRITON_INTERPRET", "0")}


# ---------------------------------------------------------------- backends
DYNAMIC: list = [None]  # --dynamic: torch.compile(..., dynamic=True) for inductor and fxopt (issue 9's comparison)
FXOPT_OPTIONS: dict = {}  # --fxopt-option KEY=VALUE: extra fxopt.backend options for every fxopt row
FXOPT_REPORTS: list = []  # the Report of the latest fxopt compile (every graph it compiled), for plan/LB


def compile_for(backend: str, fn, w=None, *, fresh: bool = False):
    """`fn` as `backend` runs it for workload `w`: a mixed-precision workload (w.precision) runs eager and
    Inductor under torch.autocast and fxopt with precision=...; w.cudagraphs asks both compilers for
    CUDA graphs (Inductor mode="reduce-overhead", fxopt cudagraphs=True). `fresh`: nothing was compiled
    in this process yet (a first-call child), so dynamo is not reset: torch.compile's reset imports
    Inductor's CUDA-graph trees and with them all of Inductor (seconds, cold), which a user's first call
    never pays."""
    if not fresh:
        torch._dynamo.reset()
    precision = getattr(w, "precision", None)
    graphs = bool(getattr(w, "cudagraphs", False))
    if backend == "eager":
        return autocast(fn, precision)
    dynamic = True if backend in OPTIONAL_BACKENDS else DYNAMIC[0]  # "<compiler>_dynamic"
    compiler = backend.removesuffix("_dynamic")
    if compiler == "inductor":
        return torch.compile(autocast(fn, precision), mode="reduce-overhead" if graphs else None, dynamic=dynamic)
    if compiler == "fxopt":
        return torch.compile(fn, backend=_recording_fxopt(precision=precision, cudagraphs=graphs), dynamic=dynamic)
    raise SystemExit(f"unknown backend {backend!r}; known: {', '.join(BACKENDS + OPTIONAL_BACKENDS)}")


def autocast(fn, precision: str | None):
    """`fn` under torch.autocast(precision) on the device of its first tensor argument (no-op for None)."""
    if precision is None:
        return fn
    dtype = DTYPES[precision]

    def autocast_fn(*args):
        device = next((a.device.type for a in tensors(list(args))), "cuda")
        with torch.autocast(device, dtype=dtype):
            return fn(*args)
    return autocast_fn


def _recording_fxopt(**options):
    """The fxopt backend with the workload's options, keeping its Report so the runner can read the
    memory plan (planned bytes / lower bound) of what it compiled."""
    from fxopt.backend import before_tracing, compile_dynamo_graph
    from fxopt.options import Options
    from fxopt.report import Report
    FXOPT_REPORTS[:] = [Report()]
    opts = Options(**{**{k: v for k, v in options.items() if v}, **FXOPT_OPTIONS})
    before_tracing()  # as torch.compile(backend="fxopt") does when it loads the entry point
    return lambda gm, example_inputs: compile_dynamo_graph(gm, example_inputs, opts, FXOPT_REPORTS[0])


def plan_ratio() -> float | None:
    """Worst planned_bytes / lower_bound_bytes over the graphs of the latest fxopt compile."""
    plans = [g.memory_plan for rep in FXOPT_REPORTS for g in rep.graphs if g.memory_plan is not None]
    return max((p.ratio for p in plans), default=None)


def backends_for(w, requested) -> list[str]:
    """The requested backends that apply to workload `w`: "sdpa" only where `w` has an anchor."""
    return [b for b in requested if b != "sdpa" or w.anchor is not None]


def runnable(w, backend: str, fn, *, fresh: bool = False):
    """What `backend` calls with the workload's inputs: `fn` compiled by it, or, for "sdpa", the
    workload's anchor (the same computation through F.scaled_dot_product_attention), uncompiled."""
    if backend == "sdpa":
        if not fresh:
            torch._dynamo.reset()
        return autocast(w.anchor, w.precision)
    return compile_for(backend, fn, w, fresh=fresh)


def as_float64(inputs) -> list:
    """The inputs of the float64 reference run: floating tensors as float64, modules as float64 copies
    (a workload may pass an nn.Module, e.g. gpt_block), anything else unchanged."""
    def convert(x):
        if isinstance(x, torch.Tensor):
            return x.double() if x.is_floating_point() else x
        if isinstance(x, torch.nn.Module):
            return copy.deepcopy(x).double()
        return x
    return [convert(x) for x in inputs]


def grad_mode(w):
    return torch.enable_grad() if w.training else torch.no_grad()


def sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def parse_fxopt_option(text: str) -> tuple[str, object]:
    """KEY=VALUE with VALUE as Python reads it where it can (True, 3, "apply" stays a string)."""
    import ast
    key, sep, value = text.partition("=")
    if not sep:
        raise ValueError(f"--fxopt-option wants KEY=VALUE, got {text!r}")
    try:
        return key.strip(), ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key.strip(), value


# ---------------------------------------------------------------- measurements
def bench_ms(call, device: str, warmup: int, rep: int) -> float:
    """Median milliseconds per call: triton's do_bench (CUDA events, L2 flushed) on cuda, else perf_counter."""
    if device == "cuda":
        import triton.testing
        return float(triton.testing.do_bench(call, warmup=warmup, rep=rep, return_mode="median"))
    end = time.perf_counter() + warmup / 1e3
    call()
    while time.perf_counter() < end:
        call()
    times, end = [], time.perf_counter() + rep / 1e3
    while len(times) < 5 or (time.perf_counter() < end and len(times) < 10000):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def peak_mib(call, device: str) -> float | None:
    """Peak memory allocated during one call, above what was allocated before it (the inputs and
    anything else alive); includes the outputs. None off cuda."""
    if device != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def compare(got, expected, rtol: float, atol: float, ref64=None) -> tuple[str, float, str]:
    """("yes" | "yes*" | "NO", max |got - expected| over every output tensor, a note).

    "yes": allclose to eager. "yes*": not allclose to eager, but no less accurate than eager against a
    float64 run of the same function (`ref64()`, called only then): compiled kernels keep fp32 between
    ops where eager rounds to bf16 after each, so on long chains eager is the less accurate of the two."""
    g, e = tensors(got), tensors(expected)
    if len(g) != len(e):
        return "NO", float("nan"), f"{len(g)} outputs, eager has {len(e)}"
    ok, worst, inexact = True, 0.0, []
    for i, (a, b) in enumerate(zip(g, e)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return "NO", float("nan"), f"output {i}: {a.dtype}{list(a.shape)} vs eager {b.dtype}{list(b.shape)}"
        if a.numel() == 0:
            continue
        if not (a.is_floating_point() or a.is_complex()):
            ok &= bool(torch.equal(a, b))
            continue
        a32, b32 = a.float(), b.float()
        if not torch.allclose(a32, b32, rtol=rtol, atol=atol, equal_nan=True):
            inexact.append(i)
        worst = max(worst, float((a32 - b32).abs().nan_to_num(0.0).max()))
        del a32, b32
    if not ok:
        return "NO", worst, "integer/bool outputs differ from eager"
    if not inexact:
        return "yes", worst, ""
    why = f"output(s) {inexact} not allclose(rtol={rtol}, atol={atol}) to eager"
    try:
        r = tensors(ref64()) if ref64 is not None else []
    except Exception as exc:
        return "NO", worst, f"{why}; float64 reference failed: {type(exc).__name__}"
    if len(r) != len(e):
        return "NO", worst, why
    rms = lambda x, i: float((x.double() - r[i].double()).pow(2).mean().sqrt())  # noqa: E731
    errs = [(rms(g[i], i), rms(e[i], i)) for i in inexact]
    if all(ge <= 1.25 * ee + 1e-12 for ge, ee in errs):
        ge, ee = max(errs, key=lambda t: t[0] / max(t[1], 1e-30))
        return "yes*", worst, f"not allclose to eager, as accurate vs fp64 (rms err {ge:.2g}, eager {ee:.2g})"
    ge, ee = max(errs, key=lambda t: t[0] / max(t[1], 1e-30))
    return "NO", worst, f"{why}; vs fp64 rms err {ge:.2g}, eager {ee:.2g}"


def copy_ceiling_gbs(device: str, nbytes: int, warmup: int, rep: int, tries: int = 5) -> float:
    """Device-to-device copy bandwidth, GB/s, bytes counted = read + written; best of `tries` medians."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    best = min(bench_ms(lambda: dst.copy_(src), device, warmup, rep) for _ in range(tries))
    del src, dst
    if device == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes / best / 1e6


# ---------------------------------------------------------------- first call, cold caches, own process
def first_call_child(w, backend: str, device: str, dtype, quick: bool) -> dict:
    """Child side: compile + first run of `w` on `backend`, seconds (inputs made and imports done before)."""
    import fxopt  # noqa: F401  (imported before the clock starts, as a user's program would)
    fn, inputs = w.make(device, dtype, quick)
    sync(device)
    if device == "cuda":
        # Triton's one-time driver stub build (once per Triton install, not per model) stays off the clock
        try:
            triton.runtime.driver.active.get_current_device()
        except Exception:
            pass
    with grad_mode(w):
        t0 = time.perf_counter()
        out = runnable(w, backend, fn, fresh=True)(*inputs)
        sync(device)
        seconds = time.perf_counter() - t0
    del out
    return {"first_call_s": seconds}


def first_call(w, backend: str, device: str, dtype_name: str, quick: bool, timeout: float) -> dict:
    """Parent side: run the child in a fresh process with fresh, empty compiler caches."""
    tmp = tempfile.mkdtemp(prefix="fxopt-bench-cold-")
    env = dict(os.environ)
    env.update(TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"), TRITON_CACHE_DIR=os.path.join(tmp, "triton"),
               FXOPT_CACHE_DIR=os.path.join(tmp, "fxopt"),
               PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "benchmarks.run", "--first-call", w.name, backend,
           "--device", device, "--dtype", dtype_name] + (["--quick"] if quick else [])
    cmd += [a for k, v in FXOPT_OPTIONS.items() for a in ("--fxopt-option", f"{k}={v}")]
    cmd += ["--dynamic"] if DYNAMIC[0] else []
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"first call: child timed out after {timeout:.0f}s"}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(FIRST_CALL_MARK):
            return json.loads(line[len(FIRST_CALL_MARK):])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"first call: child exited {proc.returncode}: {tail}"}
