#!/usr/bin/env bash
# One command for a machine with one NVIDIA GPU, within 9 minutes (--quick: under 4). Stages in priority order;
# each writes its results to $GPU_CHECK_OUT/NN_<stage>.txt as it ends and a line to summary.txt, so a time-out
# still leaves the stages done. Stage list and expected times: docs/kernels.md.
#   1 checkpoint  save on the GPU at 1 rank, resume on the CPU at tp2 (gloo), the losses after the resume agree
#   2 env         torch / CUDA / Triton versions, the device, nvidia-smi
#   3 kernels     fused-kernel tests (compiled Triton, fp32 + bf16) and the custom-op / torch.compile tests
#   4 speed       kernel micro-benchmarks: fused vs eager torch
#   5 gpt124m     GPT-2 124M training throughput, kernels off/on x compile off/on (quick: compile off)
#   6 gpt1p3b     1.3B (hidden 2048, 24 layers, seq 2048, bf16) throughput and MFU (the trainer logs MFU)
#
#   scripts/gpu_check.sh [--quick] [--cpu-dry-run] [--out DIR]
# --cpu-dry-run runs every stage at toy sizes on a CPU (Triton interpreter, compile backend aot_eager), so the
# script is tested without a GPU (tests/e2e/test_gpu_check.py).
set -uo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0; QUICK=0; OUT="${GPU_CHECK_OUT:-gpu_check_results}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cpu-dry-run) DRY_RUN=1 ;;
    --quick) QUICK=1 ;;
    --out) OUT="$2"; shift ;;
    *) echo "usage: scripts/gpu_check.sh [--quick] [--cpu-dry-run] [--out DIR]" >&2; exit 2 ;;
  esac
  shift
done
PYTHON="${PYTHON:-python3}"
# --cpu-dry-run tests the stages, not a GPU's time: on a shared CPU each limit is three times the GPU's (a test
# worker next to another one had the env stage time out at 30 s)
SCALE=$(( DRY_RUN ? 3 : 1 ))
BUDGET=$(( (QUICK ? 230 : 530) * SCALE ))   # seconds for all stages: the 4 / 9 minute limits, less start-up
mkdir -p "$OUT"; : > "$OUT/summary.txt"
START=$SECONDS

if [[ $DRY_RUN == 1 ]]; then
  export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""
  DEVICE_OVERRIDE=(train.device=cpu)
  # the stage's wiring, not the kernels (the test suite runs both files in full): one norm test and the custom
  # ops' opcheck, one -k for both files (pytest keeps only the last -k)
  KERNEL_TESTS=(tests/model/test_kernels.py tests/model/test_kernels_compile.py -k "(norms and layernorm and shape0) or opcheck")
  KERNEL_BENCH=(--tokens 64 --hidden 48 --heads 4 --vocab 1000 --dtype fp32 --repeats 2)
  TRAIN=(--iters 2 --warmup 1)   # one steady iteration: the kernels-on case runs in the interpreter
  COMPILE_BACKEND=train.compile_backend=aot_eager
  CKPT_MODEL=(model.num_layers=2 model.hidden_size=32 model.num_attention_heads=4 model.seq_length=32)
  SMALL=(--config configs/gpt_tiny.yaml model.num_layers=2 model.hidden_size=32 model.seq_length=32)
  LARGE=(--config configs/gpt_tiny.yaml model.num_layers=2 model.hidden_size=96 model.num_attention_heads=4
         model.seq_length=128 train.precision=bf16)
  SMALL_MICRO=2; LARGE_MICRO=4,2
else
  export TRITON_INTERPRET=0
  DEVICE_OVERRIDE=(train.device=cuda)
  KERNEL_TESTS=(tests/model/test_kernels.py tests/model/test_kernels_compile.py)
  KERNEL_BENCH=(--tokens 8192 --hidden 2048 --heads 16 --vocab 50257 --dtype bf16 --repeats 20)
  TRAIN=(--iters $(( QUICK ? 6 : 10 )) --warmup $(( QUICK ? 2 : 4 )))
  COMPILE_BACKEND=train.compile_backend=inductor
  CKPT_MODEL=(model.num_layers=4 model.hidden_size=128 model.num_attention_heads=4 model.seq_length=128)
  SMALL=(--config configs/gpt2_124m.yaml data.use_sample_corpus=true train.precision=bf16)
  LARGE=(--config configs/gpt2_124m.yaml data.use_sample_corpus=true model.num_layers=24 model.hidden_size=2048 model.num_attention_heads=16
         model.seq_length=2048 model.max_position_embeddings=2048 train.precision=bf16)
  SMALL_MICRO=16; LARGE_MICRO=16,8,4,2,1
fi
COMPILE_MODES=$([[ $QUICK == 1 ]] && echo off || echo off,on)

# run_stage N NAME SECONDS CMD...: run CMD within min(SECONDS, budget left), output to NN_NAME.txt and the
# console; one line to summary.txt. A stage that no longer fits is skipped (named in the summary).
run_stage() {
  local number=$1 name=$2 limit=$(( $3 * SCALE )); shift 3
  local left=$(( BUDGET - (SECONDS - START) )) file="$OUT/${number}_${name}.txt"
  (( limit > left )) && limit=$left
  if (( limit < 10 )); then
    echo "$number $name: skipped (out of time)" | tee -a "$OUT/summary.txt"; return 0
  fi
  echo; echo "== $number $name (at most ${limit} s) =="
  local began=$SECONDS
  # timeout runs a program, not a shell function: a fresh bash gets the stage functions and their variables
  local setup
  setup="$(declare -p PYTHON OUT DRY_RUN CKPT_MODEL DEVICE_OVERRIDE TRAIN COMPILE_MODES COMPILE_BACKEND)"
  setup+=$'\n'"$(declare -f stage_checkpoint stage_env stage_throughput)"
  timeout --signal=INT --kill-after=5 "$limit" bash -c "$setup"$'\n''"$@"' stage "$@" 2>&1 | tee "$file"
  local rc=${PIPESTATUS[0]} verdict=ok
  (( rc == 124 )) && verdict="timed out" || { (( rc != 0 )) && verdict="FAILED (exit $rc)"; }
  echo "$number $name: $verdict in $(( SECONDS - began )) s -> $file" | tee -a "$OUT/summary.txt"
}

stage_checkpoint() {
  # save on the device at 1 rank (iterations 1-4, checkpoint at 2), resume on the CPU at tp2 from iteration 2
  local dir="$OUT/checkpoint_run" common=(--config configs/gpt_tiny.yaml "${CKPT_MODEL[@]}" train.train_iters=4
    train.global_batch_size=8 train.micro_batch_size=2 train.eval_iters=0 logging.log_interval=1
    logging.tensorboard=false optim.lr_warmup_iters=1 data.num_workers=0)
  rm -rf "$dir"
  "$PYTHON" pretrain_gpt.py "${common[@]}" "${DEVICE_OVERRIDE[@]}" checkpoint.save_interval=2 run.dir="$dir/saved" \
    || return 1
  TRITON_INTERPRET=0 CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1 "$PYTHON" -m torch.distributed.run \
    --standalone --nproc-per-node 2 pretrain_gpt.py "${common[@]}" train.device=cpu parallel.tp_size=2 \
    checkpoint.save=false checkpoint.load="$dir/saved/checkpoints/iter_0000002" run.dir="$dir/resumed" || return 1
  # GPU (TF32 / other kernels) against CPU: the same curve within 1%, not bitwise
  "$PYTHON" tools/compare_runs.py "$dir/saved" "$dir/resumed" --rtol 1e-2 --strict-iters -1
}

stage_env() {
  # one python for the three lines (each start imports torch: ~2 CPU s)
  "$PYTHON" -c "import torch; print('torch', torch.__version__, '| cuda', torch.version.cuda, '| devices',
torch.cuda.device_count(), '|', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')
import triton; print('triton', triton.__version__)
print('torch.library.triton_op:', hasattr(torch.library, 'triton_op'))"
  if [[ $DRY_RUN == 0 ]]; then nvidia-smi; fi
}

stage_throughput() {
  local label=$1 micro=$2; shift 2
  "$PYTHON" scripts/benchmarks/bench_train_throughput.py "$@" "${TRAIN[@]}" --kernels off,on \
    --compile "$COMPILE_MODES" --micro-batch "$micro" --label "$label" "$COMPILE_BACKEND" "${DEVICE_OVERRIDE[@]}"
}

run_stage 1 checkpoint 120 stage_checkpoint
run_stage 2 env 30 stage_env
run_stage 3 kernels 150 "$PYTHON" -m pytest -q -p no:cacheprovider -p no:xdist "${KERNEL_TESTS[@]}"
run_stage 4 speed 60 "$PYTHON" scripts/benchmarks/bench_kernels.py "${KERNEL_BENCH[@]}"
run_stage 5 gpt124m 120 stage_throughput "GPT-2 124M: " "$SMALL_MICRO" "${SMALL[@]}"
if [[ $QUICK == 0 ]]; then
  run_stage 6 gpt1p3b 240 stage_throughput "1.3B: " "$LARGE_MICRO" "${LARGE[@]}"
fi
echo; echo "gpu_check: done in $(( SECONDS - START )) s; results in $OUT"; cat "$OUT/summary.txt"
! grep -q "FAILED" "$OUT/summary.txt"
