#!/usr/bin/env bash
# The 2-GPU run that the open ring-efficiency goals wait for (docs/performance.md, "Open leads"),
# on two GPUs of one host (2×H200 for the recorded figures), ~10 min:
#   bash launch/ring_x2_checks.sh
# 1. check_ring_nccl on both kernel backends: the ring over NCCL and over copy engines against
#    one GPU and float32, the two transports bit-identical, no host synchronisation.
# 2. bench_ring at 8k and 32k tokens per rank, zigzag: our ring on both kernel backends and both
#    transports, torch's context_parallel (flash and cuDNN) beside it; appended to
#    benchmarks/ring.jsonl (then `python launch/benchmarks_md.py` regenerates BENCHMARKS.md).
# RINGFLASH_COMMIT names the commit where the tree has no .git; with $OUT set (the device tool),
# benchmarks/ring.jsonl is copied there.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"  # NVLink multicast off, as the device notes ask
for backend in triton cudnn; do
  torchrun --standalone --nproc_per_node=2 launch/check_ring_nccl.py --backend "$backend"
done
torchrun --standalone --nproc_per_node=2 launch/bench_ring.py --tokens-per-rank 8k,32k --layouts zigzag
if [ -n "${OUT:-}" ]; then
  cp benchmarks/ring.jsonl "$OUT/"
fi
