"""GPU probe: softmax over rows of 131072 with the second read served from L2 instead of HBM.

A two-pass softmax reads each row twice. With one persistent program per SM only ~132 rows are in
flight (33 MB of bf16 at 256 KB a row, inside the H200's 50 MB L2), yet every two-read schedule
measured so far reached 53-56% of copy (benchmarks/probe_reductions.py): the second pass walks the row
from its start, the part read longest ago and the first evicted. Here pass 2 walks the row backwards
(the most recently read blocks first), optionally with eviction hints (pass 1 keeps, pass 2 and the
store stream), and optionally keeps the row's last TAIL elements in registers between the passes.

    PYTHONPATH=. python -m benchmarks.probe_softmax_l2
    TRITON_INTERPRET=1 PYTHONPATH=. python -m benchmarks.probe_softmax_l2 --interpret-check
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl
import triton.testing

from benchmarks import measure

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _stats(X, lo, hi, RBLOCK: tl.constexpr, EVICT: tl.constexpr, STAGES: tl.constexpr):
    """Pass 1 over X[lo:hi] (whole blocks): running max (log2 units) and per-lane sum of exp2."""
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([RBLOCK], tl.float32)
    for off in tl.range(lo, hi, RBLOCK, num_stages=STAGES):
        cols = off + tl.arange(0, RBLOCK)
        if EVICT:
            v = tl.load(X + cols, eviction_policy="evict_last").to(tl.float32) * LOG2E
        else:
            v = tl.load(X + cols).to(tl.float32) * LOG2E
        m_new = tl.maximum(m, tl.max(v, 0))
        s = s * tl.exp2(m - m_new) + tl.exp2(v - m_new)
        m = m_new
    return m, s


@triton.jit
def _stats_prefetch(X, lo, hi, RBLOCK: tl.constexpr):
    """Pass 1 as _stats (hints on), the next block's load issued before this block is reduced: two
    blocks in flight per program instead of one."""
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([RBLOCK], tl.float32)
    v = tl.load(X + lo + tl.arange(0, RBLOCK), eviction_policy="evict_last")
    for off in range(lo + RBLOCK, hi, RBLOCK):
        nxt = tl.load(X + off + tl.arange(0, RBLOCK), eviction_policy="evict_last")
        w = v.to(tl.float32) * LOG2E
        m_new = tl.maximum(m, tl.max(w, 0))
        s = s * tl.exp2(m - m_new) + tl.exp2(w - m_new)
        m = m_new
        v = nxt
    w = v.to(tl.float32) * LOG2E
    m_new = tl.maximum(m, tl.max(w, 0))
    s = s * tl.exp2(m - m_new) + tl.exp2(w - m_new)
    return m_new, s


@triton.jit
def _softmax_rows_prefetch(X, Y, M, N, RBLOCK: tl.constexpr):
    """Pass 1 and pass 2 (backwards, hints on) each with the next block's load issued first."""
    nblk = N // RBLOCK
    for r in range(tl.program_id(0), M, tl.num_programs(0)):
        base = r * N
        m, s = _stats_prefetch(X + base, 0, N, RBLOCK)
        inv = 1.0 / tl.sum(s, 0)
        cols = (nblk - 1) * RBLOCK + tl.arange(0, RBLOCK)
        v = tl.load(X + base + cols, eviction_policy="evict_first")
        for j in range(1, nblk):
            ncols = (nblk - 1 - j) * RBLOCK + tl.arange(0, RBLOCK)
            nxt = tl.load(X + base + ncols, eviction_policy="evict_first")
            tl.store(Y + base + cols, (tl.exp2(v.to(tl.float32) * LOG2E - m) * inv).to(Y.dtype.element_ty),
                     cache_modifier=".cs")
            v, cols = nxt, ncols
        tl.store(Y + base + cols, (tl.exp2(v.to(tl.float32) * LOG2E - m) * inv).to(Y.dtype.element_ty),
                 cache_modifier=".cs")


@triton.jit
def _softmax_rows(X, Y, M, N, RBLOCK: tl.constexpr, REVERSE: tl.constexpr, EVICT: tl.constexpr,
                  TAIL: tl.constexpr, STAGES: tl.constexpr):
    """Persistent programs striding over rows; N a multiple of RBLOCK, TAIL (0 or a multiple of
    RBLOCK, < N) elements at the row's end held in registers between the passes."""
    nblk = (N - TAIL) // RBLOCK
    for r in range(tl.program_id(0), M, tl.num_programs(0)):
        base = r * N  # < 2**31 at the probed sizes
        m, s = _stats(X + base, 0, N - TAIL, RBLOCK, EVICT, STAGES)
        if TAIL > 0:
            tcols = N - TAIL + tl.arange(0, TAIL)
            t = tl.load(X + base + tcols).to(tl.float32) * LOG2E
            m_new = tl.maximum(m, tl.max(t, 0))
            total = tl.sum(s, 0) * tl.exp2(m - m_new) + tl.sum(tl.exp2(t - m_new), 0)
            m = m_new
            inv = 1.0 / total
            if EVICT:
                tl.store(Y + base + tcols, (tl.exp2(t - m) * inv).to(Y.dtype.element_ty), cache_modifier=".cs")
            else:
                tl.store(Y + base + tcols, (tl.exp2(t - m) * inv).to(Y.dtype.element_ty))
        else:
            inv = 1.0 / tl.sum(s, 0)
        for j in tl.range(0, nblk, num_stages=STAGES):
            b = nblk - 1 - j if REVERSE else j
            cols = b * RBLOCK + tl.arange(0, RBLOCK)
            if EVICT:
                v = tl.load(X + base + cols, eviction_policy="evict_first").to(tl.float32)
                tl.store(Y + base + cols, (tl.exp2(v * LOG2E - m) * inv).to(Y.dtype.element_ty),
                         cache_modifier=".cs")
            else:
                v = tl.load(X + base + cols).to(tl.float32)
                tl.store(Y + base + cols, (tl.exp2(v * LOG2E - m) * inv).to(Y.dtype.element_ty))


def launch(x, y, programs, rblock, warps, reverse, evict, tail, stages=1):
    m, n = x.shape
    assert n % rblock == 0 and tail % rblock == 0 and tail < n
    g = min(m, programs)
    if stages == "prefetch":
        return lambda: _softmax_rows_prefetch[(g,)](x, y, m, n, RBLOCK=rblock, num_warps=warps)
    return lambda: _softmax_rows[(g,)](x, y, m, n, RBLOCK=rblock, REVERSE=reverse, EVICT=evict, TAIL=tail,
                                       STAGES=stages, num_warps=warps)


def softmax_problem(m: int, n: int, quick: bool):
    """x [m, n] bf16, an output buffer, the float64 softmax reference, the bytes a softmax moves, and the
    copy ceiling in GB/s (nan on the CPU)."""
    dev = "cpu" if quick else "cuda"
    torch.manual_seed(0)
    x = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    copy_gbs = float("nan") if quick else measure.copy_ceiling_gbs(dev, 2**30, 25, 100, tries=3)
    return x, torch.empty_like(x), torch.softmax(x.double(), -1), 2 * x.numel() * x.element_size(), copy_gbs


def measure_variants(runs, y, ref, nbytes: int, copy_gbs: float, quick: bool, width: int = 60) -> int:
    """Run each (label, launch) into y: its error against ref and, on the GPU, its median ms and % of
    copy; a variant that fails to compile or run is printed and counted. Returns the failures."""
    failed = 0
    for label, run in runs:
        try:
            y.zero_()
            run()
            err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
            failed += not err <= 1e-2
            if quick:
                print(f"{label:{width}s} err {err:.2e}")
                continue
            ms = triton.testing.do_bench(run, warmup=10, rep=50, return_mode="median")
            gbs = nbytes / ms / 1e6
            print(f"{label:{width}s} {ms:8.4f} ms {gbs:6.0f} GB/s {100 * gbs / copy_gbs:5.1f}%  err {err:.2e}", flush=True)
        except Exception as e:  # noqa: BLE001 - a failing variant is a result
            failed += 1
            print(f"{label:{width}s} ERROR {' '.join(str(e).split())[:90]}", flush=True)
    return failed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.probe_softmax_l2", description=__doc__.splitlines()[0])
    ap.add_argument("--interpret-check", action="store_true", help="numerics only, tiny shapes, on the CPU")
    ap.add_argument("--rows", type=int, default=512)
    args = ap.parse_args(argv)
    quick = args.interpret_check
    if not quick and not torch.cuda.is_available():
        print("probe_softmax_l2: no CUDA device")
        return 0
    sms = 4 if quick else torch.cuda.get_device_properties(0).multi_processor_count
    m, n, scale = (6, 2048, 64) if quick else (args.rows, 131072, 1)
    x, y, ref, nbytes, copy_gbs = softmax_problem(m, n, quick)
    if not quick:
        print(f"{torch.cuda.get_device_name(0)} ({sms} SMs), triton {triton.__version__}, "
              f"copy {copy_gbs:.0f} GB/s, x [{m}, {n}] bf16")
    configs = []  # (programs per SM, block, warps, reverse, hints, tail, stages)
    for k, rb, nw in ((1, 16384, 32), (1, 32768, 32), (2, 8192, 16), (2, 16384, 16)):
        for rev, ev in ((False, False), (True, True)):
            configs.append((k, rb, nw, rev, ev, 0, 1))
    for k, rb, nw, st in ((1, 16384, 32, 2), (1, 16384, 32, 3), (1, 8192, 16, 3), (1, 8192, 32, 4), (2, 8192, 16, 2)):
        configs.append((k, rb, nw, True, True, 0, st))
    configs.append((1, 16384, 32, True, True, 32768, 1))
    for k, rb, nw in ((1, 16384, 32), (1, 8192, 32), (1, 8192, 16), (2, 8192, 16), (2, 4096, 16), (1, 32768, 32)):
        configs.append((k, rb, nw, True, True, 0, "prefetch"))
    runs = [(f"G={k}xSM R{rb} w{nw} rev={int(rev)} evict={int(ev)} tail={tail} stages={st}",
             launch(x, y, sms * k, rb // scale, nw, rev, ev, tail // scale, st))
            for k, rb, nw, rev, ev, tail, st in configs]
    failed = measure_variants(runs, y, ref, nbytes, copy_gbs, quick)
    if not quick:
        ms = triton.testing.do_bench(lambda: torch.softmax(x, -1), return_mode="median")
        print(f"{'torch.softmax':60s} {ms:8.4f} ms {nbytes / ms / 1e6:6.0f} GB/s {100 * nbytes / ms / 1e6 / copy_gbs:5.1f}%")
    print(f"{failed} failed" if failed else "all ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
