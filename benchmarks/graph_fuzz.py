"""Random programs of element-wise ops, reductions, broadcasts and casts, compiled by fxopt and compared with
eager, forward and backward: a search for wrong results in fusion and scheduling that hand-written tests
miss (a fuzzer like this one found the softmax amax NaN gradients and the mixed-dtype rounding of
2026-12-06). Each program is printed as Python when it fails, so it can be pasted into a test.

    TRITON_INTERPRET=1 python -m benchmarks.graph_fuzz --device cpu --programs 200 [--seed 0] [--dtype float32]
    python -m benchmarks.graph_fuzz --programs 500            # on a GPU

A mismatch is an output or gradient whose NaN/inf places differ from eager's, or whose distance from the
float64 result exceeds twice eager's plus the dtype's tolerance of the result's scale (fp32 1e-4, fp64 1e-9:
a constant rounded to fp32 shows; fp16/bf16 2e-2: fxopt keeps 16-bit intermediates in fp32, so it may be
closer than eager, not much further; a result gets the loosest of its dtype's and the inputs' tolerances).
`--more` adds scans, sorts, matmuls, in-place and integer-valued ops (sort and argmax in fp32/fp64 only:
16-bit values tie), `--layouts` transposed, strided and offset inputs, `--mixed` inputs of three dtypes.
Known, accepted (README, "16-bit intermediates"): in fp16/bf16 a `where(a > b, ...)` at a near-tie can pick
the other side, since fxopt's `a` is the exact value rounded once and eager's rounded after every op
(`log(1 / (|y| + 0.5) + 1)`: eager 0.75732, fxopt 0.75684 = b), and the gradient goes to the other input;
likewise a reduced value cast to bf16 (`w.mean(0) / (|y| + 1)` then `.to(bfloat16)`): the sum's order
moves it an fp32 ulp, and a rounding near a bf16 tie goes the other way; and, with `--mixed`, an amax over
fp16 values whose fxopt values (rounded once) tie where eager's (rounded twice) do not: amax's gradient is
then split between the tied elements.
"""
from __future__ import annotations

import argparse
import importlib
import random
import sys

import torch

from benchmarks.edge_sweep import special_places_differ

UNARY = ["torch.exp({a}.clamp(-20, 20))", "torch.tanh({a})", "torch.sigmoid({a})", "torch.relu({a})",
         "F.gelu({a})", "{a}.abs()", "-{a}", "torch.sqrt({a}.abs() + 0.1)", "torch.log({a}.abs() + 1)",
         "torch.sin({a})", "{a} * {c}", "{a} + {c}", "{a} / {c}", "torch.reciprocal({a}.abs() + 0.5)",
         "{a} * {a}", "F.silu({a})", "torch.clamp({a}, -1.5, 1.5)", "torch.rsqrt({a}.abs() + 0.5)"]
BINARY = ["{a} + {b}", "{a} - {b}", "{a} * {b}", "torch.maximum({a}, {b})", "torch.minimum({a}, {b})",
          "torch.where({a} > {b}, {a}, {b})", "torch.sub({a}, {b}, alpha={c})", "{a} / ({b}.abs() + 1)"]
ROW = ["{a}.sum(-1, keepdim=True)", "{a}.mean(-1, keepdim=True)", "{a}.amax(-1, keepdim=True)",
       "{a}.var(-1, keepdim=True)", "torch.logsumexp({a}, -1, keepdim=True)"]
SHAPED = ["torch.softmax({a}, -1)", "torch.log_softmax({a}, -1)", "F.layer_norm({a}, {a}.shape[-1:])",
          "{a} - {a}.mean(-1, keepdim=True)", "{a} * torch.rsqrt({a}.pow(2).mean(-1, keepdim=True) + 1e-6)"]
COLUMN = ["{a}.sum(0, keepdim=True)", "{a}.amax(0, keepdim=True)", "{a}.mean(0, keepdim=True)"]
VIEWS = ["torch.cat([{a}[..., 1:], {a}[..., :1]], -1)", "{a}.flip(0)", "({a}.t() * {c}).t()",
         "{a}.unsqueeze(0).expand(2, -1, -1).sum(0)", "{a}.roll(1, 0)",
         "torch.where({a} > 0, {a}, torch.zeros_like({a}))"]
MORE = ["torch.atan2({a}, {b})", "{a}.pow(3)", "torch.erf({a})", "F.softplus({a})", "F.elu({a})",
        "F.leaky_relu({a}, 0.1)", "torch.lerp({a}, {b}, 0.3)", "torch.addcmul({a}, {b}, {b}, value=0.5)",
        "{a}.masked_fill({a} < {b}, 0.0)", "({a} > {b}).to({a}.dtype)", "{a}.std(-1, keepdim=True)",
        "{a}.norm(dim=-1, keepdim=True)", "{a}.amin(-1, keepdim=True)", "{a}.argmax(-1, keepdim=True).to({a}.dtype)",
        "torch.cumsum({a}, -1)", "{a}.sort(-1).values", "{a}.clone().add_({b}).mul_({c})",
        "({a} @ {b}.t()).div(8).softmax(-1) @ {b}", "torch.nan_to_num(torch.log({a}))",
        "{a}.sign() * {a}.abs().pow(0.5)", "torch.floor({a} * 4) / 4", "{a} // 0.75", "torch.fmod({a}, 0.6)"]
CASTS = ["{a}.to(torch.float16).float()", "{a}.to(torch.bfloat16).float()"]  # bf16 on the GPU only: the
# interpreter truncates fp32 -> bf16 where eager rounds


# --mixed: the dtypes of y and w beside x's (bf16 beside fp32 on the GPU only: the interpreter truncates)
MIXED = {torch.float32: [torch.float16, torch.float64], torch.float64: [torch.float32, torch.float16],
         torch.float16: [torch.float32, torch.float16], torch.bfloat16: [torch.float32, torch.float16]}


def program(rng: random.Random, n_ops: int, dtype: torch.dtype, gpu: bool, more: int = 0) -> str:
    """Source of `def f(x, y, w):` (x [R, C], y [R, C], w [C]) built from random ops; values kept are
    full [R, C] tensors, row [R, 1] or column [1, C] ones, all broadcastable against each other."""
    casts = [CASTS if gpu else CASTS[:1]] if dtype == torch.float32 else []
    # (16-bit values tie often: an ulp's difference before a sort moves a gradient to another element)
    wide = dtype in (torch.float32, torch.float64)
    ordered = MORE if wide else [op for op in MORE if "sort" not in op and "argmax" not in op]
    pool = [UNARY] * 4 + [BINARY] * 4 + [ROW, SHAPED, COLUMN, VIEWS] + casts + [ordered] * more
    vals = ["x", "y", "w"]
    lines = []
    for i in range(n_ops):
        a, b = rng.choice(vals), rng.choice(vals)
        c = rng.choice(["0.5", "2.0", "-1.25", "3.0", "0.1"])
        expr = rng.choice(rng.choice(pool)).format(a=a, b=b, c=c)
        lines.append(f"    v{i} = {expr}")
        vals.append(f"v{i}")
    outs = rng.sample(vals[3:], k=min(len(vals) - 3, rng.randint(1, 3)))
    body = "\n".join(lines)
    return f"def f(x, y, w):\n{body}\n    return {', '.join(outs)},\n"


def build(source: str):
    scope = {"torch": torch, "F": torch.nn.functional}
    exec(compile(source, "<fuzz>", "exec"), scope)  # noqa: S102 - our own generated source
    return scope["f"]


def laid_out(t: torch.Tensor, how: str) -> torch.Tensor:
    """The same values as `t` in another layout: column-major, every other element of a wider buffer, or
    at an offset into a larger one (compiled kernels index by strides and storage offsets, not by shapes)."""
    if how == "transposed" and t.dim() == 2:
        return t.t().contiguous().t()
    if how == "strided":
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
        wide[..., ::2] = t
        return wide[..., ::2]
    if how == "offset":
        return torch.cat([t.reshape(-1)[:3], t.reshape(-1)])[3:].view(t.shape)
    return t


def run(fn, inputs, grad: bool):
    xs = [t.detach().requires_grad_(grad) for t in inputs]  # detach, not clone: keeps the inputs' layouts
    outs = fn(*xs)
    results = [o.detach() for o in outs]
    if grad:
        loss = sum((o.float() * (torch.arange(o.numel(), device=o.device).view(o.shape) * 0.37).cos()).sum()
                   for o in outs)
        grads = torch.autograd.grad(loss, xs, allow_unused=True)
        results += [g if g is not None else torch.zeros_like(x) for g, x in zip(grads, xs)]
    return results


SCALE_FLOOR = 1e-3  # inputs are ~1: a result below this is zero but for rounding (a mean of a normalised row)


def differs(got: torch.Tensor, want: torch.Tensor, ref: torch.Tensor, tol: float,
            floor: float = SCALE_FLOOR) -> str | None:
    """Why fxopt's `got` is wrong against eager's `want` and the float64 `ref`, or None: NaN/inf places must
    be eager's; values may be as far from ref as twice eager's error plus tol of ref's scale, at least
    `floor` (a result that is zero but for rounding compares noise with noise)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape/dtype {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}"
    g, w, r = got.double(), want.double(), ref.double()
    if bool(special_places_differ(g, w).any()):
        return "NaN/inf places differ"
    fin = g.isfinite() & w.isfinite() & r.isfinite()
    if not bool(fin.any()):
        return None
    scale = max(r[fin].abs().max().item(), floor)
    excess = ((g - r).abs() - 2 * (w - r).abs())[fin].max().item() / scale
    return f"error beyond eager's {excess:.3g} of scale {scale:.3g}" if excess > tol else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--programs", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ops", type=int, default=6, help="ops per program")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16", "bfloat16"],
                   help="bfloat16 only on a GPU (the interpreter truncates fp32 -> bf16)")
    p.add_argument("--dynamic", action="store_true", help="symbolic sizes; each program also runs a second shape")
    p.add_argument("--more", type=int, default=0, help="weight of the MORE ops (scans, sorts, matmuls, in-place...)")
    p.add_argument("--layouts", action="store_true", help="inputs transposed, strided or at a storage offset")
    p.add_argument("--mixed", action="store_true", help="y and w of other dtypes than x (type promotion)")
    args = p.parse_args(argv)
    importlib.import_module("fxopt")
    dtype = getattr(torch, args.dtype)
    tol = {torch.float32: 1e-4, torch.float64: 1e-9}
    bad = 0
    for k in range(args.programs):
        rng = random.Random(args.seed * 100003 + k)
        source = program(rng, args.ops, dtype, args.device != "cpu", args.more)
        fn = build(source)
        rows, cols = rng.choice([(4, 7), (9, 33), (16, 128), (3, 1000)])
        g = torch.Generator().manual_seed(k)
        dtypes = [dtype, *(MIXED[dtype] if args.mixed else [dtype, dtype])]
        # every result has one of the inputs' dtypes, and a float64 result of float16 values is float16-precise
        loosest = max(tol.get(d, 2e-2) for d in dtypes)
        inputs = [torch.randn(*shape, generator=g).to(d).to(args.device)
                  for shape, d in zip([(rows, cols), (rows, cols), (cols,)], dtypes)]
        if args.layouts:
            inputs = [laid_out(t, rng.choice(["contiguous", "transposed", "strided", "offset"])) for t in inputs]
        grad = rng.random() < 0.6
        torch._dynamo.reset()
        shapes = [inputs] + ([[t[:-1, :-2] if t.dim() == 2 else t[:-2] for t in inputs]]
                             if args.dynamic and rows > 2 and cols > 3 else [])
        try:
            expected = [(run(fn, s, grad), run(fn, [t.double() for t in s], grad)) for s in shapes]
        except RuntimeError:
            continue  # eager rejects it, or its float64 copy (a cast leaving float32 @ float64): nothing to compare
        try:
            compiled = torch.compile(fn, backend="fxopt", dynamic=args.dynamic)
            problems = []
            for shape_inputs, (want, ref) in zip(shapes, expected):
                got = run(compiled, shape_inputs, grad)
                problems += [(i, d) for i, (a, b, r) in enumerate(zip(got, want, ref))
                             if (d := differs(a, b, r, loosest))]
        except Exception as e:  # noqa: BLE001 - a crash is a finding
            problems = [("crash", f"{type(e).__name__}: {str(e)[:300]}")]
        if problems:
            bad += 1
            print(f"--- program {k} (seed {args.seed}, [{rows}, {cols}] {args.dtype}, backward {grad}): {problems}")
            print(source, flush=True)
    print(f"{args.programs} programs, {bad} mismatches or crashes ({args.device}, {args.dtype}, seed {args.seed}"
          f"{', dynamic' if args.dynamic else ''})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
