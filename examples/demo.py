"""fxopt in one minute: compile a small GPT with fxopt, see what it did, check it against eager.

    python examples/demo.py

1. explain:   print fxopt.explain(model, idx): every pass, every generated Triton kernel with the
              ATen ops it fuses, and every node left to ATen with the reason.
2. correctness: torch.compile(model, backend="fxopt"), forward + loss + backward, and compare the
              logits, the loss and every parameter gradient with eager PyTorch (exit 1 on FAIL).
3. speed (GPU only): median step times of eager, Inductor (torch.compile's default) and fxopt.

On a machine without a GPU the generated Triton kernels run in the Triton interpreter
(TRITON_INTERPRET=1, set below): that checks the very kernels a GPU would run, but slowly, so the
CPU run uses a tiny model and prints no timings.
"""
from __future__ import annotations

import os
import sys
import time

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before anything compiles: run fxopt's kernels in the interpreter

import fxopt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_gpt import GPTConfig, lm_loss, make  # noqa: E402

if DEVICE == "cuda":
    CONFIG = GPTConfig(vocab_size=8192, block_size=512, n_layer=4, n_head=12, n_embd=768)
    BATCH, SEQ, TOL = 8, 512, 1e-3
else:
    CONFIG = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=64)
    BATCH, SEQ, TOL = 2, 16, 1e-4


def section(title: str) -> None:
    print(f"\n{'=' * 8} {title} {'=' * max(0, 70 - len(title))}")


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max abs error, max abs error relative to the largest reference value)."""
    abs_err = (out.double() - ref.double()).abs().max().item()
    return abs_err, abs_err / max(ref.double().abs().max().item(), 1e-30)


def forward_backward(fn, model, idx):
    """Logits, loss and {parameter name: gradient} of one training step of fn (model or its compiled form)."""
    model.zero_grad(set_to_none=True)
    logits = fn(idx)
    loss = lm_loss(logits, idx)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return logits.detach(), loss.detach(), grads


def check(model, idx) -> bool:
    section("2. correctness: torch.compile(model, backend='fxopt') vs eager")
    ref_logits, ref_loss, ref_grads = forward_backward(model, model, idx)
    compiled = torch.compile(model, backend="fxopt")
    start = time.perf_counter()
    logits, loss, grads = forward_backward(compiled, model, idx)
    print(f"first call (compile forward + backward, then run): {time.perf_counter() - start:.1f} s")

    rows = [("logits", *errors(logits, ref_logits)), ("loss", *errors(loss, ref_loss))]
    grad_errs = {name: errors(grads[name], ref_grads[name]) for name in ref_grads}
    worst = max(grad_errs, key=lambda name: grad_errs[name][1])
    rows.append((f"{len(grad_errs)} parameter grads (worst: {worst})", *grad_errs[worst]))
    ok = True
    print(f"{'':<52}{'max abs err':>12}{'max rel err':>13}")
    for what, abs_err, rel_err in rows:
        passed = rel_err <= TOL
        ok &= passed
        print(f"{what:<52}{abs_err:>12.2e}{rel_err:>13.2e}  {'ok' if passed else 'TOO LARGE'}")
    print(f"(rel err = max abs err / max |eager value|; tolerance {TOL:g} for float32)")
    print(f"loss: eager {ref_loss.item():.6f}, fxopt {loss.item():.6f}")
    print("PASS" if ok else "FAIL")
    return ok


def benchmark(model, idx) -> None:
    """Median times (triton.testing.do_bench) of eager, Inductor and fxopt, and their first-call times."""
    from triton.testing import do_bench

    section("3. speed (CUDA, float32): median times over many runs")
    params = list(model.parameters())
    print(f"{'':<10}{'first call':>12}{'forward':>12}{'fwd+bwd':>12}")
    for name, fn in [("eager", model),
                     ("inductor", torch.compile(model)),  # torch.compile's default backend
                     ("fxopt", torch.compile(model, backend="fxopt"))]:
        def train_step():
            lm_loss(fn(idx), idx).backward()

        def infer():
            with torch.no_grad():
                fn(idx)

        torch._dynamo.reset()  # forget earlier compilations, so "first call" includes compiling
        torch.cuda.synchronize()
        start = time.perf_counter()
        train_step()  # compiles the forward and backward graphs (eager: just runs)
        infer()  # under no_grad dynamo compiles an inference graph
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        fwd = do_bench(infer, return_mode="median")
        step = do_bench(train_step, grad_to_none=params, return_mode="median")
        print(f"{name:<10}{first:>11.2f}s{fwd:>10.3f}ms{step:>10.3f}ms")
    print("(first call: compile + one training step + one inference call; on-disk compile caches can\n"
          " make a second run of this script start faster)")


def main() -> int:
    torch.manual_seed(0)
    print(f"fxopt {fxopt.__version__}, torch {torch.__version__}, device: {DEVICE}")
    if DEVICE == "cpu":
        print("No GPU found: the generated Triton kernels run in the Triton interpreter on CPU\n"
              "(TRITON_INTERPRET=1). That executes and checks the exact kernels a GPU would run, but it\n"
              "is slow, so this run uses a tiny model; timings are only shown on a GPU.")
    model, (idx,) = make(CONFIG, batch=BATCH, seq=SEQ, device=DEVICE)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: GPT, {CONFIG.n_layer} layers, d={CONFIG.n_embd}, {CONFIG.n_head} heads, "
          f"vocab {CONFIG.vocab_size}, {n_params / 1e6:.2f}M params; input idx {tuple(idx.shape)}")

    section("1. fxopt.explain(model, idx)")
    rep = fxopt.explain(model, idx)
    print(rep)
    by_graph = {}
    for k in rep.kernels:
        by_graph[k.graph] = by_graph.get(k.graph, 0) + 1
    per_graph = ", ".join(f"{n} in {g}" for g, n in by_graph.items())
    print(f"summary: {len(rep.kernels)} Triton kernels ({per_graph}), "
          f"{sum(len(k.ops) for k in rep.kernels)} ATen ops fused, {len(rep.fallbacks)} nodes left to ATen, "
          f"{sum(s.fused for s in rep.attention)} of {len(rep.attention)} attention sites on fxopt's flash kernels")

    ok = check(model, idx)
    if ok and DEVICE == "cuda":
        benchmark(model, idx)
    elif DEVICE == "cpu":
        print("\n(timings skipped: they are only meaningful on a GPU)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
