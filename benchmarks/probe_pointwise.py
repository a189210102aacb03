"""Quick GPU probe: real-compiler correctness of a few generated kernels and the headline chain's speed.

    PYTHONPATH=. python benchmarks/probe_pointwise.py
"""
import time

import torch
import torch.nn.functional as F
import triton.testing

import fxopt  # noqa: F401


def chain(x, w, b):
    y = x * w + b
    y = F.gelu(y) * torch.sigmoid(x) + x
    return torch.tanh(y) * 0.5 + y * y


def misc(x, y):
    m = torch.where(x > 0, x, float("-inf"))
    return (torch.maximum(m, y), (x > y) & (y < 1), torch.rsqrt(x.abs() + 1), x.to(torch.int32) * 3,
            torch.clamp(x, -0.5, 0.5), torch.exp(x) + torch.log1p(x.abs()), torch.pow(x, 3.5))


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def main():
    dev = "cuda"
    torch.manual_seed(0)
    n = 8192
    x, w, b = (torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(3))
    ref64 = chain(x.double(), w.double(), b.double())
    rows = []
    for name, fn in [("eager", chain), ("inductor", torch.compile(chain)),
                     ("fxopt", torch.compile(chain, backend="fxopt"))]:
        t0 = time.perf_counter()
        out = fn(x, w, b)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        ms = triton.testing.do_bench(lambda: fn(x, w, b), warmup=50, rep=300, return_mode="median")
        gbs = 4 * x.numel() * 2 / ms / 1e6
        rows.append((name, ms, gbs, first, rel(out, ref64)))
    src = torch.empty(2**30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    copy_gbs = 2 * src.numel() / copy_ms / 1e6
    print(f"copy ceiling: {copy_gbs:.0f} GB/s")
    for name, ms, gbs, first, err in rows:
        print(f"{name:9s} {ms:8.3f} ms {gbs:7.0f} GB/s {100 * gbs / copy_gbs:5.1f}% first {first:6.2f}s relerr {err:.2e}")
    xs, ys = torch.randn(1000, 37, device=dev), torch.randn(37, device=dev)
    got = torch.compile(misc, backend="fxopt")(xs, ys)
    exp = misc(xs, ys)
    for i, (g, e) in enumerate(zip(got, exp)):
        ok = torch.equal(g, e) if not e.dtype.is_floating_point else torch.allclose(g, e, rtol=1e-5, atol=1e-6, equal_nan=True)
        print("misc", i, "ok" if ok else f"MISMATCH {(g.float() - e.float()).abs().nan_to_num().max()}")
    t = torch.linspace(-30, 30, 1 << 20, device=dev, dtype=torch.bfloat16)
    for name, f in [("tanh", torch.tanh), ("sigmoid", torch.sigmoid)]:
        got = torch.compile(lambda v: f(v) * 1, backend="fxopt")(t)
        err = ((got.double() - f(t.double())).abs() / f(t.double()).abs().clamp_min(1e-30)).max().item()
        eager = ((f(t).double() - f(t.double())).abs() / f(t.double()).abs().clamp_min(1e-30)).max().item()
        print(f"bf16 {name}: max rel err fxopt {err:.2e} vs eager bf16 {eager:.2e}")


if __name__ == "__main__":
    main()
