"""Dynamic shapes on a real GPT block: one compilation for batch 1..64 x length 16..4096, and its speed.

    PYTHONPATH=. python -m benchmarks.dynamic_sweep [--device cuda] [--d-model 1024 --heads 16] [--size-oblivious]

Compiles a GPT-2 block (d1024, 16 heads, hand-written causal attention, bf16) once with
`torch.compile(backend=..., dynamic=True)`, calls it at every (batch, length) of the grid below, counts
the backend's compilations (batch 1 is specialised by dynamo: one more, expected; none with
--size-oblivious, which sets torch.fx.experimental._config.backed_size_oblivious), and checks each
output against eager in float64 (bf16 tolerance). Then, for a few pairs, times the dynamic
compilation against a static one compiled for that pair alone (median ms, triton.testing.do_bench).
"""
from __future__ import annotations

import argparse

import torch
import triton.testing

import fxopt
from benchmarks.workloads_attention import GPTBlock
from fxopt.backend import compile_dynamo_graph

BATCHES = (2, 3, 8, 17, 33, 64, 1)
LENGTHS = (16, 100, 512, 1000, 2048, 4096)
TIMED = ((1, 16), (8, 512), (8, 1024), (16, 1024), (4, 4096), (64, 2048))


class Counting:
    """The fxopt backend, counting dynamo's calls into it."""

    def __init__(self):
        self.calls, self.report = 0, fxopt.Report()

    def __call__(self, gm, inputs):
        self.calls += 1
        return compile_dynamo_graph(gm, inputs, fxopt.Options(), self.report)


def relative_error(out, ref) -> float:
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def by_batch_chunks(module, x, heads: int, budget: int = 2**32):
    """module(x) a few sequences at a time: eager attention materialises [B, H, T, T] scores, 66 GiB
    in float64 at batch 33 x length 4096."""
    b, t, _ = x.shape
    step = max(1, budget // (heads * t * t * x.element_size()))
    return torch.cat([module(x[i:i + step]) for i in range(0, b, step)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="small grid and model (a CPU smoke test)")
    p.add_argument("--size-oblivious", action="store_true",
                   help="no 0/1 specialisation of sizes (torch.fx.experimental._config.backed_size_oblivious)")
    args = p.parse_args(argv)
    if args.size_oblivious:
        torch.fx.experimental._config.backed_size_oblivious = True
    batches, lengths, timed = (BATCHES, LENGTHS, TIMED) if not args.quick else ((2, 3, 1), (16, 40), ((2, 16),))
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch._dynamo.config.cache_size_limit = 64  # the static compilations below are separate entries
    torch._dynamo.config.accumulated_cache_size_limit = 256
    torch.manual_seed(0)
    block = GPTBlock(args.d_model, args.heads, max_len=8192).to(args.device, dtype).eval()
    ref_block = GPTBlock(args.d_model, args.heads, max_len=8192).to(args.device, torch.float64).eval()
    ref_block.load_state_dict(block.state_dict())
    backend = Counting()
    compiled = torch.compile(block, backend=backend, dynamic=True)
    worst, first = 0.0, None
    with torch.no_grad():
        for b in batches:
            for t in lengths:
                x = torch.randn(b, t, args.d_model, device=args.device, dtype=dtype)
                ref = by_batch_chunks(ref_block, x.double(), args.heads)
                err = relative_error(compiled(x), ref)
                eager_err = relative_error(by_batch_chunks(block, x, args.heads), ref)
                worst = max(worst, err / max(eager_err, 1e-6))
                first = backend.calls if first is None else first  # dynamo may call twice for the first graph
                print(f"batch {b:2d} length {t:4d}: compilations so far {backend.calls}, "
                      f"error vs float64 {err:.2e} (eager {eager_err:.2e})", flush=True)
    expected = "0 expected" if args.size_oblivious else "batch 1 is specialised by dynamo: 1 expected"
    print(f"{len(batches) * len(lengths)} (batch, length) pairs: {backend.calls} backend calls, "
          f"{backend.calls - first} after the first pair ({expected}); "
          f"worst error / eager's error {worst:.2f}")
    print(f"symbols {[g.symbols for g in backend.report.graphs if g.symbols][:1]}")
    print("pair         dynamic ms  static ms  dynamic/static")
    with torch.no_grad():
        for b, t in timed:
            x = torch.randn(b, t, args.d_model, device=args.device, dtype=dtype)
            static = torch.compile(block, backend="fxopt", dynamic=False)
            static(x)
            ms_d = triton.testing.do_bench(lambda: compiled(x), return_mode="median") if args.device == "cuda" else 0
            ms_s = triton.testing.do_bench(lambda: static(x), return_mode="median") if args.device == "cuda" else 0
            print(f"({b:2d}, {t:4d})  {ms_d:10.4f} {ms_s:10.4f}  {ms_d / ms_s if ms_s else 0:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
