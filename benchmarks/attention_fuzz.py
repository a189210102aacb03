"""Random hand-written attention, compiled by fxopt and compared with eager, forward and backward: a search for
wrong results of the attention matcher (fxopt/passes/attention_match.py), whose mistakes are silent (a site
fused as an op that computes something else returns plausible numbers). The tests (tests/attention/
test_match_*.py, test_hf_blocks.py, ...) check fixed spellings; this composes them at random: [B,H,T,D] or
[B,T,H,D] layouts, @ / matmul / bmm scores, scales on the scores, on q, split over q and k or none, causal
masks (tril/triu fills, full(-inf).triu added, where on a tril buffer; -inf, finfo.min or -65504), additive
and bool mask inputs (key padding or full; some mask whole rows), softmax spellings, fp32 softmax cast back,
do-nothing dropout, grouped-query repeats, queries shorter than keys; and, at `--near-misses` rate, one
spelling that is not the fused op's math (softmax over queries, a finite fill then scaled, the scores also
returned, a mask from the scores, a NaN fill, kv heads tiled, v scaled, ...): unfused, or fused and equal to
eager. A failure prints the program as Python (f, and `inputs` building its tensors), ready for a test.

    TRITON_INTERPRET=1 PYTHONPATH=. python -m benchmarks.attention_fuzz --programs 50 [--seed 0] [--dtype float16]
    PYTHONPATH=. python -m benchmarks.attention_fuzz --device cuda --programs 500 --dtype bfloat16   # on a GPU

On the CPU the fused op runs fxopt's Triton kernels only under TRITON_INTERPRET=1; bfloat16 is refused there
(the interpreter computes tl.dot on bf16 wrongly). A MISMATCH is an output, or a q/k/v gradient of the outputs
times a fixed random weight, whose NaN/inf places differ from eager's or whose distance from the float64
result (inputs .double()) exceeds twice eager's plus the dtype's tolerance of the result's scale
(graph_fuzz.differs: fp32 1e-4, fp16/bf16 2e-2; a gradient's scale is at least a tenth of the program's
largest gradient: dq is zero but for rounding when each row keeps one key). Gradients are not compared where
eager's hold NaN (rows masked with -inf everywhere; --nan-grads does). A CRASH is fxopt raising where eager
runs. The README's known differences (Attention: a causal finite fill beside a padding input, in rows whose
visible keys are all masked: (1) dq and dk; (2), (3) any output beside an additive finfo.min padding) count
apart, if finite (--strict counts them). Sites:
the compile's Report (what fxopt.explain(f, *inputs).attention lists). Exit 1 on a mismatch or crash.
"""
from __future__ import annotations

import argparse
import collections
import importlib
import os
import random
import re
import sys
import time
import warnings

import torch

from benchmarks.graph_fuzz import SCALE_FLOOR, build, differs

TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}
NEAR_MISSES = ["softmax over queries", "finite fill scaled after", "scores returned", "probs returned",
               "mask from values", "nan fill", "kv tiled", "v scaled", "bool mask added", "top-left causal",
               "diagonal masked", "max subtracted", "scores rounded to fp16", "head dim 8", "probs scaled"]
MASK_NEAR_MISSES = {"finite fill scaled after", "mask from values", "nan fill", "bool mask added", "top-left causal",
                    "diagonal masked"}  # (the others leave the masks as they are: the known differences stand)
FILLS = {"-inf": 'float("-inf")', "finfo": "torch.finfo(s.dtype).min", "-65504": "-65504.0", "-1e4": "-1e4",
         "nan": 'float("nan")'}
HEADER = "import math\n\nimport torch\nimport torch.nn.functional as F\n\n\n"


class _Program:
    """The random choices of one program, written as source lines of f and of inputs(dtype, device)."""

    def __init__(self, rng: random.Random, dtype: torch.dtype, near_misses: float):
        self.rng, r, self.f = rng, rng, []
        near = r.choice(NEAR_MISSES) if r.random() < near_misses else None
        self.near = near = None if near == "scores rounded to fp16" and dtype != torch.float32 else near
        self.b, self.hq = r.choice([1, 2]), r.choice([1, 2, 4])
        self.hkv = r.choice([h for h in (1, 2, 4) if self.hq % h == 0]) if r.random() < 0.4 else self.hq
        self.hq, self.hkv = (4, r.choice([1, 2])) if near == "kv tiled" else (self.hq, self.hkv)
        self.tk = r.randint(5, 24)
        self.tq = r.randint(1, 4) if near == "top-left causal" or r.random() < 0.3 else self.tk
        self.d = 8 if near == "head dim 8" else r.choice([16, 16, 16, 32])
        self.bthd = r.random() < 0.3
        self.bmm = r.random() < 0.15 and not (self.hkv == 1 < self.hq and near != "kv tiled")
        self.mask = "bool" if near == "bool mask added" else r.choice([None, None, "additive", "bool"])
        self.mask_rows = r.random() < 0.35  # [B, 1, Tq, Tk] (else key padding [B, 1, 1, Tk])
        self.pattern = r.choice(["right", "left", "random", "random", "empty"])
        self.mask_fill = r.choice(["-inf", "finfo"])
        self.causal = r.choice([None, "tril", "triu", "full_add", "where_buffer", "window"]) \
            if r.random() < 0.55 else None
        if near in ("top-left causal", "diagonal masked", "nan fill") or (near == "finite fill scaled after"
                                                                           and not self.causal):
            self.causal = "tril" if near == "finite fill scaled after" else near
        self.fill = {"nan fill": "nan", "finite fill scaled after": r.choice(["-1e4", "finfo", "-65504"])}.get(
            near, r.choice(["-inf", "-inf", "finfo", "-65504"]))
        # README, Attention, known differences in rows whose visible keys a padding input masks, beside a causal
        # finite fill: (1) their dq and dk, (2) and (3) all of them beside an additive finfo.min padding
        finite = self.causal in ("tril", "triu", "where_buffer", "window", "full_add") and self.fill != "-inf"
        additive_finite = self.mask == "additive" and self.mask_fill == "finfo"
        self.known = () if not finite or near in MASK_NEAR_MISSES else ("out0", "dq", "dk", "dv") \
            if additive_finite else ("dq", "dk") if self.mask in ("bool", "additive") else ()

    # ------------------------------------------------------------------ f(q, k, v[, mask])

    def source(self) -> str:
        r, near, f = self.rng, self.near, self.f
        if self.bthd:
            f.append("q, k, v = q{0}, k{0}, v{0}".format(r.choice([".transpose(1, 2)", ".permute(0, 2, 1, 3)"])))
        f.append(r.choice(["b, h, tq, d = q.shape", "b, h, tq, d = q.size()"]))
        f.append(r.choice(["tk = k.shape[-2]", "tk = k.size(2)"]))
        self._kv_heads()
        if self.bmm:
            f.append("q, k, v = (x.reshape(b * h, x.shape[-2], d) for x in (q, k, v))")
            if self.mask:
                f.append("mask = mask.expand(-1, h, -1, -1).reshape(b * h, mask.shape[-2], tk)")
        scale_mode = r.choice(["none", "scores", "scores", "scores", "full", "q", "split"])
        after = near == "finite fill scaled after" or (scale_mode == "scores" and r.random() < 0.2)
        scale_mode = "scores" if near == "finite fill scaled after" else scale_mode
        kt = self._operand_scales(scale_mode)
        rank3 = self.bmm
        if kt:
            f.append(f"s = {'torch.bmm(q, kt)' if rank3 else r.choice(['q @ kt', 'torch.matmul(q, kt)'])}")
        elif rank3:
            f.append(r.choice(["s = torch.bmm(q, k.transpose(1, 2))", "s = q @ k.transpose(-1, -2)"]))
        else:
            f.append("s = " + r.choice(["q @ k.transpose(-2, -1)", "torch.matmul(q, k.mT)", "q @ k.transpose(2, 3)",
                                        "torch.matmul(q, k.permute(0, 1, 3, 2))", "q @ k.transpose(-1, -2)"]))
        early_cast = r.random() < 0.25
        if early_cast:
            f.append("s = s.float()")
        if scale_mode in ("scores", "full") and not after:
            self._score_scale(scale_mode)
        for step in r.sample([self._causal, self._input_mask], 2):
            step()
        if after:
            self._score_scale(scale_mode, c="1e-3" if near == "finite fill scaled after" else None)
        f.extend({"mask from values": ["s = s.masked_fill(s < 0, float('-inf'))"],
                  "max subtracted": ["s = s - s.amax(-1, keepdim=True)"],
                  "scores rounded to fp16": ["s = s.half().float()"]}.get(near, []))
        self._softmax(early_cast)
        if near == "probs scaled":
            f.append("p = p * 2.0")
        pv = "(v * 0.5)" if near == "v scaled" else "v"
        f.append(f"o = {r.choice([f'p @ {pv}', f'torch.matmul(p, {pv})'] + [f'torch.bmm(p, {pv})'] * rank3)}")
        if rank3:
            f.append("o = o.view(b, h, tq, d)")
        if self.bthd or r.random() < 0.3:
            f.append(r.choice(["o = o.transpose(1, 2).reshape(b, tq, h * d)",
                               "o = o.transpose(1, 2).contiguous().view(b, tq, -1)"]))
        f.append("return " + {"scores returned": "o, s", "probs returned": "o, p"}.get(near, "o"))
        args = "q, k, v, mask" if self.mask else "q, k, v"
        body = "\n".join(f"    {line}" for line in f)
        return f"{HEADER}def f({args}):\n{body}\n\n\n{self._inputs()}"

    def _kv_heads(self):
        g, r = self.hq // self.hkv, self.rng
        if g == 1:
            return  # "tile": heads 0, 1, 0, 1 where grouped-query attention has 0, 0, 1, 1
        how = "tile" if self.near == "kv tiled" else r.choice(["interleave", "repeat_kv", "broadcast"][
            :2 + (self.hkv == 1 and not self.bmm)])
        self.f += {"interleave": [f"k, v = k.repeat_interleave({g}, dim=1), v.repeat_interleave({g}, dim=1)"],
                   "repeat_kv": [f"k, v = (x[:, :, None].expand(b, {self.hkv}, {g}, tk, d).reshape(b, h, tk, d) "
                                 "for x in (k, v))"],
                   "tile": [f"k, v = k.repeat(1, {g}, 1, 1), v.repeat(1, {g}, 1, 1)"]}.get(how, [])

    def _operand_scales(self, mode) -> bool:
        """Scales on q and k; True when the scores read `kt` (k transposed, then scaled)."""
        r, f = self.rng, self.f
        if mode == "q":
            f.append(r.choice(["q = q * d ** -0.5", "q = q / math.sqrt(d)", "q = q * 0.3"]))
        if mode != "split":
            return False
        f.append("q = q * d ** -0.25")
        if r.random() < 0.5:
            f.append("k = k * d ** -0.25")
            return False
        f.append(f"kt = k.transpose({'1, 2' if self.bmm else '-2, -1'}) * d ** -0.25")
        return True

    def _score_scale(self, mode, c=None):
        r = self.rng
        if mode == "full":
            self.f.append("s = s / torch.full([], d ** 0.5, dtype=s.dtype, device=s.device)")
        elif c is not None or r.random() < 0.6:
            c = c or r.choice(["(1.0 / math.sqrt(d))", "d ** -0.5", "0.3", "2.0"])
            self.f.append(r.choice([f"s = s * {c}", f"s = {c} * s", f"s = torch.mul(s, {c})"]))
        else:
            self.f.append(f"s = s{r.choice([' / math.sqrt(d)', ' / d ** 0.5', '.div(8.0)', ' / 0.7'])}")

    def _causal(self):
        kind, fill = self.causal, FILLS[self.fill]
        ones = "torch.ones(tq, tk, dtype=torch.bool, device=q.device)"
        lines = {
            "tril": ["keep = torch.tril(torch.ones(tk, tk, dtype=torch.bool, device=q.device))[tk - tq:]",
                     f"s = s.masked_fill({self.rng.choice(['~keep', 'keep == 0', 'keep.logical_not()'])}, {fill})"],
            "triu": [f"s = s.masked_fill(torch.triu({ones}, diagonal=tk - tq + 1), {fill})"],
            "full_add": [f"s = s + torch.full((tq, tk), {FILLS['-inf' if self.fill == '-inf' else 'finfo']}, "
                         "dtype=s.dtype, device=s.device).triu(tk - tq + 1)"],
            "where_buffer": ["bias = torch.tril(torch.ones(32, 32, dtype=torch.bool, device=q.device))",
                             f"s = torch.where(bias[tk - tq:tk, :tk], s, {fill})"],
            "window": [f"keep = torch.tril({ones}, diagonal=tk - tq) & torch.triu({ones}, diagonal=tk - tq - 3)",
                       f"s = s.masked_fill(~keep, {fill})"],
            "top-left causal": [f"s = s.masked_fill({ones}.triu(1), {fill})"],  # eager keeps keys <= the row
            "diagonal masked": [f"s = s.masked_fill({ones}.triu(tk - tq), {fill})"],  # first rows see nothing
            "nan fill": [f"s = s.masked_fill(~torch.tril({ones}, diagonal=tk - tq), {fill})"],
        }.get(kind, [])
        self.f += lines

    def _input_mask(self):
        r, fill = self.rng, FILLS[self.fill if self.near in ("nan fill", "finite fill scaled after") else "-inf"]
        if not self.mask:
            return
        if self.mask == "additive" or self.near == "bool mask added":
            self.f.append(r.choice(["s = s + mask", "s = mask + s"]))
        else:
            fill = r.choice([fill, FILLS["finfo"]])
            self.f.append(r.choice([f"s = s.masked_fill(~mask, {fill})", f"s = torch.where(mask, s, {fill})",
                                    f"s = s.masked_fill(mask.logical_not(), {fill})"]))

    def _softmax(self, early_cast: bool):
        r, dim = self.rng, "-2" if self.near == "softmax over queries" else "-1"
        late_cast = not early_cast and r.random() < 0.3
        src = "s.float()" if late_cast else "s"
        if not (early_cast or late_cast) and r.random() < 0.15:
            self.f.append(f"p = F.softmax(s, dim={dim}, dtype=torch.float32).to(v.dtype)")
        else:
            spelled = r.choice([f"torch.softmax({src}, {dim})", f"F.softmax({src}, dim={dim})",
                                f"{src}.softmax({dim})", f"{src}.softmax(dim={dim})"])
            back = r.choice([".to(q.dtype)", ".type_as(v)", ".to(v.dtype)"]) if early_cast or late_cast else ""
            self.f.append(f"p = {spelled}{back}")
        self.f += [f"p = {d}" for d in r.sample(["F.dropout(p, 0.1, training=False)", "F.dropout(p, p=0.0)",
                                                  "torch.dropout(p, 0.0, True)"], r.choice([0, 0, 1]))]

    # ------------------------------------------------------------------ inputs(dtype, device)

    def _inputs(self) -> str:
        r, b, tq, tk, d = self.rng, self.b, self.tq, self.tk, self.d
        shape = (lambda h, t: f"{b}, {t}, {h}, {d}") if self.bthd else (lambda h, t: f"{b}, {h}, {t}, {d}")
        lines = [f"g = torch.Generator().manual_seed({r.randrange(10 ** 6)})"]
        lines += [f"{x} = torch.randn({shape(h, t)}, generator=g)"
                  for x, h, t in (("q", self.hq, tq), ("k", self.hkv, tk), ("v", self.hkv, tk))]
        out = "q, k, v"
        if self.mask:
            rows = tq if self.mask_rows else 1
            lines.append(f"keep = torch.ones({b}, 1, {rows}, {tk}, dtype=torch.bool)")
            cut = r.randint(1, tk - 1)
            lines.append({"right": f"keep[-1, ..., {cut}:] = False", "left": f"keep[-1, ..., :{cut}] = False",
                          "random": f"keep = torch.rand({b}, 1, {rows}, {tk}, generator=g) > 0.3\n"
                                    "keep[..., 0] = True",
                          "empty": f"keep[-1, :, {r.randrange(rows)}] = False  # a query row sees no key"}
                         [self.pattern])
            fill = {"-inf": 'float("-inf")', "finfo": "torch.finfo(dtype).min"}[self.mask_fill]
            lines.append("mask = keep" if self.mask == "bool" else
                         f"mask = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, {fill})")
            out += ", mask"
        lines.append(f"return [x.to(dtype).to(device) if x.is_floating_point() else x.to(device) for x in ({out})]")
        body = "\n".join(f"    {x}" for line in lines for x in line.split("\n"))
        return f"def inputs(dtype, device):\n{body}\n"


def program(rng: random.Random, dtype: torch.dtype, near_misses: float = 0.3) -> tuple[str, str | None, bool]:
    """(source of f(q, k, v[, mask]) and inputs(dtype, device), its near miss or None, its `known`)."""
    p = _Program(rng, dtype, near_misses)
    return p.source(), p.near, p.known


def run(fn, inputs, grad: bool) -> list[torch.Tensor]:
    """The outputs of fn, then (with grad) the gradients of q, k and v of sum(output * a fixed weight)."""
    xs = [t.detach().requires_grad_(grad and i < 3) for i, t in enumerate(inputs)]
    outs, g = fn(*xs), torch.Generator().manual_seed(7)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    if not grad:
        return [o.detach() for o in outs]
    loss = sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device)).sum() for o in outs)
    grads = torch.autograd.grad(loss, xs[:3], allow_unused=True)
    return [o.detach() for o in outs] + [gr if gr is not None else torch.zeros_like(x) for gr, x in zip(grads, xs)]


def judge(got, want, ref, tol: float, floor: float = SCALE_FLOOR) -> str | None:
    """graph_fuzz.differs with the result's scale at least `floor`: a gradient of the same loss as others
    (dq when every row keeps one key: the softmax's gradient cancels to zero) carries their rounding noise."""
    why = differs(got, want, ref, tol, max(floor, SCALE_FLOOR))
    return why and (f"{why} (the program's gradients' scale)" if floor > SCALE_FLOOR else why)


def _largest(ts) -> float:
    return max((t.double()[t.isfinite()].abs().max().item() for t in ts if bool(t.isfinite().any())), default=0.0)


def fxopt_compile(fn, report):
    """torch.compile through fxopt, its attention sites recorded in `report` (as fxopt.explain does)."""
    from fxopt.backend import compile_dynamo_graph
    from fxopt.options import Options
    return torch.compile(fn, backend=lambda gm, ex: compile_dynamo_graph(gm, ex, Options.from_kwargs(), report),
                         dynamic=False)


class Outcome:
    """problems: [(what, why)] (("crash", message) for a crash); sites: fxopt's AttentionSite records; skipped:
    why eager rejects the program; known: finite differences only, in a program of a kind the README lists."""
    def __init__(self, skipped: str | None = None, backward_compared: bool = False):
        self.problems, self.sites, self.skipped, self.known, self.backward = [], [], skipped, False, backward_compared


def check(source: str, dtype: torch.dtype, device: str, grad: bool, compile_fn=fxopt_compile,
          nan_grads: bool = False, known=()) -> Outcome:
    """Compile f of `source` (compile_fn(f, report)) and compare with eager in dtype and in float64; the
    gradients only where eager's hold no NaN, unless nan_grads (then their NaN places must be eager's)."""
    from fxopt.report import Report

    fn = build(source)
    inputs = fn.__globals__["inputs"](dtype, device)
    try:
        want = run(fn, inputs, grad)
        ref = run(fn, [t.double() if t.is_floating_point() else t for t in inputs], grad)
    except RuntimeError as e:
        return Outcome(skipped=f"eager: {str(e).splitlines()[0][:100]}")
    n_out = len(want) - 3 * grad
    compare = len(want) if grad and (nan_grads or not any(bool(t.isnan().any()) for t in want[n_out:])) else n_out
    names = [f"out{i}" for i in range(n_out)] + ["dq", "dk", "dv"]
    out = Outcome(backward_compared=compare > n_out)
    report = Report()
    torch._dynamo.reset()
    try:
        got = run(compile_fn(fn, report), inputs, grad)
        floor = 0.1 * _largest(ref[n_out:compare])  # (0 when gradients are not compared)
        out.problems = [(names[i], why) for i in range(compare)
                        if (why := judge(got[i], want[i], ref[i], TOL[dtype], floor if i >= n_out else 0))]
        out.known = bool(out.problems) and all(w in known and "NaN/inf" not in why for w, why in out.problems)
    except Exception as e:  # noqa: BLE001 - a crash is a finding
        out.problems = [("crash", f"{type(e).__name__}: {str(e)[:300]}")]
    out.sites = list(report.attention)
    return out


def reason_kind(reason: str) -> str:
    """A reason without node names and numbers, so that equal reasons count together."""
    return re.sub(r"'[^']*'|\([a-z_0-9]+\)|\[[^\]]*\]|-?\d[\d.e+-]*", "_", reason or "?")[:90]


class Summary:
    def __init__(self):
        self.programs = self.skipped = self.fused = self.unfused = self.no_site = self.backward = 0
        self.bad, self.reasons, self.seconds = [], collections.Counter(), []  # bad: (index, mismatch|crash|known)


def fuzz(device: str, programs: int, seed: int, dtype: torch.dtype, backward: bool = True,
         near_misses: float = 0.3, nan_grads: bool = False, strict: bool = False, out=print) -> Summary:
    """Run `programs` random programs; failures are printed through `out` as they come."""
    summary = Summary()
    for n in range(programs):
        rng, start = random.Random(seed * 100003 + n), time.perf_counter()
        source, near, known = program(rng, dtype, near_misses)
        grad = backward and rng.random() < 0.75
        res = check(source, dtype, device, grad, nan_grads=nan_grads, known=() if strict else known)
        summary.seconds.append(time.perf_counter() - start)
        summary.programs, summary.skipped = summary.programs + 1, summary.skipped + bool(res.skipped)
        if res.skipped:
            continue
        summary.backward += res.backward
        summary.fused += sum(s.fused for s in res.sites)
        summary.unfused += sum(not s.fused for s in res.sites)
        summary.reasons.update(reason_kind(s.reason) for s in res.sites if not s.fused)
        summary.no_site += not res.sites
        if res.problems:
            kind = "crash" if res.problems[0][0] == "crash" else "known" if res.known else "mismatch"
            summary.bad.append((n, kind))
            sites = "; ".join(f"fused ({', '.join(s.recognised)})" if s.fused else f"unfused: {s.reason}"
                              for s in res.sites) or "no site"
            out(f"--- {kind.upper()} program {n} (seed {seed}, {dtype}, near miss {near}, backward {grad}): "
                f"{res.problems}\n# attention: {sites}\n{source}")
    return summary


def report_text(s: Summary, args) -> str:
    mism, known = (sum(k == kind for _, k in s.bad) for kind in ("mismatch", "known"))
    lines = [f"{s.programs} programs ({args.device}, {args.dtype}, seed {args.seed}): {s.fused} sites fused, "
             f"{s.unfused} unfused, {s.no_site} programs without a site, {s.skipped} rejected by eager; backward "
             f"compared in {s.backward}; {mism} mismatches, {len(s.bad) - mism - known} crashes, {known} known "
             "differences (README, Attention: rows whose visible keys are all masked)",
             f"seconds per program: mean {sum(s.seconds) / max(len(s.seconds), 1):.2f}, "
             f"max {max(s.seconds, default=0):.2f}"]
    lines += [f"  unfused x{c}: {r}" for r, c in s.reasons.most_common(8)]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    for name, default in (("--programs", 50), ("--seed", 0)):
        p.add_argument(name, type=int, default=default)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--no-backward", action="store_true", help="forward only")
    p.add_argument("--near-misses", type=float, default=0.3, help="share of programs holding a near miss")
    p.add_argument("--nan-grads", action="store_true",
                   help="compare gradients where eager's hold NaN too (rows masked entirely): NaN places must match")
    p.add_argument("--strict", action="store_true", help="count the README's known differences as mismatches")
    args = p.parse_args(argv)
    if args.dtype == "bfloat16" and args.device == "cpu":
        p.error("--dtype bfloat16 needs --device cuda: the Triton interpreter computes tl.dot on bf16 wrongly")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("note: TRITON_INTERPRET is not 1: fused sites run fxopt's torch reference", file=sys.stderr)
    importlib.import_module("fxopt")  # registers the fused op
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton")  # the interpreter's numpy on -inf
    summary = fuzz(args.device, args.programs, args.seed, getattr(torch, args.dtype), not args.no_backward,
                   args.near_misses, args.nan_grads, args.strict, out=lambda text: print(text, flush=True))
    print(report_text(summary, args))
    return 1 if any(kind != "known" for _, kind in summary.bad) else 0


if __name__ == "__main__":
    sys.exit(main())
