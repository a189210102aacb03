#!/usr/bin/env bash
# One batched device run for launch cost (about 6-7 minutes on an H200): does torch's C launcher
# (codegen/static_launch.py) make fxopt's launch-bound and training workloads cheaper on the host?
#     bash benchmarks/gpu_launch.sh            # logs under $OUT (default /tmp/fxopt-gpu)
# Host time varies ~15% between processes, so the two launchers alternate, twice each.
set -u
. benchmarks/gpu_batch_env.sh
W=gpt_block_train,gpt_block_b1,llama_block_train

echo "== 1. launch tests (C launcher against Triton's, every generated GPU kernel of test_gpu.py)"
timeout 150 python -m pytest -q tests/codegen/test_static_launch.py tests/codegen/test_fast_launch.py tests/test_gpu.py \
    --tb=short $P > "$OUT/launch_tests.txt" 2>&1
tail -4 "$OUT/launch_tests.txt"

echo "== 2. host ms per call: FXOPT_STATIC_LAUNCH=0 (Triton's launcher) vs 1 (torch's C launcher)"
for s in 0 1 0 1; do
    echo "-- FXOPT_STATIC_LAUNCH=$s"
    FXOPT_STATIC_LAUNCH=$s timeout 120 python -m benchmarks.host_time --workloads $W --backends fxopt 2>>"$OUT/host.err" | tail -3
done

echo "== 3. the blocks against Inductor, same run"
timeout 240 python -m benchmarks.run --no-first-call --workloads $W,llama_block_mixed,gpt_block \
    --backends inductor,fxopt 2>"$OUT/blocks.err" | tail -10
