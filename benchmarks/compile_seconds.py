"""fxopt's own compile seconds for a deep model, on any machine: passes and codegen, per graph and per pass.

A first call's seconds are mostly torch's (dynamo, aot_autograd) and Triton's; what fxopt adds grows with
the graph, so it is measured on a stack of GPT-2 blocks captured as one graph (the runner's
`gpt_stack_train` model, small enough here that the kernels' interpreter runs stay short):

    TRITON_INTERPRET=1 python -m benchmarks.compile_seconds --layers 24        # CPU machine
    python -m benchmarks.compile_seconds --layers 24 --device cuda            # a GPU host

Prints each graph's compile seconds (report.graphs[i].compile_seconds: passes, codegen, memory plan,
kernel module load; not Triton's compiles of a CUDA graph's kernels, which run beside them on a pool)
and its slowest passes. One forward and backward call, precision="bf16".
"""
from __future__ import annotations

import argparse
import time

import torch

import fxopt
from fxopt.backend import compile_dynamo_graph
from fxopt.report import Report

from .workloads_models import GPTStack, _block_train


def measure(layers: int, d_model: int, tokens: int, device: str) -> tuple[Report, float]:
    """(the report of one compiled training step, the first call's wall seconds)."""
    torch.manual_seed(0)
    stack = GPTStack(layers, d_model, 4, max_len=tokens).to(device)
    x = torch.randn(2, tokens, d_model, device=device, requires_grad=True)
    report = Report()
    options = fxopt.Options(precision="bf16")
    step = torch.compile(lambda s, x, dy: _block_train(s, x, dy),
                         backend=lambda gm, ins: compile_dynamo_graph(gm, ins, options, report))
    start = time.perf_counter()
    step(stack, x, torch.randn_like(x))
    return report, time.perf_counter() - start


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--top", type=int, default=6, help="slowest passes shown per graph")
    args = ap.parse_args(argv)
    report, wall = measure(args.layers, args.d_model, args.tokens, args.device)
    print(f"{args.layers} GPT-2 blocks, d{args.d_model}, T{args.tokens}, {args.device}: first call {wall:.2f} s")
    pre = sum(p.seconds for p in report.pre_autograd)
    print(f"  torch-level passes {pre:.2f} s")
    for g in report.graphs:
        passes = sum(p.seconds for p in g.passes)
        slowest = ", ".join(f"{p.name} {p.seconds:.2f}" for p in sorted(g.passes, key=lambda p: -p.seconds)[:args.top])
        print(f"  {g.name}: compile {g.compile_seconds:.2f} s, of it passes {passes:.2f} s ({slowest})")


if __name__ == "__main__":
    main()
