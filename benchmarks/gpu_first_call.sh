#!/usr/bin/env bash
# The cold first call (issue 7) on the GPU, in one device call (about 8 minutes on an H200; the CUDA
# suite first when the tree changed since its last GPU run: `bash benchmarks/gpu_first_call.sh suite`).
# From the repository root; logs under $OUT (default /tmp/fxopt-gpu). Copy the tables into
# benchmarks/results/ with the date and commit.
set -u
. benchmarks/gpu_batch_env.sh
git rev-parse --short HEAD 2>/dev/null; date -u

if [ "${1:-}" = suite ]; then
    echo "== every CUDA test but the CUDA-graph ones"
    timeout 420 python -m pytest -q tests -k "cuda or gpu" --ignore-glob='tests/test_cudagraphs_gpu*.py' $P > "$OUT/tests.txt" 2>&1
    tail -3 "$OUT/tests.txt"
    exit 0
fi

echo "== the attention kernel's launcher built after vs beside its compile (triton 3.6)"
timeout 90 python -m benchmarks.launcher_ahead_cost --rounds 2 2>&1 | tail -5
python -m pytest -q tests/codegen/test_launcher_ahead.py 2>&1 | tail -1

echo "== runner: first call against Inductor's in the same run, steady state, peak memory"
timeout 330 python -m benchmarks.run --workloads gpt_block_train,llama_block_train,gpt_block --backends inductor,fxopt \
    > "$OUT/runner.txt" 2>&1
tail -9 "$OUT/runner.txt"

echo "== where fxopt's first call goes: compile steps per thread, Triton's stages per kernel"
for W in gpt_block_train gpt_block; do
    T=$(mktemp -d)
    FXOPT_LOG=info TORCHINDUCTOR_CACHE_DIR=$T/i TRITON_CACHE_DIR=$T/t FXOPT_CACHE_DIR=$T/f \
        timeout 60 python -m benchmarks.first_call_profile $W --timeline --sample-main > "$OUT/timeline_$W.txt" 2>&1
    grep -h "first call of" "$OUT/timeline_$W.txt"
    grep -h "^kernel \|^total ms" "$OUT/timeline_$W.txt"
done
