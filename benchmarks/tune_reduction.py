"""Try launch configurations of fxopt's reduction kernels on the GPU, per workload.

    PYTHONPATH=. python -m benchmarks.tune_reduction [workload ...]

Each candidate (XBLOCK, RBLOCK, num_warps) replaces ReductionEmitter._config while compiling; the
fastest is what fxopt/codegen/triton_reduction.py's heuristics should pick. For the norm backwards,
whose weight/bias sums run inside the row kernel (codegen/column_sums.py), candidates ("col", XBLOCK,
num_warps, programs) replace ReductionEmitter._column_config instead. Numbers: median ms and % of the
copy ceiling measured here. `<workload>_hints` (softmax, ln_gelu, rmsnorm) tries cache hints on the
row loads and stores instead (HINTS).
"""
import sys

import torch
import triton.testing

from benchmarks.workloads import WORKLOADS, io_bytes
from fxopt.codegen import column_sums
from fxopt.codegen import triton_reduction as tr

# (XBLOCK, num_warps, programs wanted) of a row kernel with column sums
COLUMN_CONFIGS = [(1, 4, 512), (1, 4, 1024), (1, 8, 264), (1, 8, 528), (2, 8, 528), (1, 16, 132), (1, 16, 264),
                  (2, 16, 264)]
CANDIDATES = {
    "softmax": [(1, 8192, w) for w in (4, 8, 16, 32)] + [(2, 8192, 16)],
    "ln_gelu": [(1, 4096, w) for w in (4, 8, 16)] + [(2, 4096, 8), (2, 4096, 16), (4, 4096, 16)],
    "rmsnorm": [(1, 4096, w) for w in (4, 8, 16)] + [(2, 4096, 8), (2, 4096, 16), (4, 4096, 16)],
    "softmax_long": [(1, r, w) for r in (2048, 4096, 8192) for w in (8, 16)],
    "ln_bwd": [("col", x, w, p) for x, w, p in COLUMN_CONFIGS],
    "rms_bwd": [("col", x, w, p) for x, w, p in COLUMN_CONFIGS],
    # the row loop software-pipelined over 1 to 6 stages (each stage holds the next rows in shared memory)
    "ln_bwd_stages": [("col", 1, 16, 264, s) for s in (1, 3, 4, 5, 6)] + [("col", 1, 8, 528, s) for s in (3, 4, 5)]
    + [("col", 1, 16, 132, s) for s in (4, 6)],
    "rms_bwd_stages": [("col", 1, 16, 264, s) for s in (1, 3, 4, 5, 6)] + [("col", 1, 8, 528, s) for s in (3, 4, 5)]
    + [("col", 1, 16, 132, s) for s in (4, 6)],
}
# cache hints on a persistent row kernel's row loads and stores: (eviction policy of the loads, ".cs" stores)
HINTS = [("hint", "evict_first", True), ("hint", "evict_first", False), ("hint", None, True)]
for _name in ("softmax", "ln_gelu", "rmsnorm"):
    CANDIDATES[_name + "_hints"] = HINTS


def copy_ceiling() -> float:
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() / ms / 1e6


def main(names):
    ceiling = copy_ceiling()
    print(f"copy ceiling {ceiling:.0f} GB/s")
    original = tr.ReductionEmitter._config
    original_column = tr.ReductionEmitter._column_config
    stages = column_sums.COLUMN_STAGES
    original_init = tr.ReductionEmitter.__init__
    for name in names:
        fn, inputs = WORKLOADS[name.removesuffix("_stages").removesuffix("_hints")].make("cuda", torch.bfloat16, False)
        with torch.no_grad():
            nbytes = io_bytes(inputs, fn(*inputs))
            for cand in [None] + CANDIDATES.get(name, []):
                # row kernels take the candidate; column kernels (xblock > 1 in the list) take it
                # only when the heuristic also chose a column schedule
                def config(self, persistent, column, cand=cand):
                    base = original(self, persistent, column)
                    if cand is None or cand[0] in ("col", "hint") or (column != (cand[0] > 4)):
                        return base
                    return cand[0], (min(cand[1], base[1]) if persistent else cand[1]), cand[2]

                def column_config(self, xblock, warps, cand=cand):
                    return tuple(cand[1:4]) if cand and cand[0] == "col" else original_column(self, xblock, warps)
                column_sums.COLUMN_STAGES = cand[4] if cand and cand[0] == "col" and len(cand) > 4 else stages
                tr.ReductionEmitter._config = config
                tr.ReductionEmitter._column_config = column_config

                def init(self, *args, cand=cand, **kwargs):  # looped kernels set their own per pass
                    original_init(self, *args, **kwargs)
                    if cand and cand[0] == "hint":
                        self.load_policy, self.store_hint = cand[1], cand[2]
                tr.ReductionEmitter.__init__ = init
                torch._dynamo.reset()
                f = torch.compile(fn, backend="fxopt")
                try:
                    f(*inputs)
                    ms = triton.testing.do_bench(lambda: f(*inputs), warmup=25, rep=200, return_mode="median")
                    gbs = nbytes / ms / 1e6
                    print(f"{name:13s} {str(cand or 'heuristic'):18s} {ms:8.4f} ms {100 * gbs / ceiling:5.1f}%")
                except Exception as exc:  # a candidate that does not compile (e.g. too many registers)
                    print(f"{name:13s} {str(cand):18s} failed: {type(exc).__name__}: {str(exc)[:80]}")
    tr.ReductionEmitter._config = original
    tr.ReductionEmitter._column_config = original_column
    tr.ReductionEmitter.__init__ = original_init
    column_sums.COLUMN_STAGES = stages


if __name__ == "__main__":
    main(sys.argv[1:] or list(CANDIDATES))
