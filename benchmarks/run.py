"""Benchmark runner: eager vs inductor vs fxopt (vs SDPA) on the registered workloads; one plain-text table.

    PYTHONPATH=. python -m benchmarks.run [--workloads a,b] [--quick] [--device cuda|cpu]
                                          [--backends eager,inductor,fxopt,sdpa] [--json out.json]

See benchmarks/README.md for what each column means.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import traceback

import torch

from . import measure, workloads

COLUMNS = [  # (key, title, format)
    ("workload", "workload", "{}"), ("backend", "backend", "{}"), ("ok", "ok", "{}"),
    ("max_abs_diff", "max|diff|", "{:.3g}"), ("median_ms", "median_ms", "{:.4f}"), ("ms_range", "range", "{}"),
    ("vs", "vs", "{}"),
    ("first_call_s", "first_call_s", "{:.2f}"), ("peak_mib", "peak_MiB", "{:.1f}"), ("plan_ratio", "plan/LB", "{:.3f}"),
    ("gbs", "GB/s", "{:.0f}"), ("pct_copy", "%copy", "{:.1f}"), ("tflops", "TFLOP/s", "{:.1f}"),
    ("note", "note", "{}"),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="all", help=f"comma-separated, default all: {','.join(workloads.WORKLOADS)}")
    p.add_argument("--backends", default=",".join(measure.BACKENDS),
                   help="comma-separated: eager,inductor,fxopt,sdpa (sdpa: the workload's SDPA anchor, run "
                        "eagerly; skipped for workloads without one). Default: all")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--dtype", default="bf16", choices=sorted(measure.DTYPES))
    p.add_argument("--quick", action="store_true", help="tiny sizes (256x256): a smoke test, e.g. on CPU")
    p.add_argument("--json", metavar="PATH", help="also write header and rows as JSON here")
    p.add_argument("--warmup", type=float, default=25, help="do_bench warmup, ms (default 25)")
    p.add_argument("--rep", type=float, default=100, help="do_bench rep, ms (default 100)")
    p.add_argument("--copy-bytes", type=int, default=None, help="copy-ceiling buffer size (default 2**30; quick 2**24)")
    p.add_argument("--no-first-call", action="store_true", help="skip the cold first-call subprocesses")
    p.add_argument("--first-call-timeout", type=float, default=1200, help="seconds per first-call child")
    p.add_argument("--fxopt-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an fxopt.backend option for the fxopt rows, e.g. memory_plan=apply (repeatable)")
    p.add_argument("--dynamic", action="store_true",
                   help="compile inductor and fxopt with dynamic=True (symbolic sizes), to compare with static")
    p.add_argument("--rounds", type=int, default=1,
                   help="time each backend this many times, alternating backends (ABAB...), and report the "
                        "median with the range (for host-bound workloads on a host whose speed drifts)")
    p.add_argument("--first-call", nargs=2, metavar=("WORKLOAD", "BACKEND"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch.cuda.is_available() is False")
    try:
        measure.FXOPT_OPTIONS.update(measure.parse_fxopt_option(o) for o in args.fxopt_option)
    except ValueError as e:
        p.error(str(e))
    measure.DYNAMIC[0] = True if args.dynamic else None
    args.backend_list = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in args.backend_list:
        if b not in measure.BACKENDS + measure.OPTIONAL_BACKENDS:
            p.error(f"unknown backend {b!r}; known: {', '.join(measure.BACKENDS + measure.OPTIONAL_BACKENDS)}")
    return args


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def short_error(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def run_backend(w, backend, fn, inputs, expected, ref64, args, copy_gbs, min_bytes, flops):
    """(row, the timed call or None when it failed)."""
    row = {"workload": w.name, "backend": backend}
    call = None
    rtol, atol = measure.TOLERANCES[measure.DTYPES[args.dtype]]
    rtol, atol = w.rtol if w.rtol is not None else rtol, w.atol if w.atol is not None else atol
    stage = "compile"
    try:
        compiled = measure.runnable(w, backend, fn)
        call = lambda: compiled(*inputs)  # noqa: E731
        with measure.grad_mode(w):
            out = call()  # compiles (warm caches: the cold first call is measured in a child process)
            measure.sync(args.device)
            stage = "check"
            ok, diff, why = measure.compare(out, expected, rtol, atol, ref64)
            del out
            row.update(ok=ok, max_abs_diff=diff)
            if why:
                row["note"] = why
            if backend.startswith("fxopt"):
                row["plan_ratio"] = measure.plan_ratio()
            stage = "time"
            ms = measure.bench_ms(call, args.device, args.warmup, args.rep)
            stage = "memory"
            row["peak_mib"] = measure.peak_mib(call, args.device)
        set_time(row, [ms], min_bytes, flops, copy_gbs)
    except Exception as e:  # a failing backend is a row, not a crash
        traceback.print_exc(file=sys.stderr)
        row.setdefault("ok", "ERR")
        row["note"] = f"{stage} failed: {short_error(e)}"
        call = None
    return row, call


def set_time(row, times: list[float], min_bytes, flops, copy_gbs):
    """The row's median time over its rounds, its range, and the rates derived from the median."""
    ms = statistics.median(times)
    row.update(median_ms=ms, gbs=min_bytes / ms / 1e6, rounds=times)
    row["ms_range"] = f"{min(times):.3f}-{max(times):.3f}" if len(times) > 1 else None
    row["pct_copy"] = 100 * row["gbs"] / copy_gbs if copy_gbs else None
    row["tflops"] = flops / ms / 1e9 if flops else None


def more_rounds(w, rows, calls, args, copy_gbs, min_bytes, flops):
    """Rounds 2..N: every backend timed again, in turn, the starting backend rotating, so a drift of
    the host's speed during the run reaches every backend alike (the first round is run_backend's)."""
    names = [r["backend"] for r in rows if calls.get(r["backend"])]
    times = {r["backend"]: list(r["rounds"]) for r in rows if r["backend"] in names}
    for k in range(1, args.rounds):
        order = names[k % len(names):] + names[:k % len(names)]
        for b in order:
            with measure.grad_mode(w):
                times[b].append(measure.bench_ms(calls[b], args.device, args.warmup, args.rep))
    for r in rows:
        if r["backend"] in times:
            set_time(r, times[r["backend"]], min_bytes, flops, copy_gbs)


def run_workload(w, args, copy_gbs) -> list[dict]:
    dtype = measure.DTYPES[args.dtype]
    backends = measure.backends_for(w, args.backend_list)
    log(f"== {w.name}: {w.description}")
    firsts = {}
    if not args.no_first_call:  # before this process allocates the workload's inputs
        for b in backends:
            log(f"   first call (cold caches, fresh process): {b}")
            firsts[b] = measure.first_call(w, b, args.device, args.dtype, args.quick, args.first_call_timeout)
    try:
        torch.manual_seed(0)
        fn, inputs = w.make(args.device, dtype, args.quick)
        with measure.grad_mode(w):
            expected = measure.compile_for("eager", fn, w)(*inputs)  # under autocast for a mixed workload
        measure.sync(args.device)
        min_bytes = w.min_bytes(inputs, expected)
        flops = w.flops(inputs) if w.flops else None
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        return [{"workload": w.name, "backend": b, "ok": "ERR", "note": f"setup failed: {short_error(e)}"}
                for b in backends]
    cached = []

    def ref64():  # float64 run of eager, computed once and only if a check needs it
        if not cached:
            with measure.grad_mode(w):
                cached.append(fn(*measure.as_float64(inputs)))
        return cached[0]

    rows, calls = [], {}
    for b in backends:
        log(f"   {b}")
        row, calls[b] = run_backend(w, b, fn, inputs, expected, ref64, args, copy_gbs, min_bytes, flops)
        first = firsts.get(b, {})
        row["first_call_s"] = first.get("first_call_s")
        if "error" in first:
            row["note"] = "; ".join(filter(None, [row.get("note"), first["error"]]))
        row.update(min_bytes=min_bytes, flops=flops, dtype=args.dtype, device=args.device, quick=args.quick)
        rows.append(row)
        gc.collect()
    if args.rounds > 1:
        log(f"   {args.rounds - 1} more rounds, backends alternating")
        more_rounds(w, rows, calls, args, copy_gbs, min_bytes, flops)
    add_speed_ratios(rows)
    del fn, inputs, expected, cached, calls
    torch._dynamo.reset()
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return rows


def add_speed_ratios(rows):
    """Give each row of one workload `vs` = baseline median_ms / its own (>1: faster than the baseline).

    The baseline is the SDPA anchor row where the workload has one (it ran), else the inductor row, else
    (static vs dynamic, `--backends fxopt,fxopt_dynamic`) the fxopt row; it is marked "base". No
    baseline row or no baseline time: no ratios."""
    by_backend = {r["backend"]: r for r in rows}
    candidates = ("sdpa", "inductor", "fxopt") if "fxopt_dynamic" in by_backend else ("sdpa", "inductor")
    base_name = next((b for b in candidates if b in by_backend), None)
    base_ms = by_backend[base_name].get("median_ms") if base_name else None
    if not base_ms:
        return
    for r in rows:
        r["vs_baseline"] = base_name
        if r is by_backend[base_name]:
            r["vs"] = "base"
        elif r.get("median_ms"):
            r["vs"] = f"{base_ms / r['median_ms']:.2f}x"


def cell(row, key, fmt):
    v = row.get(key)
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    text = fmt.format(v)
    return text if len(text) <= 110 else text[:107] + "..."  # whole notes are in the --json file


def format_table(rows) -> str:
    cells = [[title for _, title, _ in COLUMNS]] + [[cell(r, k, f) for k, _, f in COLUMNS] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    numeric = {"max_abs_diff", "median_ms", "vs", "first_call_s", "peak_mib", "plan_ratio", "gbs", "pct_copy", "tflops"}
    lines = []
    for c in cells:
        parts = [v.rjust(wd) if k in numeric else v.ljust(wd) for (k, _, _), v, wd in zip(COLUMNS, c, widths)]
        lines.append("  ".join(parts).rstrip())
    lines.insert(1, "  ".join("-" * wd for wd in widths))
    return "\n".join(lines)


def child_main(args) -> int:
    """`--first-call WORKLOAD BACKEND`: one cold compile + first call; prints one JSON line."""
    name, backend = args.first_call
    try:
        w = workloads.get(name)[0]
        result = measure.first_call_child(w, backend, args.device, measure.DTYPES[args.dtype], args.quick)
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        result = {"error": f"first call failed: {short_error(e)}"}
    print(measure.FIRST_CALL_MARK + json.dumps(result), flush=True)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.first_call:
        return child_main(args)
    import fxopt  # noqa: F401
    selected = workloads.get(args.workloads)
    head = measure.header(args.device)
    nbytes = args.copy_bytes or (2**24 if args.quick else 2**30)
    log(f"copy ceiling: {nbytes} bytes {args.device}-to-{args.device}")
    try:
        copy_gbs = measure.copy_ceiling_gbs(args.device, nbytes, args.warmup, args.rep)
    except Exception as e:
        log(f"copy ceiling failed: {short_error(e)}")
        copy_gbs = None
    head["copy_ceiling_gbs"], head["copy_bytes"] = copy_gbs, nbytes
    rows = [row for w in selected for row in run_workload(w, args, copy_gbs)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": head, "rows": rows}, f, indent=2)
            f.write("\n")
    print(f"# {head['date']}  commit {head['commit']}  {head['device']}  torch {head['torch']}  "
          f"triton {head['triton']}  python {head['python']}"
          + ("  TRITON_INTERPRET=1" if head["triton_interpret"] == "1" else ""))
    print(f"# {head['command']}")
    ceiling = f"{copy_gbs:.0f} GB/s" if copy_gbs else "unavailable"
    print(f"# dtype {args.dtype}{'  quick sizes' if args.quick else ''}  copy ceiling {ceiling} "
          f"({nbytes / 2**20:.0f} MiB read + written)")
    print("# vs: baseline median_ms / this row's (>1x: faster); baseline (base) = the sdpa anchor where the "
          "workload has one, else inductor")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
