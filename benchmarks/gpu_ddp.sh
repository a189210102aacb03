#!/usr/bin/env bash
# Issue 10 on a two-GPU machine (nvidia-h200-x2), in one device call of under 10 minutes: the NCCL
# tests, then DDP scaling (one-GPU and two-GPU steps timed in turn) under each of dynamo's DDP modes,
# losses and the all-reduce overlap profile with DDP's python reducer. From the repository root; logs
# under $OUT. `bash benchmarks/gpu_ddp.sh scaling` skips the tests. Copy the tables into
# benchmarks/results/ with the date and commit.
set -u
. benchmarks/gpu_batch_env.sh
# NVLink multicast off (the lent machines' KINDS.md): NCCL's NVLS and symmetric-memory multicast
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
git rev-parse --short HEAD 2>/dev/null; date -u; nvidia-smi -L

if [ "${1:-}" != scaling ]; then
    echo "== the distributed tests with NCCL on two GPUs"
    timeout 130 python -m pytest -q tests/distributed -k cuda $P > "$OUT/ddp_tests.txt" 2>&1
    tail -3 "$OUT/ddp_tests.txt"
    echo "== losses, python reducer (fp32, 5 AdamW steps)"
    timeout 80 python -m benchmarks.ddp_scaling --parts losses --optimize-ddp python_reducer \
        > "$OUT/ddp_losses_reducer.txt" 2>&1
    tail -6 "$OUT/ddp_losses_reducer.txt"
fi

for MODE in off ddp_optimizer python_reducer; do
    echo "== scaling, optimize_ddp=$MODE"
    timeout 125 python -m benchmarks.ddp_scaling --parts scaling --rounds 5 --backends inductor,fxopt \
        --optimize-ddp $MODE > "$OUT/ddp_scaling_$MODE.txt" 2>&1
    tail -6 "$OUT/ddp_scaling_$MODE.txt"
done
