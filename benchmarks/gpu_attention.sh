#!/usr/bin/env bash
# The attention batch of a device run (about 6 minutes on an H200): GPU correctness of the flash
# kernels (TMA forward and backward included), a forward config sweep (TMA by default; the causal hd128
# case also through the pointer kernel), the backward sweep through TMA and through pointers (TMA is
# off by default there until this sweep says otherwise), then the attention workloads against
# Inductor and SDPA.
#     bash benchmarks/gpu_attention.sh      # logs under $OUT (default /tmp/fxopt-gpu)
set -u
. benchmarks/gpu_batch_env.sh

echo "== 1. flash kernels on the GPU"
timeout 90 python -m pytest -q tests/attention/test_flash_forward_tma.py tests/attention/test_flash_kernels.py \
    tests/attention/test_flash_decode.py -m gpu --tb=short $P 2>&1 | tail -15

echo "== 2. forward sweep (TMA), then causal hd128 through the pointer kernel"
timeout 300 python -m benchmarks.tune_attention --which fwd --warmup 10 --rep 40 > "$OUT/tune_fwd.txt" 2>&1
sed -n '/# best config/,$p' "$OUT/tune_fwd.txt"
timeout 90 python -m benchmarks.tune_attention --which fwd --cases "fwd causal hd128" --set TMA=False \
    --warmup 10 --rep 40 > "$OUT/tune_fwd_pointer.txt" 2>&1
sed -n '/# best config/,$p' "$OUT/tune_fwd_pointer.txt"

echo "== 2b. backward sweep: TMA, then the pointer kernels"
timeout 150 python -m benchmarks.tune_attention --which bwd --set TMA=True --warmup 10 --rep 40 > "$OUT/tune_bwd_tma.txt" 2>&1
sed -n '/# best config/,$p' "$OUT/tune_bwd_tma.txt"
timeout 150 python -m benchmarks.tune_attention --which bwd --warmup 10 --rep 40 > "$OUT/tune_bwd.txt" 2>&1
sed -n '/# best config/,$p' "$OUT/tune_bwd.txt"

echo "== 3. attention workloads vs Inductor and SDPA"
timeout 300 python -m benchmarks.run \
    --workloads attn_causal,attn_full,attn_alibi,attn_causal_bwd,attn_sdpa_padded,attn_sdpa_padded_bwd,gpt_block \
    --backends inductor,fxopt,sdpa --no-first-call --warmup 5 --rep 25 2>"$OUT/run.err" | tail -25
