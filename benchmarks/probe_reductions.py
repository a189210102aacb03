"""GPU probe: what limits fxopt's generated reduction kernels? Hand-written Triton variants, timed.

On an H200 fxopt's softmax over long rows (x [512, 131072] bf16) reaches only ~43% of the copy
bandwidth and residual+LayerNorm+GELU ([16384, 4096] bf16) ~69%. Each variant below changes one
thing in the kernel fxopt generates today (A0, B0) so that the rows say which change moves the time:
the exp count and guards, the divide, the per-row parallelism (512 rows: one program each), whether
the second read of a row hits L2 (persistent programs), erf, the dependent second reduction, eviction
hints, rows per program.

    PYTHONPATH=. python -m benchmarks.probe_reductions [--only softmax_long,ln_gelu] [--warmup 10 --rep 50]
    TRITON_INTERPRET=1 PYTHONPATH=. python -m benchmarks.probe_reductions --interpret-check

One row per variant and config: median ms, GB/s of the ideal traffic (each input read once, each
output written once), % of the copy ceiling (dst.copy_(src) of 1 GiB, read + write), and max |out -
ref| / max |ref| against a float64 eager reference. A variant that fails prints its error as its row.
--interpret-check runs every variant once on tiny shapes on the CPU (numerics only, no timing).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

LOG2E = tl.constexpr(1.4426950408889634)
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---------------------------------------------------------------- workload A: softmax over long rows
@triton.jit
def _sm_rows(X, Y, N, RBLOCK: tl.constexpr, FAST: tl.constexpr):
    """A0 (FAST=False): fxopt's online softmax today: per-lane running max and sum, both exps
    guarded with where (exact for -inf), exp, and a divide in pass 2.
    A1 (FAST=True): the same in log2 units with exp2 (log2(e) folded into x) and a multiply by 1/sum."""
    row = tl.program_id(0).to(tl.int64) * N
    acc_m = tl.full([RBLOCK], float("-inf"), tl.float32)
    acc_s = tl.zeros([RBLOCK], tl.float32)
    for off in range(0, N, RBLOCK):
        cols = off + tl.arange(0, RBLOCK)
        mask = cols < N
        v = tl.load(X + row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if FAST:
            v = v * LOG2E
        m_new = tl.maximum(acc_m, v, propagate_nan=tl.PropagateNan.ALL)
        if FAST:
            acc_s = acc_s * tl.where(acc_m == m_new, 1.0, tl.exp2(acc_m - m_new)) + \
                tl.where(mask, tl.where(v == m_new, 1.0, tl.exp2(v - m_new)), 0.0)
        else:
            acc_s = acc_s * tl.where(acc_m == m_new, 1.0, tl.exp(acc_m - m_new)) + \
                tl.where(mask, tl.where(v == m_new, 1.0, tl.exp(v - m_new)), 0.0)
        acc_m = m_new
    mx = tl.max(acc_m, 0)
    if FAST:
        inv = 1.0 / tl.sum(tl.where(acc_m == mx, acc_s, acc_s * tl.exp2(acc_m - mx)), 0)
        _normalize(X + row, Y + row, 0, N, mx, inv, RBLOCK)
    else:
        total = tl.sum(tl.where(acc_m == mx, acc_s, acc_s * tl.exp(acc_m - mx)), 0)
        for off in range(0, N, RBLOCK):
            cols = off + tl.arange(0, RBLOCK)
            mask = cols < N
            v = tl.load(X + row + cols, mask=mask, other=float("-inf")).to(tl.float32)
            tl.store(Y + row + cols, (tl.exp(v - mx) / total).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _tile_stats(X, lo, hi, RBLOCK: tl.constexpr):
    """Pass 1 over X[lo:hi] with a scalar running max (tile max first, log2 units) and a vector
    running sum: one exp2 per element plus one per tile. Returns (max * log2(e), sum of exp)."""
    m = float("-inf")
    s = tl.zeros([RBLOCK], tl.float32)
    for off in range(lo, hi, RBLOCK):
        cols = off + tl.arange(0, RBLOCK)
        v = tl.load(X + cols, mask=cols < hi, other=float("-inf")).to(tl.float32) * LOG2E
        m_new = tl.maximum(m, tl.max(v, 0))
        s = s * tl.exp2(m - m_new) + tl.exp2(v - m_new)
        m = m_new
    return m, tl.sum(s, 0)


@triton.jit
def _normalize(X, Y, lo, hi, m, inv, RBLOCK: tl.constexpr):
    """Pass 2 over X[lo:hi]: Y = exp2(x * log2(e) - m) * inv (m in log2 units)."""
    for off in range(lo, hi, RBLOCK):
        cols = off + tl.arange(0, RBLOCK)
        mask = cols < hi
        v = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + cols, (tl.exp2(v * LOG2E - m) * inv).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _sm_tile_max(X, Y, N, RBLOCK: tl.constexpr):
    """A2: one program per row, pass 1 = _tile_stats, pass 2 multiplies by 1/sum."""
    row = tl.program_id(0).to(tl.int64) * N
    m, s = _tile_stats(X + row, 0, N, RBLOCK)
    _normalize(X + row, Y + row, 0, N, m, 1.0 / s, RBLOCK)


@triton.jit
def _sm_persistent(X, Y, M, N, RBLOCK: tl.constexpr):
    """A3: A2's math, G programs striding over rows: only G rows in flight, so pass 2 can hit L2."""
    for r in range(tl.program_id(0).to(tl.int64), M, tl.num_programs(0)):
        row = r * N
        m, s = _tile_stats(X + row, 0, N, RBLOCK)
        _normalize(X + row, Y + row, 0, N, m, 1.0 / s, RBLOCK)


@triton.jit
def _sm_split_stats(X, PM, PS, N, CHUNK, S: tl.constexpr, RBLOCK: tl.constexpr):
    """A4 kernel 1, grid (rows, S): (max, sum of exp) of one chunk of a row into PM, PS [rows, S]."""
    row, sid = tl.program_id(0), tl.program_id(1)
    lo = sid * CHUNK
    m, s = _tile_stats(X + row.to(tl.int64) * N, lo, tl.minimum(lo + CHUNK, N), RBLOCK)
    tl.store(PM + row * S + sid, m)
    tl.store(PS + row * S + sid, s)


@triton.jit
def _sm_split_norm(X, Y, PM, PS, N, CHUNK, S: tl.constexpr, RBLOCK: tl.constexpr):
    """A4 kernel 2, grid (rows, S): combine the row's S partials, write this chunk normalized."""
    row, sid = tl.program_id(0), tl.program_id(1)
    pm = tl.load(PM + row * S + tl.arange(0, S))
    ps = tl.load(PS + row * S + tl.arange(0, S))
    m = tl.max(pm, 0)
    inv = 1.0 / tl.sum(ps * tl.exp2(pm - m), 0)
    base = row.to(tl.int64) * N
    lo = sid * CHUNK
    _normalize(X + base, Y + base, lo, tl.minimum(lo + CHUNK, N), m, inv, RBLOCK)


def sm_rows(x, y, RBLOCK, nw, fast):
    return lambda: _sm_rows[(x.shape[0],)](x, y, x.shape[1], RBLOCK=RBLOCK, FAST=fast, num_warps=nw)


def sm_tile_max(x, y, RBLOCK, nw):
    return lambda: _sm_tile_max[(x.shape[0],)](x, y, x.shape[1], RBLOCK=RBLOCK, num_warps=nw)


def sm_persistent(x, y, RBLOCK, nw, k, sms):
    g = min(x.shape[0], sms * k)
    return lambda: _sm_persistent[(g,)](x, y, x.shape[0], x.shape[1], RBLOCK=RBLOCK, num_warps=nw)


def sm_split(x, y, RBLOCK, nw, S):
    (m, n), dev = x.shape, x.device
    rb = min(RBLOCK, triton.next_power_of_2(triton.cdiv(n, S)))
    chunk = triton.cdiv(triton.cdiv(n, S), rb) * rb  # a multiple of the block
    pm, ps = torch.empty(m, S, device=dev), torch.empty(m, S, device=dev)

    def run():
        return (_sm_split_stats[(m, S)](x, pm, ps, n, chunk, S=S, RBLOCK=rb, num_warps=nw),
                _sm_split_norm[(m, S)](x, y, pm, ps, n, chunk, S=S, RBLOCK=rb, num_warps=nw))
    return run


# ------------------------------------------------------------- workload B: gelu(layer_norm(x + r))
@triton.jit
def _ln_block(X, R, W, B, Y, blk, M, N, eps, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr,
              GELU: tl.constexpr, ONE_PASS: tl.constexpr, EVICT: tl.constexpr):
    """XBLOCK whole rows in registers: h = x + r, mean, var, y = (h - mean) * rsqrt(var + eps) * w + b,
    erf GELU. ONE_PASS: var = E[h^2] - mean^2 from two independent sums; else the dependent second
    reduction sum((h - mean)^2) (as generated). EVICT: x, r evict_first, w, b evict_last."""
    rows = blk * XBLOCK + tl.arange(0, XBLOCK)[:, None]
    cols = tl.arange(0, RBLOCK)[None, :]
    rmask = cols < N
    mask = (rows < M) & rmask
    offs = rows.to(tl.int64) * N + cols
    if EVICT:
        x = tl.load(X + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        r = tl.load(R + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        w = tl.load(W + cols, mask=rmask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        b = tl.load(B + cols, mask=rmask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    else:
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=rmask, other=0.0).to(tl.float32)
        b = tl.load(B + cols, mask=rmask, other=0.0).to(tl.float32)
    h = x + r
    if ONE_PASS:
        mean = tl.sum(h, 1)[:, None] / N
        var = tl.maximum(tl.sum(h * h, 1)[:, None] / N - mean * mean, 0.0)
        d = h - mean
    else:
        mean = tl.sum(h, 1)[:, None] / N
        d = tl.where(mask, h - mean, 0.0)
        var = tl.sum(d * d, 1)[:, None] / N
    y = d * tl.math.rsqrt(var + eps) * w + b
    if GELU:
        y = 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _ln_rows(X, R, W, B, Y, M, N, eps, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr,
             GELU: tl.constexpr, ONE_PASS: tl.constexpr, EVICT: tl.constexpr):
    """B0-B4: one program per XBLOCK rows."""
    _ln_block(X, R, W, B, Y, tl.program_id(0), M, N, eps, XBLOCK, RBLOCK, GELU, ONE_PASS, EVICT)


@triton.jit
def _ln_persistent(X, R, W, B, Y, M, N, eps, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr,
                   GELU: tl.constexpr, ONE_PASS: tl.constexpr, EVICT: tl.constexpr):
    """B5: a fixed number of programs striding over the row blocks."""
    for blk in range(tl.program_id(0), tl.cdiv(M, XBLOCK), tl.num_programs(0)):
        _ln_block(X, R, W, B, Y, blk, M, N, eps, XBLOCK, RBLOCK, GELU, ONE_PASS, EVICT)


def ln_gelu(inp, y, nw, xblock=1, gelu=True, one_pass=False, evict=False, persist_k=0, sms=0):
    x, r, w, b = inp
    m, n = x.shape
    kw = dict(XBLOCK=xblock, RBLOCK=triton.next_power_of_2(n), GELU=gelu, ONE_PASS=one_pass, EVICT=evict,
              num_warps=nw)
    if persist_k:
        g = min(triton.cdiv(m, xblock), sms * persist_k)
        return lambda: _ln_persistent[(g,)](x, r, w, b, y, m, n, 1e-5, **kw)
    return lambda: _ln_rows[(triton.cdiv(m, xblock),)](x, r, w, b, y, m, n, 1e-5, **kw)


# ------------------------------------------------------------------------------------- the harness
def _regs(res) -> str:
    """'registers/spills' of the launched kernel(s), e.g. '64/0' or '47/0+56/0'; '' if unknown."""
    ks = res if isinstance(res, (tuple, list)) else [res]
    return "+".join(f"{k.n_regs}/{k.n_spills}" for k in ks if getattr(k, "n_regs", None) is not None)


class Probe:
    """Runs a variant once against the reference, then (on the GPU) times it; prints its row."""

    def __init__(self, args, copy_gbs):
        self.args, self.copy_gbs, self.failed = args, copy_gbs, 0

    def row(self, workload, name, cfg, make, out, ref, nbytes, tol=1e-2):
        """`make()` builds the zero-arg run (which writes `out`, or returns the output if `out` is None)."""
        label = f"{workload:12s} {name:15s} {cfg:22s}"
        try:
            run = make()
            res = run()  # a Triton run returns its CompiledKernel(s): registers, spills
            got, regs = (res, "") if out is None else (out, _regs(res))
            err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
            ok = err <= tol  # False for nan
            self.failed += not ok
            if self.args.interpret_check:
                print(f"{label} {'-':>8s} {'-':>7s} {'-':>6s}  {err:9.2e} {'ok' if ok else 'BAD'}", flush=True)
                return
            ms = triton.testing.do_bench(run, warmup=self.args.warmup, rep=self.args.rep, return_mode="median")
            gbs = nbytes / ms / 1e6
            print(f"{label} {ms:8.4f} {gbs:7.0f} {100 * gbs / self.copy_gbs:5.1f}%  {err:9.2e} "
                  f"{'ok ' if ok else 'BAD'} {regs}", flush=True)
        except Exception as e:  # noqa: BLE001 - a failing variant is a result, not a crash
            self.failed += 1
            msg = " ".join(f"{type(e).__name__}: {e}".split())[:80]
            print(f"{label} ERROR {msg}", flush=True)


def probe_softmax(p: Probe, dev, sms, quick):
    m, n = (10, 4000) if quick else (512, 131072)  # tiny: 10 rows, so persistent programs stride
    scale = 16 if quick else 1  # tiny shapes: blocks 16x smaller
    torch.manual_seed(0)
    x = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ref = torch.softmax(x.double(), -1)
    nbytes = 2 * x.numel() * x.element_size()

    def row(name, cfg, make, out=y):
        y.zero_()
        p.row("softmax_long", name, cfg, make, out, ref, nbytes)
    row("eager", "torch.softmax", lambda: (lambda: torch.softmax(x, -1)), out=None)
    for rb, nw in ((4096, 8), (4096, 16), (8192, 16)):
        row("A0 rows", f"R{rb} w{nw}", lambda: sm_rows(x, y, rb // scale, nw, False))
    for rb, nw in ((4096, 8), (4096, 16), (8192, 16)):
        row("A1 rows+recip", f"R{rb} w{nw}", lambda: sm_rows(x, y, rb // scale, nw, True))
    for rb, nw in ((4096, 8), (8192, 16), (16384, 16)):
        row("A2 tile-max", f"R{rb} w{nw}", lambda: sm_tile_max(x, y, rb // scale, nw))
    for k, rb, nw in ((1, 8192, 16), (1, 16384, 32), (2, 4096, 8), (2, 8192, 16)):
        row("A3 persistent", f"G={k}xSM R{rb} w{nw}", lambda: sm_persistent(x, y, rb // scale, nw, k, sms))
    for s, rb, nw in ((8, 4096, 8), (16, 4096, 8), (16, 8192, 16)):
        row("A4 split-row", f"S{s} R{rb} w{nw}", lambda: sm_split(x, y, rb // scale, nw, s))


def probe_ln_gelu(p: Probe, dev, sms, quick):
    m, n = (40, 250) if quick else (16384, 4096)
    torch.manual_seed(0)
    x, r = (torch.randn(m, n, device=dev, dtype=torch.bfloat16) for _ in range(2))
    w, b = (torch.randn(n, device=dev, dtype=torch.bfloat16) for _ in range(2))
    inp, y = (x, r, w, b), torch.empty_like(x)
    ln64 = F.layer_norm(x.double() + r.double(), (n,), w.double(), b.double(), 1e-5)
    ref, ref_ln = F.gelu(ln64), ln64
    nbytes = 3 * x.numel() * x.element_size() + 2 * n * w.element_size()

    def row(name, cfg, make, out=y, want=ref):
        y.zero_()
        p.row("ln_gelu", name, cfg, make, out, want, nbytes)
    row("eager", "F.gelu(F.layer_norm)", lambda: (lambda: F.gelu(F.layer_norm(x + r, (n,), w, b, 1e-5))), out=None)
    for nw in (4, 8, 16):
        row("B0 as generated", f"X1 w{nw}", lambda: ln_gelu(inp, y, nw))
    for nw in (4, 8):
        row("B1 no-gelu", f"X1 w{nw}", lambda: ln_gelu(inp, y, nw, gelu=False), want=ref_ln)
    for nw in (4, 8):
        row("B2 one-pass", f"X1 w{nw}", lambda: ln_gelu(inp, y, nw, one_pass=True))
    for nw in (4, 8):
        row("B3 evict", f"X1 w{nw}", lambda: ln_gelu(inp, y, nw, evict=True))
    for xb, nw in ((2, 8), (4, 8), (4, 16)):
        row("B4 multi-row", f"X{xb} w{nw}", lambda: ln_gelu(inp, y, nw, xblock=xb))
    for k, nw in ((4, 4), (8, 4), (4, 8)):
        row("B5 persistent", f"G={k}xSM X1 w{nw}", lambda: ln_gelu(inp, y, nw, persist_k=k, sms=sms))


PROBES = {"softmax_long": probe_softmax, "ln_gelu": probe_ln_gelu}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.probe_reductions", description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(PROBES), help="comma-separated: " + ", ".join(PROBES))
    ap.add_argument("--warmup", type=int, default=10, help="do_bench warmup, ms")
    ap.add_argument("--rep", type=int, default=50, help="do_bench repetitions, ms")
    ap.add_argument("--interpret-check", action="store_true",
                    help="numerics only: every variant once on tiny CPU shapes (needs TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    names = [s for s in args.only.split(",") if s]
    unknown = [s for s in names if s not in PROBES]
    if unknown:
        ap.error(f"unknown workload(s) {unknown}; choose from {list(PROBES)}")
    if args.interpret_check:
        if not INTERPRET:
            print("--interpret-check needs TRITON_INTERPRET=1 set before triton is imported")
            return 2
        dev, sms, copy_gbs, device_name = "cpu", 4, float("nan"), "CPU (Triton interpreter)"
    elif not torch.cuda.is_available():
        print("probe_reductions: no CUDA device; nothing to time (try TRITON_INTERPRET=1 ... --interpret-check)")
        return 0
    else:
        dev, sms = "cuda", torch.cuda.get_device_properties(0).multi_processor_count
        device_name = f"{torch.cuda.get_device_name(0)} ({sms} SMs)"
        src = torch.empty(2**30, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=args.warmup, rep=args.rep,
                                          return_mode="median")
        copy_gbs = 2 * src.numel() / copy_ms / 1e6
        del src, dst
    print(f"device {device_name}  torch {torch.__version__}  triton {triton.__version__}  "
          f"python {sys.version.split()[0]}")
    if not args.interpret_check:
        print(f"copy ceiling {copy_gbs:.0f} GB/s (1 GiB dst.copy_(src), read + write)")
    print(f"{'workload':12s} {'variant':15s} {'config':22s} {'ms':>8s} {'GB/s':>7s} {'%copy':>6s}  "
          f"{'max relerr':>9s}" + ("" if args.interpret_check else "     regs/spills"))
    p = Probe(args, copy_gbs)
    for name in names:
        PROBES[name](p, dev, sms, quick=args.interpret_check)
        if dev == "cuda":
            torch.cuda.empty_cache()
    print(f"{p.failed} variant(s) failed" if p.failed else "all variants ok")
    return 1 if (args.interpret_check and p.failed) else 0


if __name__ == "__main__":
    sys.exit(main())
