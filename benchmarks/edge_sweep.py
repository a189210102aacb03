"""Differential sweep (a correctness tool, not a benchmark): fxopt against eager on the same device over
values where one rounding step or one device convention changes the answer.

Two families, each compared element by element with eager's result:
- `scalar`: bf16/fp16 tensors near the dtypes' rounding boundaries (fp16 4094..4098, bf16 254..258, the
  largest finite values) through ops that take a scalar bound, threshold or operand (threshold, hardtanh,
  clamp, comparisons, where, masked_fill, softplus, remainder, pow, addcdiv, ...) and the activations,
  forward and backward;
- `integer`: integer ops at their limits (shifts, wrapping products, division modes, casts), float casts of
  out-of-range values, NaN and infinities through casts, rounding, max/min and reductions, for every
  integer and float dtype;
- `rows`: row and column reductions (sums, means, variances, max/min, softmax, log-softmax, logsumexp,
  LayerNorm, RMSNorm, norms) over rows holding +-inf, NaN, all -inf, equal values, huge and tiny values, in
  fp32, fp16 and bf16, forward and backward. Orders of summation differ, so finite values are compared
  with the float64 result (`close`: fxopt may be closer than eager, not much further); where NaN and inf
  appear must match eager exactly.
Eager's CPU and CUDA kernels differ on some of these (a CPU add rounds its scalar to fp16, the CUDA one does
not; CUDA's threshold rounds the threshold, the CPU's does not), so run it on the device that matters.
`--rep N` tiles each vector N times: kernels then hold several elements per thread, which is where a
packed-bf16 miscompile of sign showed (2026-12-07: none of the 16-element cases caught it).

    python -m benchmarks.edge_sweep --family scalar --rep 256 [--shard 0/6]   # scalar | integer | rows | all
    TRITON_INTERPRET=1 python -m benchmarks.edge_sweep --device cpu     # the interpreter truncates
                                                                          # fp32 -> bf16: expect bf16 noise

A mismatch is a difference above `--ulps` units in the last place of the result's dtype (exact for
integers and booleans). Known, accepted differences: fxopt keeps 16-bit intermediates in fp32 (exp2 of
x * 1e-3 is 1.9 ulp from eager's, which rounds x * 1e-3 first; atan2's fp16 backward overflows in eager,
not in fxopt), and float sums of values 2^31 apart depend on the order of summation. Rows: a 16-bit
reduction result used inside its kernel stays fp32, so a fp16 sum or var eager overflows to inf can come
out finite once weighted; var_mean's mean of a row holding +-inf is inf (eager's Welford update gives NaN); a
row that cross_entropy ignores (ignore_index) gets a zero gradient even when it holds NaN (eager: NaN * 0);
eager's CUDA F.rms_norm makes a row holding +-inf all NaN, and eager's CPU gelu(+inf) is NaN (CUDA's: inf).
`--family params`: LayerNorm, RMSNorm and scalings with weight and bias gradients (column sums) over the
same rows. `--dynamic` compiles with symbolic sizes (block sizes picked per call).
"""
from __future__ import annotations

import argparse
import importlib
import sys

import torch
import torch.nn.functional as F

F16, BF16 = torch.float16, torch.bfloat16
NEAR_BOUNDS = {F16: [4094., 4096., 4098., 2.0, -4096., -4094., 0.5, -0.5, 1.0, 6.0, -3.0, 3.0, 65504., -65504.],
               BF16: [254., 256., 258., 2.0, -256., -254., 0.5, -0.5, 1.0, 6.0, -3.0, 3.0, 3.0e38, -3.0e38]}
BOUNDS = {F16: [4095., 4097., 4095.5, 2.0001], BF16: [255., 257., 255.5, 2.0001]}
EDGE_FLOATS = [0.0, -0.0, 1.5, -1.5, 2.5, -2.5, 1e10, -1e10, float("inf"), float("-inf"), float("nan"), 300.7,
               -300.7, 65504., 3e9, -3e9]
EDGE_INTS = [0, 1, -1, 7, -7, 2 ** 31 - 1, -2 ** 31, 255, 256, -129, 1 << 20, 40, 31, 33, -33, 5]


def _bounded(t: float):
    """Ops of one 16-bit tensor and one scalar bound t (t not representable in the dtype, mostly)."""
    return {
        "threshold": lambda x: F.threshold(x * 1, t, -7.3), "hardtanh": lambda x: F.hardtanh(x * 1, -t, t),
        "clamp": lambda x: torch.clamp(x * 1, min=-t, max=t), "clamp_min": lambda x: torch.clamp_min(x * 1, t),
        "le": lambda x: ((x * 1) <= t).float() + x * 0, "lt": lambda x: ((x * 1) < t).float() + x * 0,
        "eq": lambda x: ((x * 1) == t).float() + x * 0, "ne": lambda x: ((x * 1) != t).float() + x * 0,
        "where": lambda x: torch.where(x > 0, x * 1, t), "masked_fill": lambda x: (x * 1).masked_fill(x < 0, t),
        "softplus": lambda x: F.softplus(x * 1, beta=1.0, threshold=t), "add": lambda x: x * 1 + t,
        "sub_alpha": lambda x: torch.sub(x * 1, x, alpha=t), "mul": lambda x: x * t, "div": lambda x: (x * 1) / t,
        "remainder": lambda x: torch.remainder(x * 1, t), "fmod": lambda x: torch.fmod(x * 1, t),
        "nan_to_num": lambda x: torch.nan_to_num(x * float("inf"), posinf=t, neginf=-t),
        "floor_div": lambda x: torch.div(x * 1, t / 1000, rounding_mode="floor"),
        "trunc_div": lambda x: torch.div(x * 1, t / 1000, rounding_mode="trunc"),
        "addcdiv": lambda x: torch.addcdiv(x, x, x.abs() + 1, value=t / 1000),
        "addcmul": lambda x: torch.addcmul(x, x, x, value=1 / t), "lerp": lambda x: torch.lerp(x * 1, x * 0 + t, 0.3),
        "int_add": lambda x: (x * 1).int() + t, "int_le": lambda x: ((x * 1).int() <= t).float(),
        "pow": lambda x: (x.abs() * 1) ** (t / 1000), "rpow": lambda x: (t / 4000) ** (x * 1e-3),
        "copysign": lambda x: torch.copysign(x * 1, -t), "bool_where": lambda x: torch.where((x * 1) > t, 1.5, -t),
    }


ACTIVATIONS = {
    "leaky_relu": lambda x: F.leaky_relu(x * 1, 0.1), "elu": lambda x: F.elu(x * 1), "relu6": lambda x: F.relu6(x * 1),
    "hardsigmoid": lambda x: F.hardsigmoid(x * 1), "hardswish": lambda x: F.hardswish(x * 1),
    "gelu": lambda x: F.gelu(x * 1), "gelu_tanh": lambda x: F.gelu(x * 1, approximate="tanh"),
    "silu": lambda x: F.silu(x * 1), "mish": lambda x: F.mish(x * 1), "selu": lambda x: F.selu(x * 1),
    "softshrink": lambda x: F.softshrink(x * 1, 2.0001), "hardshrink": lambda x: F.hardshrink(x * 1, 2.0001),
    "tanhshrink": lambda x: F.tanhshrink(x * 1), "logsigmoid": lambda x: F.logsigmoid(x * 1),
    "round": lambda x: torch.round(x * 0.3), "sign": lambda x: torch.sign(x - 2), "abs": lambda x: (x * -1).abs(),
    "rsqrt": lambda x: torch.rsqrt(x.abs() + 1), "exp2": lambda x: torch.exp2(x * 1e-3),
    "sqrt_pow": lambda x: x.abs() ** 0.5, "reciprocal": lambda x: 1 / (x * 1),
}

INTEGER_OPS = {
    "shl": lambda a, b: a << (b.abs() % 40), "shr": lambda a, b: a >> (b.abs() % 40),
    "bits": lambda a, b: (a & b) | (a ^ 5),
    "not": lambda a, b: ~a, "floor_div": lambda a, b: torch.div(a, torch.where(b == 0, 3, b), rounding_mode="floor"),
    "trunc_div": lambda a, b: torch.div(a, torch.where(b == 0, 3, b), rounding_mode="trunc"),
    "remainder": lambda a, b: torch.remainder(a, torch.where(b == 0, 3, b)),
    "fmod": lambda a, b: torch.fmod(a, torch.where(b == 0, 3, b)),
    "true_div": lambda a, b: a / torch.where(b == 0, 3, b),
    "abs": lambda a, b: a.abs() - (-b), "mul_wrap": lambda a, b: a * b + 1, "pow": lambda a, b: a ** 2,
    "to_f16": lambda a, b: (a * 1).half(), "to_bf16": lambda a, b: (a * 1).bfloat16(),
    "to_u8": lambda a, b: (a * 1).to(torch.uint8), "to_i8": lambda a, b: (a * 1).to(torch.int8),
    "max_min": lambda a, b: torch.maximum(a, b) - torch.minimum(a, b), "sign": lambda a, b: torch.sign(a * 1),
    "clamp": lambda a, b: (a * 1).clamp(-100, 100), "sum": lambda a, b: (a * 1).sum(),
    "cumsum": lambda a, b: (a * 1).cumsum(0), "argmax": lambda a, b: (a * 1).argmax(),
}

FLOAT_EDGES = {
    **{f"to_{str(d)[6:]}": (lambda d: lambda x: (x * 1).to(d))(d)
       for d in (torch.int32, torch.int64, torch.int8, torch.uint8, torch.int16, torch.bool, F16, BF16)},
    "round": lambda x: torch.round(x * 1), "round_dec": lambda x: torch.round(x * 1, decimals=1),
    "floor_int": lambda x: (x * 1).floor().int(), "frac": lambda x: (x * 1).frac(), "sign": lambda x: (x * 1).sign(),
    "signbit": lambda x: (x * 1).signbit(), "nan_to_num": lambda x: (x * 1).nan_to_num(),
    "maximum": lambda x: torch.maximum(x * 1, x.flip(0)), "fmax": lambda x: torch.fmax(x * 1, x.flip(0)),
    "clamp": lambda x: (x * 1).clamp(-2, 2), "amax": lambda x: (x * 1).amax(), "argmax": lambda x: (x * 1).argmax(),
    "softmax": lambda x: torch.softmax((x * 1).nan_to_num(0, 0, 0), 0),
    "logsumexp": lambda x: torch.logsumexp(x * 1, 0),
    "remainder": lambda x: torch.remainder(x * 1, -2.5), "fmod": lambda x: torch.fmod(x * 1, -2.5),
    "div0": lambda x: (x * 1) / 0.0, "pow_neg": lambda x: (x * 1) ** -1.5,
    "pow_t": lambda x: torch.pow(x * 1, x.flip(0)),
}


ROW_OPS = {
    "sum": lambda x: x.sum(-1), "mean": lambda x: x.mean(-1), "var": lambda x: x.var(-1), "std": lambda x: x.std(-1),
    "var_mean": lambda x: torch.stack(torch.var_mean(x, -1)), "amax": lambda x: x.amax(-1),
    "amin": lambda x: x.amin(-1),
    "softmax": lambda x: torch.softmax(x, -1), "log_softmax": lambda x: torch.log_softmax(x, -1),
    "logsumexp": lambda x: torch.logsumexp(x, -1), "layer_norm": lambda x: F.layer_norm(x, x.shape[-1:]),
    "rms_norm": lambda x: x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype),
    "norm": lambda x: torch.linalg.vector_norm(x.float(), dim=-1), "centred": lambda x: x - x.mean(-1, keepdim=True),
    "col_sum": lambda x: x.sum(0), "col_amax": lambda x: x.amax(0), "col_softmax": lambda x: torch.softmax(x, 0),
    "cross_entropy": lambda x: F.cross_entropy(x, _targets(x), reduction="none"),  # fxopt's own loss kernels
    "cross_entropy_mean": lambda x: F.cross_entropy(x, _targets(x), ignore_index=1).reshape(1),
}


def _targets(x: torch.Tensor) -> torch.Tensor:
    return (torch.arange(x.shape[0], device=x.device) * 7) % x.shape[1]

PARAM_OPS = {  # op(x [rows, C], w [C], b [C]): norms and scalings whose w and b gradients are column sums
    "layer_norm": lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b),
    "rms_norm": lambda x, w, b: F.rms_norm(x, x.shape[-1:], w, 1e-6) + b,
    "rms_norm_by_hand": lambda x, w, b: (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6))
    .to(x.dtype) * w + b,
    "bias_gelu": lambda x, w, b: F.gelu(x + b) * w,
    "softmax_affine": lambda x, w, b: torch.softmax(x * w + b, -1),
    "row_dot": lambda x, w, b: (x * w).sum(-1, keepdim=True) * b,
}


def _weighted(op, weights):
    """op over the input scaled per column, its output weighted along its last dim by a non-affine weight:
    the backward of a softmax's or a normalised row's sum (or of an affine weighting of a normalised ramp)
    is zero but for rounding, so it would compare noise."""
    def fn(t, *params):
        out = op(t if weights is None else t * weights.to(t.dtype), *params)
        out = out * (torch.arange(out.shape[-1], device=out.device) * 0.7).cos().to(out.dtype)
        return out * (torch.arange(out.shape[0], device=out.device)[:, None] * 1.3).cos().to(out.dtype) \
            if out.dim() > 1 else out
    return fn


def _special_rows(dtype, cols: int, device: str) -> torch.Tensor:
    """Eight rows: random, all equal, one +inf, one -inf, all -inf, one NaN, huge, tiny."""
    g = torch.Generator().manual_seed(0)
    # huge and tiny, but finite and normal in the dtype, and their squares in fp32
    big, small = (3e3, 1e-3) if dtype == F16 else (1e15, 1e-15)
    rows = torch.randn(8, cols, generator=g, dtype=torch.float64) * 3
    rows[1] = 2.5
    rows[2, cols // 3] = float("inf")
    rows[3, cols // 2] = float("-inf")
    rows[4] = float("-inf")
    rows[5, cols // 4] = float("nan")
    rows[6] *= big / 3
    rows[7] *= small
    return rows.to(dtype).to(device)


def _row_sets(device: str, rep: int):
    """(label, edge rows tiled `rep` times, a column ramp) for each dtype and row width the row families use."""
    for dt in (torch.float32, F16, BF16):
        for cols in (37, 3000):
            x = _special_rows(dt, cols, device).repeat(rep, 1)
            yield f"{str(dt)[6:]} [{8 * rep}, {cols}]", x, torch.linspace(-1, 2, cols, device=device)


def cases(family: str, device: str, rep: int):
    """(name, fn, inputs, backward?) for every case of the family."""
    if family == "scalar":
        for dt in (F16, BF16):
            x = torch.tensor(NEAR_BOUNDS[dt], dtype=dt, device=device).repeat(rep)
            ops = {f"{k}{t}": f for t in BOUNDS[dt] for k, f in _bounded(t).items()} | ACTIVATIONS
            for name, fn in ops.items():
                for grad in (False, True):
                    yield f"{str(dt)[6:]} {name}{' backward' if grad else ''}", fn, (x,), grad
        return
    if family == "rows":
        for label, x, weights in _row_sets(device, rep):
            for name, op in ROW_OPS.items():
                fn = _weighted(op, None if name.startswith("col") else weights)
                for grad in (False, True):
                    yield f"{label} {name}{' backward' if grad else ''}", fn, (x,), grad
        return
    if family == "params":
        for label, x, weights in _row_sets(device, rep):
            w = weights.to(x.dtype)
            b = (torch.arange(x.shape[1], device=device) * 0.37).sin().to(x.dtype)
            for name, op in PARAM_OPS.items():
                yield f"{label} {name} backward", _weighted(op, None), (x, w, b), True
        return
    for it in (torch.int32, torch.int64, torch.int16, torch.uint8, torch.int8):
        info = torch.iinfo(it)
        a = torch.tensor([min(max(v, info.min), info.max) for v in EDGE_INTS], dtype=it, device=device).repeat(rep)
        for name, fn in INTEGER_OPS.items():
            yield f"{str(it)[6:]} {name}", fn, (a, a.flip(0)), False
    for ft in (torch.float32, F16, BF16):
        x = torch.tensor(EDGE_FLOATS, dtype=ft, device=device).repeat(rep)
        for name, fn in FLOAT_EDGES.items():
            yield f"{str(ft)[6:]} {name}", fn, (x,), False


def _outputs(fn, inputs, grad: bool) -> list:
    xs = [x.clone().requires_grad_(grad) for x in inputs]
    out = fn(*xs)
    if grad and out.requires_grad:
        out.float().sum().backward()
        return [out.detach(), *(x.grad for x in xs)]
    return [out.detach()]


def ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference in units of the result dtype's last place (inf where dtypes or NaNs differ)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return float("inf")
    if not want.is_floating_point():
        return 0.0 if torch.equal(got, want) else float("inf")
    g, w = got.double(), want.double()
    same = (g == w) | (g.isnan() & w.isnan())
    if bool(same.all()):
        return 0.0
    if bool((g.isnan() != w.isnan()).any() or ((g.isinf() | w.isinf()) & ~same).any()):
        return float("inf")
    info = torch.finfo(want.dtype)
    step = info.eps * w.abs().clamp_min(info.tiny)
    return ((g - w).abs() / step)[~same].max().item()


def special_places_differ(g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Where g and w (same shape) disagree on being NaN, or where either is +-inf and they are not equal."""
    return (g.isnan() != w.isnan()) | ((g.isinf() | w.isinf()) & (g != w))


def close(got: torch.Tensor, want: torch.Tensor, ref: torch.Tensor, per_row: bool = True) -> float:
    """For reductions: inf where dtypes, shapes or the places of NaN and +-inf differ from eager's; else
    fxopt's largest distance from the float64 reference beyond twice eager's, over (|ref| + the largest
    finite |ref| of its row, or of all), in units of a tolerance per dtype. fxopt may be closer to the
    reference than eager (it rounds fewer intermediates), never much further."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return float("inf")
    g, w, r = got.double(), want.double(), ref.double()
    if bool(special_places_differ(g, w).any()):
        return float("inf")
    finite = g.isfinite() & r.isfinite()
    if not bool(finite.any()):
        return 0.0
    zero = torch.zeros_like(r)
    scale = r.abs().where(finite, zero)
    scale = scale.amax(-1, keepdim=True) if scale.dim() > 1 and per_row else scale.amax()
    info = torch.finfo(want.dtype)
    tol = {torch.float32: 1e-5, F16: 2e-3, BF16: 1.6e-2}.get(want.dtype, 1e-5)
    excess = (g - r).abs() - 2 * (w - r).abs().where(w.isfinite(), zero)
    err = excess / ((r.abs() + scale) * tol + 8 * info.eps * info.tiny)  # (a few subnormal steps)
    return err[finite].max().item()


def first_difference(got: torch.Tensor, want: torch.Tensor) -> str:
    """Where got and want first differ in the place of NaN or +-inf (else in value): index and both values."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"dtype/shape {got.dtype} {tuple(got.shape)} vs {want.dtype} {tuple(want.shape)}"
    g, w = got.double(), want.double()
    special = special_places_differ(g, w)
    differs = special if bool(special.any()) else ~((g == w) | (g.isnan() & w.isnan()))
    if not bool(differs.any()):
        return "equal"
    idx = tuple(int(i) for i in differs.nonzero()[0])
    return f"{int(differs.sum())} differ{' in NaN/inf' if bool(special.any()) else ''}; first at {idx}: " \
           f"got {g[idx].item()!r}, want {w[idx].item()!r}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=["scalar", "integer", "rows", "params", "all"], default="all")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rep", type=int, default=1, help="tile every input vector this many times")
    p.add_argument("--shard", default="0/1", help="i/n: run every n-th case from the i-th")
    p.add_argument("--ulps", type=float, default=1.0, help="tolerance for float results (default 1 ulp)")
    p.add_argument("--only", default="", help="run only the cases whose name contains this text")
    p.add_argument("--dynamic", action="store_true", help="compile with symbolic sizes (per-call block sizes)")
    args = p.parse_args(argv)
    importlib.import_module("fxopt")  # registers the backend
    shard, shards = (int(v) for v in args.shard.split("/"))
    families = ["scalar", "integer", "rows", "params"] if args.family == "all" else [args.family]
    total = bad = 0
    for family in families:
        for i, (name, fn, inputs, grad) in enumerate(cases(family, args.device, args.rep)):
            if i % shards != shard or args.only not in name:
                continue
            total += 1
            torch._dynamo.reset()
            try:
                want = _outputs(fn, inputs, grad)
            except RuntimeError:
                continue  # eager raises too (an integer op without a derivative): nothing to compare
            try:
                got = _outputs(torch.compile(fn, backend="fxopt", dynamic=args.dynamic), inputs, grad)
                if family in ("rows", "params"):
                    ref = _outputs(fn, [x.double() for x in inputs], grad)
                    worst = max(close(g, w, r, per_row=" col_" not in name) for g, w, r in zip(got, want, ref))
                else:
                    worst = max(ulps(g, w) for g, w in zip(got, want))
            except Exception as e:  # noqa: BLE001  (a crash is a finding)
                bad += 1
                print(f"ERROR {family} {name}: {type(e).__name__}: {str(e)[:300]}")
                continue
            if worst > args.ulps:
                bad += 1
                unit = "tolerances" if family in ("rows", "params") else "ulp"
                print(f"MISMATCH {family} {name}: {worst:.3g} {unit}\n  got  {got[-1].flatten()[:16].tolist()}"
                      f"\n  want {want[-1].flatten()[:16].tolist()}")
                for k, (g, w) in enumerate(zip(got, want)):
                    print(f"  output {k}: {first_difference(g, w)}")
    print(f"{total} cases, {bad} mismatches or errors (shard {args.shard}, rep {args.rep}, {args.device}"
          f"{', dynamic' if args.dynamic else ''})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
