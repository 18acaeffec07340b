#!/usr/bin/env bash
# The multi-GPU runs in one command: exactness over NCCL, the pending 2-GPU goals, scaling
# and training, on however many GPUs this host has (2, 4 or 8; best 8).
#
#   bash launch/multigpu_runs.sh                         # everything, N = the GPUs found
#   bash launch/multigpu_runs.sh --steps exact,scaling   # a part (the device tool's 10-min commands)
#   bash launch/multigpu_runs.sh --worlds 4 --steps exact # the exact and scaling steps at W = 4 only
#   bash launch/multigpu_runs.sh --smoke                 # the same sequence on CPU gloo, 2-4 processes
#   bash launch/multigpu_runs.sh --steps ring8k          # the 8k ring on a 4-GPU host
#
# Steps, in order (each under its own `timeout`, so a hang cannot eat the lease; a failure is
# logged and the script goes on; the summary at the end lists each step's status):
#   exact    check_ring_nccl at W = 2, 4, 8 (those <= N): the ring (both transports, both kernel
#            backends: triton, cudnn) and the head-parallel x ring hybrid (--head-parallel 2 at
#            every W, and 4 at W = 8), each against one GPU in float32. TOKENS_PER_RANK (default
#            16384) keeps the float32 reference on the whole sequence short.
#   x2       launch/ring_x2_checks.sh's benchmarks on GPUs 0 and 1 (the pending ring goals), one
#            step per length (8k, 32k tokens per rank); its checks are the exact step's at W = 2.
#   scaling  launch/bench_scaling.py at W = 2, 4, 8, two steps each: 8k and 32k tokens per GPU
#            (weak), a fixed 256k sequence (strong); ring, head-parallel, hybrid, torch CP, each with
#            the planner's prediction; appends to benchmarks/scaling.jsonl.
#   ring8k   the 8k ring goal (N >= 4, at W = 4): bench_ring at 8k tokens per rank, zigzag, the `hopper`
#            kernels over NCCL and the copy engine, MHA (H = 16) and Llama-3-8B's 32/8 heads, each row
#            with the planner's prediction; bench_scaling at 8k and 32k per GPU on the `hopper`
#            kernels (ring, head-parallel, hybrid, torch CP); the 7B config at cp = 4, 10 steps.
#            Not in the default --steps (it repeats parts of the others on 4 GPUs).
#   train    launch/train.py: configs/hf_llama_1b_gpu.toml (~1.1B, transformers) at cp = 8 and at
#            dp 2 x cp 4, 32k tokens, 30 steps; then configs/gpu8_llama8b_fsdp_128k.toml (Llama-3-8B's
#            transformer in ringflash's own model, 256-token vocabulary: ~7.0B; FSDP2, cp = 8,
#            128k tokens) if ringflash.train.memory.predict's peak fits 90% of a GPU (predicted
#            29 GiB: it does on H100s). Needs N = 8 (the training steps are skipped below 8 GPUs).
#            tokens/s, TFLOP/s, MFU and peak memory are in the logs (training is recorded by hand,
#            benchmarks/training.jsonl), beside the prediction printed first.
# Logs: $LOGDIR (default runs/multigpu/<UTC time>), one file per step plus summary.txt. With $OUT
# set (the device tool), benchmarks/*.jsonl and the logs are copied there after every step, so a
# command cut off by its time limit still returns what it finished. RINGFLASH_COMMIT names the
# commit where the tree has no .git. Per-step timeouts: STEP_TIMEOUT (default 900 s; 300 in smoke).
#
# --smoke: CUDA hidden, gloo on CPU, tiny sizes, W = 2 and 4 (at most --gpus if given): check_ring_nccl
# at 64 tokens per rank and D = 32 (ring and hybrid U = 2); instead of ring_x2_checks (GPUs only) the
# CPU parts of it (check_ring_nccl, bench_ring --quick); bench_scaling --smoke; training on
# configs/tiny_cpu.toml (cp = 2, dp 2 x cp 2, and FSDP2, 3 steps) after the same memory check on
# the 8B config. Smoke records go to $LOGDIR/benchmarks, never to benchmarks/.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"  # NVLink multicast off, as the device notes ask
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

SMOKE=0
STEPS="exact,x2,scaling,train"
NGPUS=""
ONLY_WORLDS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=1 ;;
    --steps) STEPS="$2"; shift ;;
    --steps=*) STEPS="${1#*=}" ;;
    --gpus) NGPUS="$2"; shift ;;
    --gpus=*) NGPUS="${1#*=}" ;;
    --worlds) ONLY_WORLDS="$2"; shift ;;
    --worlds=*) ONLY_WORLDS="${1#*=}" ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)"; exit 2 ;;
  esac
  shift
done

PY="${PYTHON:-python}"
TORCHRUN=("$PY" -m torch.distributed.run --standalone)
LOGDIR="${LOGDIR:-runs/multigpu/$(date -u +%Y%m%d-%H%M%S)}"
mkdir -p "$LOGDIR"
SUMMARY="$LOGDIR/summary.txt"
if [ "$SMOKE" = 1 ]; then
  export CUDA_VISIBLE_DEVICES=""
  N="${NGPUS:-4}"; [ "$N" -gt 4 ] && N=4
  STEP_TIMEOUT="${STEP_TIMEOUT:-300}"
  RECORD=(--record-to "$LOGDIR/benchmarks")
else
  if [ -z "$NGPUS" ]; then
    NGPUS="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
    [ "${NGPUS:-0}" -gt 0 ] || NGPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
  fi
  N="$NGPUS"
  STEP_TIMEOUT="${STEP_TIMEOUT:-900}"
  RECORD=()
fi
WORLDS=()
for w in 2 4 8; do
  [ "$w" -le "$N" ] || continue
  [ -z "$ONLY_WORLDS" ] || [[ ",$ONLY_WORLDS," == *",$w,"* ]] || continue
  WORLDS+=("$w")
done
if [ -n "$ONLY_WORLDS" ] && [ ${#WORLDS[@]} -eq 0 ]; then
  echo "--worlds $ONLY_WORLDS: none of 2, 4, 8 at most the $N GPUs (or processes) here"; exit 2
fi
echo "multigpu_runs: N=$N smoke=$SMOKE steps=$STEPS worlds=${WORLDS[*]:-none} logs=$LOGDIR" | tee "$SUMMARY"

copy_out() {
  [ -n "${OUT:-}" ] || return 0
  mkdir -p "$OUT/logs" "$OUT/benchmarks"
  cp -f benchmarks/*.jsonl "$OUT/benchmarks/" 2>/dev/null || true
  [ -d "$LOGDIR/benchmarks" ] && cp -f "$LOGDIR"/benchmarks/*.jsonl "$OUT/benchmarks/" 2>/dev/null
  cp -f "$LOGDIR"/*.log "$LOGDIR"/summary.txt "$OUT/logs/" 2>/dev/null || true
}

FAILED=0
# step NAME CMD...: run under timeout, log to $LOGDIR/NAME.log, record the status, go on.
step() {
  local name="$1"; shift
  local t0=$SECONDS rc
  echo "== $name: $*" | tee -a "$SUMMARY"
  timeout --kill-after=30 "$STEP_TIMEOUT" "$@" >"$LOGDIR/$name.log" 2>&1
  rc=$?
  local status=ok
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status="TIMEOUT after ${STEP_TIMEOUT}s"; FAILED=$((FAILED + 1))
  elif [ $rc -ne 0 ]; then status="FAIL (rc $rc)"; FAILED=$((FAILED + 1)); fi
  local verdict
  verdict="$(grep -E '^(PASS|FAIL)' "$LOGDIR/$name.log" | tail -1)"
  echo "   $name: $status in $((SECONDS - t0)) s ${verdict:+($verdict)}" | tee -a "$SUMMARY"
  copy_out
}
want() { [[ ",$STEPS," == *",$1,"* ]]; }

# ---- 1. exactness -------------------------------------------------------------------------------
if want exact; then
  if [ "$SMOKE" = 1 ]; then
    SIZES=(--tokens-per-rank 64 --head-dim 32); BACKENDS=(auto)
  else
    SIZES=(--tokens-per-rank "${TOKENS_PER_RANK:-16384}"); BACKENDS=(triton cudnn)
  fi
  for w in "${WORLDS[@]}"; do
    us=(1 2); [ "$w" -ge 8 ] && us+=(4)
    for b in "${BACKENDS[@]}"; do
      for u in "${us[@]}"; do
        step "exact_w${w}_u${u}_${b}" "${TORCHRUN[@]}" --nproc_per_node="$w" launch/check_ring_nccl.py \
          --backend "$b" --head-parallel "$u" "${SIZES[@]}"
      done
    done
  done
fi

# ---- 2. the pending 2-GPU goals -----------------------------------------------------------------
if want x2; then
  if [ "$SMOKE" = 1 ]; then
    step x2_check "${TORCHRUN[@]}" --nproc_per_node=2 launch/check_ring_nccl.py --tokens-per-rank 64 --head-dim 32
    step x2_bench "${TORCHRUN[@]}" --nproc_per_node=2 launch/bench_ring.py --quick "${RECORD[@]}"
  elif [ "$N" -ge 2 ]; then
    # launch/ring_x2_checks.sh as steps that each fit a 10-minute device command (~10 min together):
    # its NCCL checks are the exact step's at W = 2, then bench_ring at 8k and at 32k tokens per rank.
    for n in 8k 32k; do
      step "x2_bench_$n" "${TORCHRUN[@]}" --nproc_per_node=2 launch/bench_ring.py --tokens-per-rank "$n" \
        --layouts zigzag
    done
  fi
fi

# ---- 3. scaling ---------------------------------------------------------------------------------
if want scaling; then
  for w in "${WORLDS[@]}"; do
    if [ "$SMOKE" = 1 ]; then
      step "scaling_w$w" "${TORCHRUN[@]}" --nproc_per_node="$w" launch/bench_scaling.py --smoke "${RECORD[@]}"
    else
      # Weak and strong as two steps, each one record: a 10-minute command holds either (on 2×H100
      # the two together took more than 320 s, and a step cut off records nothing).
      step "scaling_weak_w$w" "${TORCHRUN[@]}" --nproc_per_node="$w" launch/bench_scaling.py \
        --tokens-per-gpu 8k,32k --total "" --iters 5 --warmup 2
      step "scaling_strong_w$w" "${TORCHRUN[@]}" --nproc_per_node="$w" launch/bench_scaling.py \
        --tokens-per-gpu "" --total 256k --iters 5 --warmup 2
    fi
  done
fi

# ---- 3b. the ring at 8k tokens per GPU on 4 GPUs ------------------------------------------------
if want ring8k; then
  if [ "$SMOKE" = 1 ]; then
    step ring8k_bench "${TORCHRUN[@]}" --nproc_per_node=4 launch/bench_ring.py --quick --layouts zigzag \
      --kv-heads 1 --no-torch-cp "${RECORD[@]}"
  elif [ "$N" -ge 4 ]; then
    for heads in "16 16" "32 8"; do
      set -- $heads
      step "ring8k_bench_h$1_kv$2" "${TORCHRUN[@]}" --nproc_per_node=4 launch/bench_ring.py --tokens-per-rank 8k \
        --layouts zigzag --kernel-backends hopper --transports nccl,copy-engine --heads "$1" --kv-heads "$2" \
        --no-torch-cp
    done
    step ring8k_scaling "${TORCHRUN[@]}" --nproc_per_node=4 launch/bench_scaling.py --tokens-per-gpu 8k,32k \
      --total "" --shapes gqa,mha --grids 1,2,4 --schemes ring --backend hopper --iters 5 --warmup 2
    step ring8k_train_7b_cp4 "${TORCHRUN[@]}" --nproc_per_node=4 launch/train.py \
      --config configs/gpu8_llama8b_fsdp_128k.toml --parallel.cp=4 --train.steps=10 \
      --logging.dir="$LOGDIR/ring8k_train_7b_cp4"
  else
    echo "   ring8k: skipped (needs 4 GPUs, found $N)" | tee -a "$SUMMARY"
  fi
fi

# ---- 4. training --------------------------------------------------------------------------------
if want train; then
  BIG=configs/gpu8_llama8b_fsdp_128k.toml
  step train_8b_memory_prediction "$PY" - "$BIG" "$SMOKE" <<'EOF'
import sys
import torch
from ringflash.train.config import load_config
from ringflash.train.memory import predict
cfg = load_config(sys.argv[1])
p = predict(cfg.model, cfg.data.seq_len, cfg.data.batch_size, dp=1, cp=cfg.parallel.cp, fsdp=cfg.parallel.fsdp,
            activation_checkpointing=cfg.train.activation_checkpointing,
            recompute_attention=cfg.train.recompute_attention)
print("predicted per GPU, GiB: " + ", ".join(f"{k} {v / 2**30:.2f}" for k, v in p.items()))
total = torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else None
fits = total is not None and p["peak"] < 0.9 * total
print(f"GPU memory: {total / 2**30:.1f} GiB" if total else "no GPU (smoke): prediction only")
print("FITS" if fits else "DOES NOT FIT (or no GPU)")
EOF
  if [ "$SMOKE" = 1 ]; then
    SMALL=(configs/tiny_cpu.toml --train.steps=3 --train.eval_every=0 --data.eval_samples=0 --logging.log_every=1)
    step train_cp2 "${TORCHRUN[@]}" --nproc_per_node=2 launch/train.py --config "${SMALL[@]}" \
      --parallel.cp=2 --logging.dir="$LOGDIR/train_cp2"
    if [ "$N" -ge 4 ]; then
      step train_dp2_cp2 "${TORCHRUN[@]}" --nproc_per_node=4 launch/train.py --config "${SMALL[@]}" \
        --parallel.cp=2 --logging.dir="$LOGDIR/train_dp2_cp2"
    fi
    step train_fsdp_cp2 "${TORCHRUN[@]}" --nproc_per_node=2 launch/train.py --config "${SMALL[@]}" \
      --parallel.cp=2 --parallel.fsdp=true --logging.dir="$LOGDIR/train_fsdp_cp2"
  elif [ "$N" -ge 8 ]; then
    HF=(configs/hf_llama_1b_gpu.toml --train.steps=30 --data.seq_len=32768 --data.eval_samples=0
        --checkpoint.enabled=false)
    step train_1b_cp8 "${TORCHRUN[@]}" --nproc_per_node=8 launch/train.py --config "${HF[@]}" \
      --parallel.cp=8 --logging.dir="$LOGDIR/train_1b_cp8"
    step train_1b_dp2_cp4 "${TORCHRUN[@]}" --nproc_per_node=8 launch/train.py --config "${HF[@]}" \
      --parallel.cp=4 --logging.dir="$LOGDIR/train_1b_dp2_cp4"
    if grep -q '^FITS' "$LOGDIR/train_8b_memory_prediction.log"; then
      step train_8b_fsdp_128k "${TORCHRUN[@]}" --nproc_per_node=8 launch/train.py --config "$BIG" \
        --logging.dir="$LOGDIR/train_8b_fsdp_128k"
    else
      echo "   train_8b_fsdp_128k: skipped (the memory model says it does not fit)" | tee -a "$SUMMARY"
    fi
  else
    echo "   training: skipped (needs 8 GPUs, found $N)" | tee -a "$SUMMARY"
  fi
fi

echo "done: $FAILED step(s) failed or timed out; logs in $LOGDIR" | tee -a "$SUMMARY"
copy_out
[ "$FAILED" -eq 0 ]
