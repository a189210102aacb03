# What the batched device scripts (gpu_checks.sh, gpu_attention.sh) share: the tree on PYTHONPATH with
# the backend registered (gpu_env.sh), the real Triton compiler, a log folder $OUT, quiet pytest flags.
. benchmarks/gpu_env.sh
export TRITON_INTERPRET=0
OUT=${OUT:-/tmp/fxopt-gpu}
mkdir -p "$OUT"
P="-p no:warnings -p no:logging -p no:cacheprovider"
