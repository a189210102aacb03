"""Combine functions of reduction kernels, and independent row sums reduced in one `tl.reduce`.

Max and min combine through `_fx_max`/`_fx_min`, which propagate NaN as torch does.

A persistent row kernel that needs several sums of one row, none feeding another (LayerNorm backward's
sum(dy * w) and sum(dy * w * xhat); RMSNorm backward's mean(x * x) and mean(g * x)), reduces them as
one tuple: `tl.reduce((a, b), 1, _fx_sum2)` lowers to one reduction tree whose cross-warp stage
(shared memory and barriers) is shared by every operand, where separate `tl.sum`s pay it once each.
The norm backwards walk their rows one after another per program, so that stage's latency is paid
on every row. `SumBatch` defers each such sum until a value needs it (or the rows end) and then
reduces the deferred ones together. GPU only: in the Triton interpreter a @triton.jit combine
function leaves triton.language patched (reduction_schedules.lane_reduce), so there each sum stays
a `tl.sum`. `BATCH_SUMS = False` turns it off (benchmarks/tune_reduction.py compares).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..analysis.reductions import reduction_info
from .dtypes import compute_dtype

BATCH_SUMS = True

MAX_MIN = '''
@triton.jit
def _fx_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _fx_min(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)
'''


def sum_combine(k: int) -> str:
    """`_fx_sumK`: the combine function of a K-tuple sum (left operands first, then right ones)."""
    left, right = [f"a{i}" for i in range(k)], [f"b{i}" for i in range(k)]
    sums = ", ".join(f"a{i} + b{i}" for i in range(k))
    return f"@triton.jit\ndef _fx_sum{k}({', '.join(left + right)}):\n    return {sums}\n"


def with_combines(source: str, body: list[str]) -> str:
    """`source` (a kernel) preceded by the combine functions its body calls."""
    helpers = [MAX_MIN.strip("\n")] if any("_fx_max" in line or "_fx_min" in line for line in body) else []
    sizes = sorted({int(tok[len("_fx_sum"):].split(")")[0]) for line in body
                    for tok in line.replace(",", " ").split() if tok.startswith("_fx_sum")})
    helpers += [sum_combine(k).strip("\n") for k in sizes]
    return "\n\n\n".join(helpers + [source]) if helpers else source


class SumBatch:
    """Row sums of a persistent body, deferred and reduced together (see the module docstring).

    `em` is the ReductionEmitter (its _reduced_value and _finish make the lines), `body` the list the
    lines go to."""

    def __init__(self, em, body: list[str]):
        self.em, self.body, self.pending = em, body, []
        self.on = BATCH_SUMS and em.target != "interpret"

    def defer(self, n: fx.Node) -> bool:
        """Keep n for a batched reduce (True), or leave it to the caller (False)."""
        info = reduction_info(n)
        if not self.on or info.kind not in ("sum", "mean") or compute_dtype(n.meta["val"].dtype) != torch.float32:
            return False
        self.pending.append(n)
        return True

    def before(self, n: fx.Node) -> None:
        """Reduce the deferred sums now if n reads one of them."""
        if self.pending and any(a in self.pending for a in n.all_input_nodes):
            self.flush()

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        if len(pending) == 1:
            n = pending[0]
            block, _, kind = self.em._reduced_value(n)
            self.body.append(self.em._finish(n, f"tl.sum({block}, 1)[:, None]", kind))
        elif pending:
            blocks = [self.em._reduced_value(n) for n in pending]
            names = [f"_{n.name}_row" for n in pending]
            self.body.append(f"{', '.join(names)} = tl.reduce(({', '.join(b for b, _, _ in blocks)},), 1, "
                             f"_fx_sum{len(pending)})  # {len(pending)} sums, one reduction tree")
            for n, name, (_, _, kind) in zip(pending, names, blocks):
                self.body.append(self.em._finish(n, f"{name}[:, None]", kind))
