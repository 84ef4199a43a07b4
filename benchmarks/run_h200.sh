#!/usr/bin/env bash
# One call on a GPU machine: the GPU tests, the whole MoE layer (this tree against OLD, same
# machine, alternating), the live-row kernels (benchmarks/live_rows.py) and the router's top-k
# (benchmarks/route_topk.py), each under a time limit.
# Usage: benchmarks/run_h200.sh OLD_CHECKOUT OUT_DIR   (run from the repository root)
set -o pipefail
OLD=$(cd "${1:?usage: benchmarks/run_h200.sh OLD_CHECKOUT OUT_DIR}" && pwd)
OUT=${2:?usage: benchmarks/run_h200.sh OLD_CHECKOUT OUT_DIR}
NEW=$PWD
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/smi.txt"
PYTHONPATH=$NEW timeout "${T_TESTS:-150}" python -m pytest -q -rf -p no:cacheprovider tests/test_gpu.py \
    tests/test_triton_kernels.py tests/test_triton_wgrad.py tests/test_cuda_graphs.py tests/test_compile.py \
    tests/test_route_topk.py \
    2>&1 | tail -40 | tee "$OUT/pytest.txt"
for tree in old new; do
    dir=$OLD; [ $tree = new ] && dir=$NEW
    PYTHONPATH=$dir timeout "${T_LAYER:-40}" python "$NEW/benchmarks/moe_layer.py" --only layer --alignments 1,128 \
        --label $tree --fast-init 2>&1 | tee -a "$OUT/moe_layer.jsonl"
done
PYTHONPATH=$NEW timeout "${T_ROWS:-60}" python benchmarks/live_rows.py --old "$OLD" 2>&1 | tee "$OUT/live_rows.jsonl" \
    | cut -c1-160
PYTHONPATH=$NEW timeout "${T_TOPK:-60}" python benchmarks/route_topk.py 2>&1 | tee "$OUT/route_topk.jsonl" | cut -c1-200
