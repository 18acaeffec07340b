#!/usr/bin/env bash
# Ring efficiency at small per-rank lengths under NCCL settings that trade p2p bandwidth for SMs.
# Hypothesis: NCCL's p2p kernels take SMs from the attention kernels they overlap (refuted at 8k on
# 2×H200: fewer channels or CTAs only slowed the transfers; docs/performance.md).
#   bash launch/ring_nccl_sweep.sh 8k   (on a 2-GPU machine)
set -u
tokens="${1:-8k}"
for channels in default 8 4 2; do
  if [ "$channels" = default ]; then unset NCCL_MAX_NCHANNELS; else export NCCL_MAX_NCHANNELS=$channels; fi
  echo "== NCCL_MAX_NCHANNELS=$channels"
  torchrun --standalone --nproc_per_node=2 launch/bench_ring.py --tokens-per-rank "$tokens" --layouts zigzag \
    --no-torch-cp --no-check-ranks --no-record 2>&1 | grep "| ringflash"
done
