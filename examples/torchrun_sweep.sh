#!/usr/bin/env bash
# A patching sweep split over processes with torchrun: each rank runs a share of the chunks, every
# rank gets the merged result, rank 0 writes it. CPU: 2 processes here; GPUs: NPROC = GPU count.
#
#   bash examples/torchrun_sweep.sh [OUT]          # default runs/example-torchrun
set -euo pipefail
OUT=${1:-runs/example-torchrun}
torchrun --standalone --nproc_per_node "${NPROC:-2}" -m circuitkit.cli patch \
  --model icd-teacher --task icd10 -n 32 --direction noise --out "$OUT"
python -m circuitkit.cli report "$OUT" --no-attention
