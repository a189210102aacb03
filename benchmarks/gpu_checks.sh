#!/usr/bin/env bash
# One batched device run for what the CPU cannot show (about 12 minutes on an H200: split it over two device calls), in the order a
# short device budget should spend it. From the repository root:
#     bash benchmarks/gpu_checks.sh            # writes every log under $OUT (default /tmp/fxopt-gpu)
# Each step prints its last lines; copy the tables into benchmarks/results/ with the date and commit.
set -u
. benchmarks/gpu_batch_env.sh

echo "== 1. every CUDA test but the CUDA-graph ones"
timeout 420 python -m pytest -q tests -k "cuda or gpu" --ignore-glob='tests/test_cudagraphs_gpu*.py' $P > "$OUT/tests.txt" 2>&1
tail -3 "$OUT/tests.txt"

echo "== 2. CUDA graphs on the GPU (own process: a failed capture must not disturb the other tests)"
timeout 90 python -m pytest -q tests/test_cudagraphs_gpu.py tests/test_cudagraphs_gpu_memory.py -m gpu -k cuda --tb=short $P > "$OUT/cudagraphs.txt" 2>&1
tail -5 "$OUT/cudagraphs.txt"

echo "== 2b. numerics where each thread holds several elements (packed 16-bit code; the CUDA tests' shapes are small)"
FXOPT_TEST_ROWS=1024 timeout 200 python -m pytest -q tests/codegen/test_pointwise_ops.py -k cuda $P > "$OUT/rows.txt" 2>&1
tail -1 "$OUT/rows.txt"
for i in 0 1 2 3 4 5; do
    timeout 300 python -m benchmarks.edge_sweep --rep 256 --shard $i/6 > "$OUT/edge_sweep$i.txt" 2>&1 &
done
wait
grep -h -E "MISMATCH|ERROR|cases" "$OUT"/edge_sweep?.txt | cut -c1-160   # accepted differences: edge_sweep's docstring

echo "== 2c. what the interpreter cannot show: fma contraction, approximate division, reductions over edge rows"
timeout 120 python -m pytest -q tests/codegen/test_fp_contraction.py tests/codegen/test_division_rounding.py -k cuda $P > "$OUT/rounding.txt" 2>&1
tail -1 "$OUT/rounding.txt"
for i in 0 1 2 3; do
    timeout 300 python -m benchmarks.edge_sweep --family rows --shard $i/4 > "$OUT/rows_sweep$i.txt" 2>&1 &
    timeout 300 python -m benchmarks.edge_sweep --family params --shard $i/4 > "$OUT/params_sweep$i.txt" 2>&1 &
done
wait
grep -h -E "MISMATCH|ERROR|cases" "$OUT"/rows_sweep?.txt "$OUT"/params_sweep?.txt | cut -c1-160
for d in float32 bfloat16 float16; do
    timeout 300 python -m benchmarks.graph_fuzz --programs 150 --dtype $d > "$OUT/fuzz_$d.txt" 2>&1 &
done
wait
tail -qn1 "$OUT"/fuzz_*.txt   # failing programs are printed in full in those files

echo "== 3. dynamic vs static reductions (the persistent alternative for symbolic rows)"
for d in "" "--dynamic"; do
    timeout 90 python -m benchmarks.run --no-first-call --backends fxopt --workloads softmax,rmsnorm,ln_gelu,chain $d \
        2>>"$OUT/dynamic.err" | tail -5
done

echo "== 4. launch-bound block with and without CUDA graphs, training blocks (after the launch-cost work)"
timeout 240 python -m benchmarks.run --no-first-call --workloads gpt_block_b1,gpt_block_b1_cg,gpt_block_train,llama_block_mixed \
    --backends eager,inductor,fxopt 2>"$OUT/blocks.err" | tail -14

echo "== 5. allocator behaviour with matmuls placed through out= (memory_plan=\"apply\")"
timeout 120 python -m benchmarks.allocator_stats --workloads gpt_block,gpt_block_train 2>"$OUT/alloc.err" | tail -9
