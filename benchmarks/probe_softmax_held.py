"""Probe: softmax over rows too long for registers, the row's head kept in registers between the passes.

    PYTHONPATH=. python -m benchmarks.probe_softmax_held [--warmup 10 --rep 50]
    TRITON_INTERPRET=1 PYTHONPATH=. python -m benchmarks.probe_softmax_held --interpret-check

Why: fxopt's looped kernel reads a row of 131072 twice (pass 1 for max and sum, pass 2 to normalize), the
second read partly from L2 (~77% of copy on an H100). Here one program per SM strides over the rows and
keeps the row's first HELD elements in registers, so pass 2 re-reads only the rest and fewer bytes per row
wait in L2. (Reading the row once with co-resident programs per row: benchmarks/probe_coop_softmax.py.)
Result on an H100, benchmarks/results/2026-12-07-h100-f.md: 63% at best, slower than fxopt's 76.5%.
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl
import triton.testing

from benchmarks.probe_reductions import INTERPRET, LOG2E, Probe


@triton.jit
def _sm_held(X, Y, M, N, HELD: tl.constexpr, RBLOCK: tl.constexpr):
    """A6: one program per SM striding over rows; the row's first HELD elements stay in registers between
    the passes, so pass 2 re-reads only the rest (walking it backwards: the blocks read last come first)."""
    hcols = tl.arange(0, HELD)
    for r in range(tl.program_id(0), M, tl.num_programs(0)):
        base = tl.cast(r, tl.int64) * N
        hv = tl.load(X + base + hcols, mask=hcols < N, other=float("-inf")).to(tl.float32) * LOG2E
        m = tl.max(hv, 0)
        s = tl.zeros([RBLOCK], tl.float32)
        for off in range(HELD, N, RBLOCK):
            cols = off + tl.arange(0, RBLOCK)
            v = tl.load(X + base + cols, mask=cols < N, other=float("-inf"),
                        eviction_policy="evict_last").to(tl.float32) * LOG2E
            m_new = tl.maximum(m, tl.max(v, 0))
            # -inf - -inf: where-guards (a -inf counted as 1 here is scaled to 0 once a finite max comes)
            s = s * tl.where(m == m_new, 1.0, tl.exp2(m - m_new)) + tl.where(v == m_new, 1.0, tl.exp2(v - m_new))
            m = m_new
        inv = 1.0 / (tl.sum(s, 0) + tl.sum(tl.exp2(hv - m), 0))
        tl.store(Y + base + hcols, (tl.exp2(hv - m) * inv).to(Y.dtype.element_ty), mask=hcols < N)
        rest = N - HELD
        for step in range(0, rest, RBLOCK):
            cols = HELD + (rest - 1) // RBLOCK * RBLOCK - step + tl.arange(0, RBLOCK)
            mask = cols < N
            v = tl.load(X + base + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            tl.store(Y + base + cols, (tl.exp2(v * LOG2E - m) * inv).to(Y.dtype.element_ty), mask=mask,
                     cache_modifier=".cs")


def sm_held(x, y, held, rblock, nw, programs):
    return lambda: _sm_held[(min(programs, x.shape[0]),)](x, y, x.shape[0], x.shape[1], HELD=held, RBLOCK=rblock,
                                                          num_warps=nw)


def probe(p: Probe, dev, sms, quick):
    m, n = (10, 4000) if quick else (512, 131072)
    torch.manual_seed(0)
    x = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    x[1, : n // 2] = float("-inf")  # a whole chunk of -inf: its partial sum is 0, not NaN
    y = torch.empty_like(x)
    ref = torch.softmax(x.double(), -1)
    nbytes = 2 * x.numel() * x.element_size()

    def row(name, cfg, make, out=y):
        y.zero_()
        p.row("softmax_long", name, cfg, make, out, ref, nbytes)
    row("eager", "torch.softmax", lambda: (lambda: torch.softmax(x, -1)), out=None)
    if quick:
        row("A6 held", "H1024 R256 w4", lambda: sm_held(x, y, 1024, 256, 4, 3))
        return
    for h, rb, nw in ((16384, 8192, 16), (32768, 4096, 16), (32768, 8192, 16), (65536, 4096, 16),
                      (32768, 8192, 32), (65536, 8192, 32)):
        row("A6 held", f"H{h} R{rb} w{nw}", lambda: sm_held(x, y, h, rb, nw, sms))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.probe_softmax_held", description=__doc__.splitlines()[0])
    ap.add_argument("--warmup", type=int, default=10, help="do_bench warmup, ms")
    ap.add_argument("--rep", type=int, default=50, help="do_bench repetitions, ms")
    ap.add_argument("--interpret-check", action="store_true", help="numerics only, tiny CPU shapes")
    args = ap.parse_args(argv)
    if args.interpret_check:
        if not INTERPRET:
            print("--interpret-check needs TRITON_INTERPRET=1 set before triton is imported")
            return 2
        dev, sms, copy_gbs = "cpu", 4, float("nan")
    elif not torch.cuda.is_available():
        print("probe_softmax_held: no CUDA device")
        return 0
    else:
        dev, sms = "cuda", torch.cuda.get_device_properties(0).multi_processor_count
        src = torch.empty(2**30, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=args.warmup, rep=args.rep, return_mode="median")
        copy_gbs = 2 * src.numel() / ms / 1e6
        print(f"device {torch.cuda.get_device_name(0)} ({sms} SMs), copy ceiling {copy_gbs:.0f} GB/s")
    p = Probe(args, copy_gbs)
    probe(p, dev, sms, args.interpret_check)
    print(f"{p.failed} variant(s) failed" if p.failed else "all variants ok")
    return 1 if p.failed else 0


if __name__ == "__main__":
    sys.exit(main())
