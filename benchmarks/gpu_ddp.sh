#!/usr/bin/env bash
# Issue 10 on a two-GPU machine (nvidia-h200-x2), in one device call of under 10 minutes. The two-GPU
# machine has been lent for the first two or three calls of a session only, so the default run starts
# with what is not measured yet: DDP scaling (one-GPU and two-GPU steps timed in turn) with CUDA graphs
# under dynamo's split graphs, under DDP's python reducer (its backward captured with its NCCL
# all-reduces), then under one graph. `bash benchmarks/gpu_ddp.sh tests` runs the NCCL tests, the
# losses, the mode without graphs and FSDP2's scaling instead. From the repository root; logs under
# $OUT. Copy the tables into benchmarks/results/ with the date and commit.
set -u
. benchmarks/gpu_batch_env.sh
# NVLink multicast off (the lent machines' KINDS.md): NCCL's NVLS and symmetric-memory multicast
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
git rev-parse --short HEAD 2>/dev/null; date -u; nvidia-smi -L

scaling() {  # $1: optimize_ddp mode, $2: extra flags
    local log="$OUT/ddp_scaling_$1${2// /}.txt"
    echo "== scaling, optimize_ddp=$1 $2"
    timeout 150 python -m benchmarks.ddp_scaling --parts scaling --rounds 5 --backends inductor,fxopt \
        --optimize-ddp "$1" $2 > "$log" 2>&1
    grep -A4 "^| backend" "$log"; grep "^rank" "$log"; grep -i -m3 "error\|FAILED" "$log"
}

if [ "${1:-}" = tests ]; then
    echo "== the distributed tests with NCCL on two GPUs"
    timeout 130 python -m pytest -q tests/distributed -k cuda $P > "$OUT/ddp_tests.txt" 2>&1
    tail -3 "$OUT/ddp_tests.txt"
    echo "== losses, python reducer (fp32, 5 AdamW steps)"
    timeout 80 python -m benchmarks.ddp_scaling --parts losses --optimize-ddp python_reducer \
        > "$OUT/ddp_losses_reducer.txt" 2>&1
    tail -6 "$OUT/ddp_losses_reducer.txt"
    scaling off ""
    echo "== FSDP2 scaling (fully_shard per block, blocks compiled on their own)"
    timeout 150 python -m benchmarks.fsdp_scaling --rounds 5 > "$OUT/fsdp_scaling.txt" 2>&1
    grep -A4 "^| backend" "$OUT/fsdp_scaling.txt"; grep "^rank" "$OUT/fsdp_scaling.txt"; grep -i -m3 "error\|FAILED" "$OUT/fsdp_scaling.txt"
else
    scaling ddp_optimizer --cudagraphs
    scaling python_reducer --cudagraphs
    scaling off --cudagraphs
fi
