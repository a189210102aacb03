"""GPU probe: softmax over rows that fit in registers (8192 x 8192 bf16), one program per row (what
fxopt generates) against persistent programs striding over rows, with the next row's load issued
before this row is reduced and stored.

    PYTHONPATH=. python -m benchmarks.probe_softmax_rows
    TRITON_INTERPRET=1 PYTHONPATH=. python -m benchmarks.probe_softmax_rows --interpret-check
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from benchmarks.probe_softmax_l2 import measure_variants, softmax_problem

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _row_softmax(v, Y, cols, N: tl.constexpr):
    w = v.to(tl.float32) * LOG2E
    e = tl.exp2(w - tl.max(w, 0))
    tl.store(Y + cols, (e * (1.0 / tl.sum(e, 0))).to(Y.dtype.element_ty), cache_modifier=".cs")


@triton.jit
def _one_row_per_program(X, Y, N: tl.constexpr):
    cols = tl.arange(0, N)
    base = tl.program_id(0).to(tl.int64) * N
    _row_softmax(tl.load(X + base + cols), Y + base, cols, N)


@triton.jit
def _strided_rows(X, Y, M, N: tl.constexpr, PREFETCH: tl.constexpr):
    cols = tl.arange(0, N)
    r = tl.program_id(0)
    step = tl.num_programs(0)
    if PREFETCH:
        v = tl.load(X + r.to(tl.int64) * N + cols, mask=cols < tl.where(r < M, N, 0), other=0.0)
        while r < M:
            nxt = r + step
            v_next = tl.load(X + nxt.to(tl.int64) * N + cols, mask=cols < tl.where(nxt < M, N, 0), other=0.0)
            _row_softmax(v, Y + r.to(tl.int64) * N, cols, N)
            v = v_next
            r = nxt
    else:
        while r < M:
            base = r.to(tl.int64) * N
            _row_softmax(tl.load(X + base + cols), Y + base, cols, N)
            r += step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.probe_softmax_rows", description=__doc__.splitlines()[0])
    ap.add_argument("--interpret-check", action="store_true", help="numerics only, tiny shapes, on the CPU")
    args = ap.parse_args(argv)
    quick = args.interpret_check
    if not quick and not torch.cuda.is_available():
        print("probe_softmax_rows: no CUDA device")
        return 0
    m, n = (10, 256) if quick else (8192, 8192)
    sms = 4 if quick else torch.cuda.get_device_properties(0).multi_processor_count
    x, y, ref, nbytes, copy_gbs = softmax_problem(m, n, quick)
    if not quick:
        print(f"{torch.cuda.get_device_name(0)} ({sms} SMs), copy {copy_gbs:.0f} GB/s, x [{m}, {n}] bf16")
    runs = [(f"one row per program, {w} warps", lambda w=w: _one_row_per_program[(m,)](x, y, n, num_warps=w))
            for w in (4, 8, 16)]
    for per_sm in (2, 4, 8):
        for w in (4, 8, 16):
            for pf in (False, True):
                g = min(m, sms * per_sm)
                runs.append((f"strided, {per_sm} per SM, {w} warps, prefetch={int(pf)}",
                             lambda g=g, w=w, pf=pf: _strided_rows[(g,)](x, y, m, n, PREFETCH=pf, num_warps=w)))
    failed = measure_variants(runs, y, ref, nbytes, copy_gbs, quick, width=50)
    print(f"{failed} failed" if failed else "all ok")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
