#!/usr/bin/env bash
# One call on a GPU machine for the several-ranks-per-GPU mode (gloo): the GPU tests of the whole
# suite (pytest -m gpu, 4 workers by file) and the Triton kernels' tests on CUDA beside tests/test_gpu_ranks.py (layer and training in two
# processes), then the one-GPU gloo benchmark of the MoE layer and its chunk launch order.
# Usage: benchmarks/run_gloo_one_gpu.sh OUT_DIR COMMIT [PYTEST_K]   (from the repository root;
# PYTEST_K, if given, selects tests of test_gpu_ranks.py and skips the rest of the suite)
set -o pipefail
OUT=${1:?usage: benchmarks/run_gloo_one_gpu.sh OUT_DIR COMMIT}
COMMIT=${2:-unknown}
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/smi.txt" 2>&1
if [ -z "$3" ]; then
    timeout "${T_SUITE:-420}" python -m pytest -q -rfEs -p no:cacheprovider -n 4 --dist loadfile -m gpu \
        $(grep -l "mark.gpu" tests/test_*.py | grep -v test_gpu_ranks) > "$OUT/gpu_suite.txt" 2>&1 &
    SUITE=$!
    timeout "${T_SUITE:-420}" python -m pytest -q -rfEs -p no:cacheprovider tests/test_triton_kernels.py \
        > "$OUT/gpu_triton_kernels.txt" 2>&1 &
    KERNELS=$!
    timeout "${T_TRAIN:-400}" python -m pytest -q -rfEs -s -p no:cacheprovider tests/test_gpu_ranks.py \
        -k "torchrun or nccl" > "$OUT/gpu_ranks_train.txt" 2>&1 &
    TRAIN=$!
    timeout "${T_LAYER:-400}" python -m pytest -q -rfEs -p no:cacheprovider tests/test_gpu_ranks.py \
        -k "not torchrun and not nccl" > "$OUT/gpu_ranks_layer.txt" 2>&1
    wait $TRAIN $SUITE $KERNELS
else
    timeout "${T_LAYER:-400}" python -m pytest -q -rfEs -s -p no:cacheprovider tests/test_gpu_ranks.py \
        -k "$3" > "$OUT/gpu_ranks_rerun.txt" 2>&1
fi
timeout "${T_BENCH:-120}" python -m benchmarks.gloo_one_gpu --trace "$OUT/chunk_order.txt" --commit "$COMMIT" \
    > "$OUT/bench.jsonl" 2> "$OUT/bench.err"
for f in "$OUT"/gpu_*.txt; do echo "== $f"; tail -4 "$f"; done
cat "$OUT/bench.jsonl" | cut -c1-400
head -3 "$OUT/chunk_order.txt" 2>/dev/null
