"""GPU probe: softmax over rows too long for one program's registers, read once.

Every schedule fxopt had for softmax over [512, 131072] bf16 reads each row twice (one pass for max
and sum, one to normalize), and the second read comes from HBM: at best 2/3 of the copy bandwidth,
~53-56% measured (benchmarks/probe_reductions.py). Here each row is cut into NCHUNK chunks held in
registers by NCHUNK co-resident programs that exchange (max, sum) through a small workspace and a
per-row arrival counter, so the row is read once and written once.

Programs are persistent (grid = a multiple of NCHUNK no larger than what the GPU holds at once), so
every program of a row's group is resident: a spin-wait cannot deadlock. PREFETCH loads the group's
next row before waiting, hiding the exchange behind that load.

    PYTHONPATH=. python -m benchmarks.probe_coop_softmax

GPU only: the Triton interpreter runs programs one after another, so a program waiting for another
never returns there.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
import triton.testing

from benchmarks.measure import copy_ceiling_gbs

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _arrive_and_wait(CNT, row, NCHUNK: tl.constexpr):
    """Count this program in on its row and wait for the row's other NCHUNK-1 programs."""
    tl.debug_barrier()  # every thread's partial stores precede the release below
    seen = tl.atomic_add(CNT + row, 1, sem="acq_rel", scope="gpu") + 1
    while seen < NCHUNK:
        seen = tl.atomic_add(CNT + row, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _coop_softmax(X, Y, WM, WS, CNT, M, N, NCHUNK: tl.constexpr, CHUNK: tl.constexpr,
                  PREFETCH: tl.constexpr, KEEP16: tl.constexpr):
    """KEEP16: hold the chunk in its 16-bit input type between the two uses (half the registers)."""
    pid = tl.program_id(0)
    groups = tl.num_programs(0) // NCHUNK
    chunk = pid % NCHUNK
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = cols < N
    row = pid // NCHUNK
    x = tl.load(X + row.to(tl.int64) * N + cols, mask=mask & (row < M), other=float("-inf"))
    if not KEEP16:
        x = x.to(tl.float32) * LOG2E
    while row < M:
        xf = x.to(tl.float32) * LOG2E if KEEP16 else x
        m = tl.max(xf, 0)
        s = tl.sum(tl.exp2(xf - m), 0)
        tl.store(WM + row * NCHUNK + chunk, m)
        tl.store(WS + row * NCHUNK + chunk, s)
        nxt = row + groups
        if PREFETCH:
            x_next = tl.load(X + nxt.to(tl.int64) * N + cols, mask=mask & (nxt < M), other=float("-inf"))
            if not KEEP16:
                x_next = x_next.to(tl.float32) * LOG2E
        _arrive_and_wait(CNT, row, NCHUNK)
        c = tl.arange(0, NCHUNK)
        pm = tl.load(WM + row * NCHUNK + c, volatile=True)
        ps = tl.load(WS + row * NCHUNK + c, volatile=True)
        mx = tl.max(pm, 0)
        inv = 1.0 / tl.sum(ps * tl.exp2(pm - mx), 0)
        xf = x.to(tl.float32) * LOG2E if KEEP16 else x
        tl.store(Y + row.to(tl.int64) * N + cols, (tl.exp2(xf - mx) * inv).to(Y.dtype.element_ty), mask=mask)
        if PREFETCH:
            x = x_next
        else:
            x = tl.load(X + nxt.to(tl.int64) * N + cols, mask=mask & (nxt < M), other=float("-inf"))
            if not KEEP16:
                x = x.to(tl.float32) * LOG2E
        row = nxt


def resident_programs(kernel, num_warps: int) -> int:
    """Programs of a compiled kernel the GPU holds at once (registers, shared memory, threads)."""
    props = torch.cuda.get_device_properties(0)
    threads = 32 * num_warps
    regs = max(1, kernel.n_regs) * threads
    per_sm = min(65536 // regs, 2048 // threads, 32)
    if kernel.metadata.shared:
        per_sm = min(per_sm, props.shared_memory_per_multiprocessor // kernel.metadata.shared)
    return per_sm * props.multi_processor_count


def run(x, nchunk, warps, per_sm, prefetch, keep16=False):
    m, n = x.shape
    chunk = triton.next_power_of_2(triton.cdiv(n, nchunk))
    y = torch.empty_like(x)
    wm = torch.empty(m * nchunk, device=x.device, dtype=torch.float32)
    ws = torch.empty_like(wm)
    cnt = torch.zeros(m, device=x.device, dtype=torch.int32)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # compile once on a one-group grid to read the register count, then size the real grid
    compiled = _coop_softmax[(nchunk,)](x, y, wm, ws, cnt, m, n, nchunk, chunk, prefetch, keep16, num_warps=warps)
    cnt.zero_()
    cap = resident_programs(compiled, warps)
    grid = min(cap, sms * per_sm) // nchunk * nchunk
    if grid == 0:
        raise RuntimeError(f"{nchunk} programs of {compiled.n_regs} registers x {warps} warps do not fit at once")

    def call():
        cnt.zero_()
        _coop_softmax[(grid,)](x, y, wm, ws, cnt, m, n, nchunk, chunk, prefetch, keep16, num_warps=warps)
    return call, y, f"regs {compiled.n_regs} spills {compiled.n_spills} grid {grid} (cap {cap})"


def main() -> int:
    torch.manual_seed(0)
    ceiling = copy_ceiling_gbs("cuda", 2**30, 25, 100)
    print(f"copy ceiling {ceiling:.0f} GB/s")
    x = torch.randn(512, 131072, device="cuda", dtype=torch.bfloat16) * 4
    ref = torch.softmax(x.double(), -1)
    nbytes = 2 * x.numel() * x.element_size()
    ms = triton.testing.do_bench(lambda: torch.softmax(x, -1), return_mode="median")
    print(f"torch.softmax: {ms * 1e3:.1f} us {nbytes / ms / 1e6 / ceiling:.1%}")
    for nchunk, warps, per_sm, prefetch, keep16 in [
            (16, 4, 4, True, False), (16, 4, 4, True, True), (8, 4, 4, True, True), (32, 2, 8, True, True),
            (16, 2, 8, True, True), (64, 1, 16, True, True), (32, 4, 4, True, True), (16, 8, 2, True, True),
            (32, 2, 8, True, False), (64, 1, 16, True, False), (8, 8, 2, True, True)]:
        try:
            call, y, info = run(x, nchunk, warps, per_sm, prefetch, keep16)
            call()
            torch.cuda.synchronize()
            err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
            ms = triton.testing.do_bench(call, return_mode="median")
            print(f"nchunk {nchunk:2d} warps {warps:2d} per_sm {per_sm:2d} prefetch {prefetch!s:5} "
                  f"keep16 {keep16!s:5}: {ms * 1e3:6.1f} us {nbytes / ms / 1e6 / ceiling:6.1%}  "
                  f"err {err:.1e}  {info}", flush=True)
        except Exception as e:  # noqa: BLE001 - a probe row reports its failure
            print(f"nchunk {nchunk} warps {warps} per_sm {per_sm}: {type(e).__name__}: {str(e)[:200]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
