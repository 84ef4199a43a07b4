#!/usr/bin/env bash
# One node, N processes (default: one per GPU, or 2 on a CPU-only machine), torchrun's
# standalone rendezvous. Every argument is a Hydra override for dropless-train.
#
#   launch/torchrun_single_node.sh                              # CPU default recipe, gloo
#   NPROC=4 launch/torchrun_single_node.sh dispatcher=a2a       # 4 ranks, EP = 4
#   NPROC=8 launch/torchrun_single_node.sh recipe=h200_single dispatcher=a2a train.cuda_graph=false \
#       model.recompute_gather=false                          # 8 GPUs, EP = 8 (the recipe's graphs need local)
set -euo pipefail

if [[ -z "${NPROC:-}" ]]; then
  NPROC=$(python -c 'import torch; print(torch.cuda.device_count() or 2)')
fi

exec torchrun --standalone --nnodes 1 --nproc_per_node "${NPROC}" -m dropless.train "$@"
