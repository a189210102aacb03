"""The command-line options benchmarks.ddp_scaling and benchmarks.fsdp_scaling share: where they run
(device, ranks), the model's size, what they time and in which precision, and how their arguments are
finished after parsing."""
from __future__ import annotations

import argparse
import os

import torch


def shape_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--world", type=int, default=0, help="ranks (default: every GPU; 2 on the CPU)")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="per-GPU batch (sequences of 1024 tokens)")
    p.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke test)")


def run_args(p: argparse.ArgumentParser, backends: str) -> None:
    """How long each tool times, in what precision, which backends, and how long it waits for its ranks."""
    p.add_argument("--steps", type=int, default=20, help="timed steps per phase and round")
    p.add_argument("--rounds", type=int, default=5, help="one-GPU and N-GPU timings in turn")
    p.add_argument("--precision", default="bf16", help="bf16, fp16 or none")
    p.add_argument("--backends", default=backends)
    p.add_argument("--timeout", type=int, default=900)


def parsed(p: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """The arguments with --backends as a list, --precision none as None, and the Triton interpreter
    on the CPU (for the worker processes too, through the environment)."""
    args = p.parse_args(argv)
    args.backends = args.backends.split(",")
    args.precision = None if args.precision == "none" else args.precision
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return args
