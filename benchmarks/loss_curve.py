"""Mixed precision over many optimizer steps: fxopt's precision="bf16" against torch.autocast(bf16),
both against fp32, on the tiny GPT of examples/tiny_gpt.py (issue 6: "follows the autocast loss curve
within 1%").

    PYTHONPATH=. python -m benchmarks.loss_curve --steps 200 [--lr 1e-3] [--device cuda]

Prints the worst per-step relative difference of each pair and a few steps of the three curves. Two
bf16 runs each differ from fp32 by bf16's rounding, so fxopt-vs-autocast is read next to
autocast-vs-fp32. On the CPU every fxopt kernel runs in the Triton interpreter, whose fp32 -> bf16
casts truncate (the GPU rounds to nearest): CPU figures overstate fxopt's difference.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

import fxopt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from tiny_gpt import GPTConfig, lm_loss, make  # noqa: E402


def train(fn, model, idx, steps: int, lr: float) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(fn(idx), idx)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def worst_relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def curves(steps: int, lr: float, device: str) -> dict[str, list[float]]:
    torch.manual_seed(0)
    model, (idx,) = make(GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32),
                         batch=4, seq=16, device=device)
    autocast_model, fp32_model = copy.deepcopy(model), copy.deepcopy(model)

    def autocast(i):
        with torch.autocast(device, dtype=torch.bfloat16):
            return autocast_model(i)
    compiled = torch.compile(model, backend=fxopt.backend(precision="bf16"))
    return {"fxopt": train(compiled, model, idx, steps, lr),
            "autocast": train(autocast, autocast_model, idx, steps, lr),
            "fp32": train(fp32_model, fp32_model, idx, steps, lr)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loss_curve", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    c = curves(args.steps, args.lr, args.device)
    print(f"{args.steps} AdamW steps, lr {args.lr}, {args.device}; worst per-step relative difference: "
          f"fxopt vs autocast {worst_relative(c['fxopt'], c['autocast']):.2%}, "
          f"autocast vs fp32 {worst_relative(c['autocast'], c['fp32']):.2%}, "
          f"fxopt vs fp32 {worst_relative(c['fxopt'], c['fp32']):.2%}")
    print(f"{'step':>5} {'fxopt':>9} {'autocast':>9} {'fp32':>9}")
    for i in sorted({0, args.steps // 4, args.steps // 2, 3 * args.steps // 4, args.steps - 1}):
        print(f"{i:5d} {c['fxopt'][i]:9.4f} {c['autocast'][i]:9.4f} {c['fp32'][i]:9.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
