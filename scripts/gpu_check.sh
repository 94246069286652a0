#!/usr/bin/env bash
# GPU check of the device backend (issues 8 and 21), for a machine with CUDA and PyTorch:
#   1. the device tests (tests/test_device_*.py) with TIEGRAD_TEST_DEVICE=cuda, so every
#      op, the mirror protocol (C7), group gradients (C8), the device optimizers (torch's
#      fused kernels), the synchronisation counts and the TiedLM training check run on
#      the GPU instead of torch's CPU;
#   2. W1 tied-LM and W2 small-MLP on the GPU: tiegrad on EagerSession(device="cuda")
#      against PyTorch eager on the same GPU, alternating steps (benchmarks.device_w1);
#   3. L1 Llama fine-tune (issue 48: the SmolLM2-135M-shaped model, batch 4 x 256, AdamW)
#      on the GPU: tiegrad's LlamaLM against transformers' LlamaForCausalLM (eager
#      attention), the same saved random weights (benchmarks.device_w1 --workload L1).
# tiegrad is used from this checkout (src/ on PYTHONPATH), so nothing is installed.
# With OUT set to a folder, the figures are also written there as JSON (gpu_W1.json, ...).
# Each part has a time limit; the whole check takes a few minutes on one GPU.
# Usage: bash scripts/gpu_check.sh [W1_STEPS] [W2_STEPS] [L1_STEPS]   (defaults 30, 200, 20)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
DEVICE="${TIEGRAD_GPU_DEVICE:-cuda}"
W1_STEPS="${1:-30}"
W2_STEPS="${2:-200}"
L1_STEPS="${3:-20}"

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
if [ "$DEVICE" = cuda ]; then
  "$PY" - <<'PY'
import torch
assert torch.cuda.is_available(), "CUDA is not available to this PyTorch"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
PY
fi

echo "== device tests on $DEVICE"
TIEGRAD_TEST_DEVICE="$DEVICE" timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_device_*.py

# workload, steps, time limit in seconds (L1 builds and saves a 135M-parameter model first)
for spec in "W1 $W1_STEPS 90" "W2 $W2_STEPS 90" "L1 $L1_STEPS 240"; do
  set -- $spec
  echo "== $1 on $DEVICE"
  json=()
  [ -n "${OUT:-}" ] && json=(--json "$OUT/gpu_$1.json")
  timeout "$3" "$PY" -m benchmarks.device_w1 --workload "$1" --device "$DEVICE" --steps "$2" "${json[@]}"
done
