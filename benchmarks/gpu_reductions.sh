#!/usr/bin/env bash
# The reduction batch of a device run (about 7 minutes on an H200): GPU correctness of the reduction
# kernels (column sums in the norm backwards included), the hand-written probe of what limits the
# long-row softmax and residual+LayerNorm+GELU, the column-sum configs of the norm backwards, then the
# reduction workloads against Inductor.
#     bash benchmarks/gpu_reductions.sh      # logs under $OUT (default /tmp/fxopt-gpu)
set -u
. benchmarks/gpu_batch_env.sh

echo "== 1. reduction kernels on the GPU"
timeout 150 python -m pytest -q tests/codegen/test_column_sums.py tests/codegen/test_reductions.py -k "cuda" \
    --tb=short $P > "$OUT/tests_red.txt" 2>&1
tail -3 "$OUT/tests_red.txt"

echo "== 2. probe: hand-written variants of the long-row softmax and LayerNorm+GELU"
timeout 240 python -m benchmarks.probe_reductions --warmup 10 --rep 50 2>&1 | tee "$OUT/probe.txt" | tail -40

echo "== 3. column-sum configs of the norm backwards"
timeout 150 python -m benchmarks.tune_reduction ln_bwd rms_bwd 2>&1 | tee "$OUT/tune_cols.txt" | tail -20

echo "== 4. reduction workloads vs Inductor"
timeout 150 python -m benchmarks.run --no-first-call --workloads softmax,softmax_long,ln_gelu,rmsnorm,ln_bwd,rms_bwd \
    --backends inductor,fxopt 2>"$OUT/run_red.err" | tail -16
