"""Sweep launch configs of fxopt's attention kernels on the GPU, calling them directly (no torch.compile).

    PYTHONPATH=. python -m benchmarks.tune_attention [--which fwd,bwd,decode] [--cases hd128] [--full]
    TRITON_INTERPRET=1 PYTHONPATH=. python -m benchmarks.tune_attention --quick   # CPU smoke test (fp16)

For every case (shape) it times PyTorch's F.scaled_dot_product_attention, the kernel's own default
config, then each candidate config, in this process with triton.testing.do_bench (median, L2 flushed).
Every result is checked against SDPA (relative RMS error); configs that do not compile, run out of
shared memory or come out wrong print one line and are skipped. The last table gives the best config
per case: what forward_config / backward_config / the decode defaults should pick.

FLOPs count as in benchmarks/workloads_attention.py: forward 4*B*H*Tq*Tk*D (halved when causal),
backward 2.5x that (the backward is timed alone, given out and lse). Decode is memory-bound: GB/s of
q + K + V + out, and % of a device-to-device copy measured here.

Candidates (grids in benchmarks/attention_configs.py): forward BLOCK_M {64,128} x BLOCK_N {32,64,128} x num_warps {4,8} x
num_stages {2,3,4}. Backward: flash_backward has two tiled kernels, dK/dV (keeps a block of keys,
streams queries) and dQ (the mirror image), sized by DKDV_BLOCK_M/N and DQ_BLOCK_M/N with shared
num_warps and num_stages; a candidate is a (resident, streamed) pair, resident {64,128} x streamed
{16,32,64}, used mirrored by both kernels, x num_warps {4,8} x num_stages {1,2,3}. Decode: BLOCK_N
{32,64,128,256} x num_splits {auto,16,32,64,128} x num_warps {4,8} x num_stages {2,3}.
Configs that cannot fit shared memory are always dropped; by default so are ones that are slow for a
known reason (forward_slow, backward_slow, empty decode splits), which should keep the whole sweep
to about three minutes on an H200 (88 forward compiles, 15 backward, 16 decode). --full keeps them.

The fxopt kernels are imported when a sweep starts, so --help works before they exist.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import math
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .attention_configs import backward_candidates, decode_candidates, forward_candidates, label
from .measure import DTYPES, bench_ms, copy_ceiling_gbs

CASE_W, CONFIG_W = 35, 36  # column widths of the printed tables
MAX_ERROR = 2e-2  # relative RMS error vs SDPA above which a config counts as wrong (bf16 rounding: ~3e-3)
BACKWARD_FLOPS_PER_FORWARD = 2.5  # as benchmarks/workloads_attention.py and FlashAttention count it
QUICK_FORWARD = [dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2),
                 dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)]
QUICK_BACKWARD = [dict(DKDV_BLOCK_M=16, DKDV_BLOCK_N=32, DQ_BLOCK_M=32, DQ_BLOCK_N=16, num_warps=4, num_stages=1),
                  dict(DKDV_BLOCK_M=32, DKDV_BLOCK_N=64, DQ_BLOCK_M=64, DQ_BLOCK_N=32, num_warps=4, num_stages=1)]
QUICK_DECODE = [dict(BLOCK_N=32, num_splits=None, num_warps=4, num_stages=2),
                dict(BLOCK_N=64, num_splits=4, num_warps=4, num_stages=2)]


@dataclass
class Case:
    """One shape to tune. kind: "fwd", "bwd" or "decode"."""
    kind: str
    B: int
    H: int
    Tq: int
    Tk: int
    D: int
    causal: bool
    name: str = ""
    results: list = field(default_factory=list)  # (label, ms) of configs that ran and were right
    sdpa_ms: float | None = None

    def __post_init__(self):
        mask = "causal" if self.causal else "full"
        q_len = f"Tq{self.Tq} Tk{self.Tk}" if self.Tq != self.Tk else f"T{self.Tk}"
        self.name = self.name or f"{self.kind} {mask} hd{self.D} B{self.B} H{self.H} {q_len}"


def cases(quick: bool) -> list[Case]:
    """The shapes from the attention issue (bf16), or tiny ones for the interpreter."""
    if quick:
        return [Case("fwd", 1, 2, 64, 64, 32, True), Case("fwd", 1, 2, 64, 64, 64, False),
                Case("bwd", 1, 2, 64, 64, 32, True), Case("decode", 1, 2, 1, 256, 32, False)]
    forward = [Case("fwd", 8, 16, 2048, 2048, d, causal) for causal in (True, False) for d in (64, 128, 256)]
    return forward + [Case("fwd", 4, 16, 4096, 4096, 128, False), Case("bwd", 8, 16, 2048, 2048, 128, True),
                      Case("bwd", 8, 16, 2048, 2048, 64, True), Case("bwd", 8, 16, 2048, 2048, 128, False),
                      Case("decode", 8, 32, 1, 8192, 128, False)]


# ---------------------------------------------------------------- the kernels under test (imported late)

def kernel(package: str, module: str, name: str):
    """fxopt's kernel function, imported only when a sweep needs it (the module may not exist yet)."""
    return getattr(importlib.import_module(f"{package}.{module}"), name)


def default_config(package: str, module: str, name: str, **known) -> dict | None:
    """What the module's config function (forward_config, backward_config) picks for this shape,
    called with whichever of `known` its signature names; None when it is missing or wants more."""
    try:
        fn = kernel(package, module, name)
        params = inspect.signature(fn).parameters
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    args = {k: v for k, v in known.items() if takes_all or k in params}
    if any(p.default is p.empty and p.kind is not p.VAR_KEYWORD and k not in args for k, p in params.items()):
        return None
    return dict(fn(**args))


def forced(default: dict | None, args) -> dict | None:
    """The kernel's default config with --set's keys laid over it (candidates inherit them)."""
    return {**default, **args.forced} if default is not None and args.forced else default


def with_defaults(candidates: list[dict], default: dict | None) -> list[dict]:
    """Candidates laid over the kernel's default config. Keys the default does not have (the kernel
    names its tiles differently) are dropped, with a note, and duplicates removed."""
    if not default:
        return candidates
    unknown = sorted({k for c in candidates for k in c} - set(default))
    if unknown:
        print(f"# note: the default config has no {unknown}; candidates leave them out", flush=True)
    merged = []
    for c in candidates:
        cfg = {**default, **{k: v for k, v in c.items() if k in default}}
        if cfg not in merged:
            merged.append(cfg)
    return merged


# ---------------------------------------------------------------- timing, checking, printing

def relative_error(got, want) -> float:
    """Largest relative RMS error over matching tensors: ||got - want|| / ||want||."""
    errs = [float((g.double() - w.double()).norm() / w.double().norm().clamp_min(1e-30)) for g, w in zip(got, want)]
    return max(errs)


def one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:160]


def print_row(case: Case, name: str, ms=None, rate=None, unit="TFLOP/s", vs=None, err=None, note=""):
    cells = [f"{case.name:{CASE_W}s}", f"{name:{CONFIG_W}s}", f"{ms:9.4f}" if ms is not None else f"{'-':>9s}",
             f"{rate:8.1f} {unit:7s}" if rate is not None else f"{'-':>8s} {unit:7s}",
             f"{vs:6.2f}x" if vs is not None else f"{'-':>7s}", f"{err:8.1e}" if err is not None else f"{'-':>8s}",
             note]
    print("  ".join(cells).rstrip(), flush=True)


class BrokenContext(RuntimeError):
    """A config corrupted the CUDA context: every later launch would fail, so the sweep stops."""


BROKEN_CONTEXT = ("illegal", "misaligned address", "unspecified launch failure", "CUDA error")


def try_config(case: Case, name: str, run, reference, rate_of, unit, device, args, note_of=lambda ms: ""):
    """Run one config: check it against the reference, time it, print its row, record it if right."""
    try:
        got = run()
        err = relative_error(got, reference)
        if not err <= MAX_ERROR:
            print_row(case, name, err=err, unit=unit, note=f"WRONG: relative error {err:.2g} > {MAX_ERROR}")
            return
        ms = bench_ms(run, device, args.warmup, args.rep)
    except Exception as e:  # does not compile, out of shared memory, rejected config: one line, next
        print_row(case, name, unit=unit, note=f"failed: {one_line(e)}")
        if device == "cuda" and any(marker in str(e) for marker in BROKEN_CONTEXT):
            raise BrokenContext(f"{case.name} {name}: {one_line(e)}") from e
        return
    case.results.append((name, ms))
    print_row(case, name, ms, rate_of(ms), unit, case.sdpa_ms / ms if case.sdpa_ms else None, err, note_of(ms))


def time_sdpa(case: Case, call, rate_of, unit, device, args, note_of=lambda ms: ""):
    """SDPA's time for the case (case.sdpa_ms), printed as the row everything else is compared with."""
    try:
        case.sdpa_ms = bench_ms(call, device, args.warmup, args.rep)
    except Exception as e:
        print_row(case, "sdpa", unit=unit, note=f"failed: {one_line(e)}")
        return
    print_row(case, "sdpa", case.sdpa_ms, rate_of(case.sdpa_ms), unit, 1.0, note=note_of(case.sdpa_ms))


# ---------------------------------------------------------------- the three sweeps

def inputs(case: Case, device: str, dtype, requires_grad=False):
    torch.manual_seed(0)
    q = torch.randn(case.B, case.H, case.Tq, case.D, device=device, dtype=dtype)
    k, v = (torch.randn(case.B, case.H, case.Tk, case.D, device=device, dtype=dtype) for _ in range(2))
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def forward_flops(case: Case) -> int:
    flops = 4 * case.B * case.H * case.Tq * case.Tk * case.D
    return flops // 2 if case.causal else flops


def tflops_rate(flops: float):
    return lambda ms: flops / ms / 1e9


def known_shape(case: Case, device: str, dtype) -> dict:
    """Everything a config function might ask about the shape, by the names it is likely to use."""
    return dict(head_dim=case.D, causal=case.causal, dtype=dtype, seq_q=case.Tq, seq_k=case.Tk,
                device_type=device, batch=case.B, heads=case.H, kv_heads=case.H)


def sweep_forward(case: Case, device: str, dtype, args):
    flash_forward = kernel(args.package, "flash_forward", "flash_forward")
    q, k, v = inputs(case, device, dtype)
    scale = 1.0 / math.sqrt(case.D)
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, scale=scale)  # noqa: E731
    reference = [sdpa()]
    rate = tflops_rate(forward_flops(case))
    time_sdpa(case, sdpa, rate, "TFLOP/s", device, args)
    default = forced(default_config(args.package, "flash_forward", "forward_config", **known_shape(case, device, dtype)),
                     args)
    candidates = QUICK_FORWARD if args.quick else forward_candidates(case.D, args.full)
    for cfg in [default if args.forced else None] + with_defaults(candidates, default):
        run = lambda cfg=cfg: flash_forward(q, k, v, scale=scale, causal=case.causal, config=cfg)[:1]  # noqa: E731
        name = f"default ({label(default)})" if cfg is None and default else label(cfg)
        try_config(case, name, run, reference, rate, "TFLOP/s", device, args)


def sweep_backward(case: Case, device: str, dtype, args):
    flash_forward = kernel(args.package, "flash_forward", "flash_forward")
    flash_backward = kernel(args.package, "flash_backward", "flash_backward")
    q, k, v = inputs(case, device, dtype, requires_grad=True)
    dout = torch.randn_like(q)
    scale = 1.0 / math.sqrt(case.D)
    sdpa_out = F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, scale=scale)
    sdpa_bwd = lambda: torch.autograd.grad(sdpa_out, (q, k, v), dout, retain_graph=True)  # noqa: E731
    reference = sdpa_bwd()
    rate = tflops_rate(BACKWARD_FLOPS_PER_FORWARD * forward_flops(case))
    time_sdpa(case, sdpa_bwd, rate, "TFLOP/s", device, args)
    q, k, v = (t.detach() for t in (q, k, v))
    out, lse = flash_forward(q, k, v, scale=scale, causal=case.causal)
    default = forced(default_config(args.package, "flash_backward", "backward_config", **known_shape(case, device, dtype)),
                     args)
    candidates = QUICK_BACKWARD if args.quick else backward_candidates(case.D, args.full)
    for cfg in [default if args.forced else None] + with_defaults(candidates, default):
        run = lambda cfg=cfg: flash_backward(dout, q, k, v, out, lse, scale=scale, causal=case.causal,  # noqa: E731
                                             config=cfg)
        name = f"default ({label(default)})" if cfg is None and default else label(cfg)
        try_config(case, name, run, reference, rate, "TFLOP/s", device, args)


def sweep_decode(case: Case, device: str, dtype, args):
    flash_decode = kernel(args.package, "flash_decode", "flash_decode")
    q, k, v = inputs(case, device, dtype)
    scale = 1.0 / math.sqrt(case.D)
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, scale=scale)  # noqa: E731
    reference = [sdpa()]
    nbytes = sum(t.numel() * t.element_size() for t in (q, k, v, reference[0]))
    ceiling = copy_ceiling_gbs(device, 2**30, args.warmup, args.rep) if device == "cuda" else None
    if ceiling:
        print(f"# copy ceiling {ceiling:.0f} GB/s (1 GiB read + written); %copy in the notes", flush=True)
    rate = lambda ms: nbytes / ms / 1e6  # noqa: E731
    pct_copy = (lambda ms: f"{100 * rate(ms) / ceiling:.1f}% copy") if ceiling else (lambda ms: "")
    time_sdpa(case, sdpa, rate, "GB/s", device, args, pct_copy)
    candidates = QUICK_DECODE if args.quick else decode_candidates(case.Tk, args.full)
    for cand in [None] + candidates:
        cfg = None if cand is None else {key: val for key, val in cand.items() if key != "num_splits"}
        splits = None if cand is None else cand["num_splits"]
        run = lambda cfg=cfg, splits=splits: flash_decode(q, k, v, scale=scale, causal=False,  # noqa: E731
                                                          num_splits=splits, config=cfg)[:1]
        try_config(case, label(cand), run, reference, rate, "GB/s", device, args, pct_copy)


SWEEPS = {"fwd": sweep_forward, "bwd": sweep_backward, "decode": sweep_decode}


# ---------------------------------------------------------------- main

def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.tune_attention", description=__doc__.splitlines()[0])
    p.add_argument("--which", default="fwd,bwd,decode", help="comma-separated: fwd,bwd,decode (default all)")
    p.add_argument("--cases", default="", help="only cases whose name contains this, e.g. 'hd128' or 'causal'")
    p.add_argument("--quick", action="store_true", help="tiny shapes and two configs each: a smoke test "
                   "(on CPU with TRITON_INTERPRET=1)")
    p.add_argument("--full", action="store_true", help="also time the configs pruned as likely slow")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="default bf16 on cuda, fp16 on cpu (the interpreter computes tl.dot on bf16 wrongly)")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms (default 25)")
    p.add_argument("--rep", type=int, default=100, help="do_bench rep, ms (default 100)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="force a config key in the default and every candidate, e.g. TMA=False (repeatable)")
    p.add_argument("--package", default="fxopt.attention",
                   help="package holding flash_forward.py, flash_backward.py, flash_decode.py "
                        "(default fxopt.attention; another for a copy under test)")
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp16")
    args.which = [w.strip() for w in args.which.split(",") if w.strip()]
    args.forced = {}
    for item in args.set:
        key, _, value = item.partition("=")
        args.forced[key] = {"True": True, "False": False}.get(value) if value in ("True", "False") else int(value)
    for w in args.which:
        if w not in SWEEPS:
            p.error(f"unknown --which {w!r}; known: {', '.join(SWEEPS)}")
    return args


def print_best(done: list[Case]):
    """Per case: SDPA-relative time of the kernel's default and of the fastest config."""
    print("\n# best config per case (vs = sdpa ms / ms; default = the kernel's own choice)")
    print(f"{'case':{CASE_W}s}  {'default_ms':>10s}  {'best config':{CONFIG_W}s}  {'best_ms':>9s}  {'vs_sdpa':>7s}  "
          f"{'vs_default':>10s}")
    for case in done:
        if not case.results:
            print(f"{case.name:{CASE_W}s}  {'-':>10s}  (no config ran)")
            continue
        default_ms = next((ms for name, ms in case.results if name.startswith("default")), None)
        best_name, best_ms = min(case.results, key=lambda r: r[1])
        sdpa_ms = case.sdpa_ms
        print(f"{case.name:{CASE_W}s}  {default_ms if default_ms else float('nan'):10.4f}  {best_name:{CONFIG_W}s}  "
              f"{best_ms:9.4f}  {(f'{sdpa_ms / best_ms:.2f}x' if sdpa_ms else '-'):>7s}  "
              f"{(f'{default_ms / best_ms:.2f}x' if default_ms else '-'):>10s}")


def main(argv=None) -> int:
    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"# tune_attention  {device_name}  torch {torch.__version__}  {args.dtype}"
          f"{'  quick' if args.quick else ''}{'  full grid' if args.full else ''}", flush=True)
    print(f"# {'case':{CASE_W - 2}s}  {'config':{CONFIG_W}s}  {'ms':>9s}  {'rate':16s}  {'vs_sdpa':>7s}  "
          f"{'rel_err':>8s}  note", flush=True)
    done, start = [], time.perf_counter()
    for case in cases(args.quick):
        if case.kind not in args.which or args.cases not in case.name:
            continue
        section = time.perf_counter()
        try:
            SWEEPS[case.kind](case, args.device, dtype, args)
        except BrokenContext as e:
            print(f"# stopping: a config broke the CUDA context ({e}); rerun the rest with --cases", flush=True)
            done.append(case)
            break
        except Exception as e:  # the kernel module is missing or the case cannot be set up
            print_row(case, "(whole case)", note=f"failed: {one_line(e)}")
        done.append(case)
        print(f"# {case.name}: {time.perf_counter() - section:.0f} s", flush=True)
    print_best(done)
    print(f"# total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
