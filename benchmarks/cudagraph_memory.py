"""Memory held by CUDA graphs: fxopt's graphs sharing one pool vs a private pool each, with the tensors
saved for the backward lent (default) or copied out, the outputs a caller sees lent (default) or
copied out, warm-ups allocating from the pool (default) or from the caller's stream cache, vs Inductor.

    PYTHONPATH=. python -m benchmarks.cudagraph_memory [--workloads gpt_block_train_cg,gpt_block_b1_cg] [--configs ...]

Each configuration runs in its own process (the caching allocator keeps what a process reserved): the
workload's function compiled with CUDA graphs (fxopt `cudagraphs=True`, shared or private pools;
Inductor `mode="reduce-overhead"`), called 6 times (warm-up, capture, replays). Printed: memory
reserved by the allocator after those calls, above what was reserved before compiling (the graphs'
pools, static input copies, outputs); the largest reservation seen; and the median time of a call.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

CONFIGS = ("fxopt shared pool", "fxopt warm-up outside pool", "fxopt outputs copied", "fxopt saved copied",
           "fxopt private pools", "inductor")


def child(workload: str, config: str) -> dict:
    from benchmarks import measure
    from benchmarks.workloads import WORKLOADS
    from fxopt import cudagraphs

    w = WORKLOADS[workload]
    fn, inputs = w.make("cuda", torch.bfloat16, False)
    cudagraphs.SHARE_POOL = config != "fxopt private pools"
    cudagraphs.LEND_SAVED = config != "fxopt saved copied"
    cudagraphs.WARMUP_IN_POOL = config != "fxopt warm-up outside pool"
    cudagraphs.LEND_OUTPUTS = config not in ("fxopt saved copied", "fxopt outputs copied")
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    compiled = measure.compile_for("inductor" if config == "inductor" else "fxopt", fn, w)
    with measure.grad_mode(w):
        for _ in range(6):
            out = compiled(*inputs)
            del out
        torch.cuda.synchronize()
        held = torch.cuda.memory_reserved() - before
        ms = measure.bench_ms(lambda: compiled(*inputs), "cuda", 25, 100)
    notes = [n for rep in measure.FXOPT_REPORTS for g in rep.graphs for n in g.notes if n.startswith("cudagraphs")]
    return {"held_mib": held / 2**20, "max_reserved_mib": (torch.cuda.max_memory_reserved() - before) / 2**20,
            "ms": ms, "notes": notes if config != "inductor" else []}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="gpt_block_train_cg,gpt_block_b1_cg")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"some of: {', '.join(CONFIGS)}")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    print(f"{'workload':20s} {'configuration':22s} {'held MiB':>9s} {'max reserved MiB':>17s} {'ms':>8s}")
    for workload in args.workloads.split(","):
        for config in args.configs.split(","):
            run = subprocess.run([sys.executable, "-m", "benchmarks.cudagraph_memory", "--child", workload, config],
                                 capture_output=True, text=True)
            if run.returncode != 0:
                print(f"{workload:20s} {config:22s} failed: {run.stderr.strip().splitlines()[-1:]}")
                continue
            r = json.loads(run.stdout.strip().splitlines()[-1])
            print(f"{workload:20s} {config:22s} {r['held_mib']:9.1f} {r['max_reserved_mib']:17.1f} {r['ms']:8.4f}",
                  flush=True)
            for note in r["notes"]:
                print(f"    {note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
