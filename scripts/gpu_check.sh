#!/usr/bin/env bash
# One command for a machine with one NVIDIA GPU (about 8 minutes on an H100/H200):
#   1. the fused-kernel tests on CUDA (compiled Triton, fp32 and bf16 against the torch references),
#   2. kernel micro-benchmarks (forward + backward time and peak memory, fused vs eager torch, bf16),
#   3. training throughput of GPT-2 124M and a 1.3B model (hidden 2048, 24 layers, seq 2048, bf16, the largest
#      micro-batch that fits) with fused kernels off/on and torch.compile off/on: tokens/s, TFLOP/s and MFU
#      against the GPU's peak (table below, chosen by the device name).
#
#   scripts/gpu_check.sh                 # on the GPU machine, from anywhere
#   scripts/gpu_check.sh --cpu-dry-run   # the same steps at toy sizes on a CPU (Triton interpreter,
#                                        # compile backend aot_eager), to debug this script without a GPU
set -euo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
case "${1:-}" in
  --cpu-dry-run) DRY_RUN=1 ;;
  "") ;;
  *) echo "usage: scripts/gpu_check.sh [--cpu-dry-run]" >&2; exit 2 ;;
esac
PYTHON="${PYTHON:-python3}"

# Dense bf16 tensor-core peak TFLOP/s (no sparsity), from the vendors' data sheets; matched against the name.
peak_tflops() {
  case "$1" in
    *GH200*|*H200*|*"H100 SXM"*|*"H100 80GB HBM3"*) echo 989 ;;
    *"H100 NVL"*) echo 835 ;;
    *H100*) echo 756 ;;          # H100 PCIe
    *B200*) echo 2250 ;;
    *A100*) echo 312 ;;
    *L40S*) echo 362 ;;
    *"RTX 4090"*) echo 165 ;;
    *A10G*) echo 70 ;;
    *L4*) echo 121 ;;
    *V100*) echo 125 ;;
    *) echo "" ;;
  esac
}

if [[ $DRY_RUN == 1 ]]; then
  export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""
  DEVICE="cpu (dry run)"
  PEAK=0.1   # nominal, so that the MFU column is exercised; meaningless on a CPU
  KERNEL_BENCH=(--tokens 64 --hidden 48 --heads 4 --vocab 1000 --dtype fp32 --repeats 2)
  TRAIN=(--iters 3 --warmup 1)
  COMPILE_BACKEND=train.compile_backend=aot_eager
  SMALL=(--config configs/gpt_tiny.yaml model.num_layers=2 model.hidden_size=64 model.seq_length=64)
  LARGE=(--config configs/gpt_tiny.yaml model.num_layers=2 model.hidden_size=96 model.num_attention_heads=4
         model.seq_length=128 train.precision=bf16)
  SMALL_MICRO=2
  LARGE_MICRO=4,2
else
  export TRITON_INTERPRET=0
  if ! DEVICE="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"; then
    echo "gpu_check: nvidia-smi found no GPU (use --cpu-dry-run on a CPU machine)" >&2
    exit 2
  fi
  PEAK="$(peak_tflops "$DEVICE")"
  KERNEL_BENCH=(--tokens 8192 --hidden 2048 --heads 16 --vocab 50257 --dtype bf16 --repeats 20)
  TRAIN=(--iters 10 --warmup 4)
  COMPILE_BACKEND=train.compile_backend=inductor
  SMALL=(--config configs/gpt2_124m.yaml data.use_sample_corpus=true train.precision=bf16)
  LARGE=(--config configs/gpt2_124m.yaml data.use_sample_corpus=true model.num_layers=24 model.hidden_size=2048 model.num_attention_heads=16
         model.seq_length=2048 model.max_position_embeddings=2048 train.precision=bf16)
  SMALL_MICRO=16
  LARGE_MICRO=32,16,8,4,2,1
fi
PEAK_ARGS=()
if [[ -n "$PEAK" ]]; then PEAK_ARGS=(--peak-tflops "$PEAK"); fi
echo "gpu_check on: $DEVICE; peak ${PEAK:-unknown (MFU not printed)} TFLOP/s bf16"
"$PYTHON" -c "import torch; print('torch', torch.__version__, '| cuda', torch.version.cuda)"
"$PYTHON" -c "import triton; print('triton', triton.__version__)" || echo "triton: not installed"
START=$SECONDS

echo; echo "== 1/3 fused-kernel tests against the torch references =="
"$PYTHON" -m pytest -q -p no:cacheprovider tests/model/test_kernels.py

echo; echo "== 2/3 kernel micro-benchmarks: fused vs eager torch =="
"$PYTHON" scripts/benchmarks/bench_kernels.py "${KERNEL_BENCH[@]}"

echo; echo "== 3/3 training throughput (steady state; kernels off/on x compile off/on) =="
"$PYTHON" scripts/benchmarks/bench_train_throughput.py "${SMALL[@]}" "${TRAIN[@]}" "${PEAK_ARGS[@]}" \
  --kernels off,on --compile off,on --micro-batch "$SMALL_MICRO" --label "GPT-2 124M: " "$COMPILE_BACKEND"
"$PYTHON" scripts/benchmarks/bench_train_throughput.py "${LARGE[@]}" "${TRAIN[@]}" "${PEAK_ARGS[@]}" \
  --kernels off,on --compile off,on --micro-batch "$LARGE_MICRO" --label "1.3B: " "$COMPILE_BACKEND"

echo; echo "gpu_check: done in $((SECONDS - START)) s"
