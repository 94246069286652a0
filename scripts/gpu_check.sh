#!/usr/bin/env bash
# GPU check of the device backend (issue 8), for a machine with CUDA and PyTorch:
#   1. the device tests (tests/test_device_*.py) with TIEGRAD_TEST_DEVICE=cuda, so every
#      op, the mirror protocol (C7), group gradients (C8), the device optimizers and
#      the TiedLM training check run on the GPU instead of torch's CPU;
#   2. the W1 tied-LM benchmark on the GPU: tiegrad on EagerSession(device="cuda")
#      against PyTorch eager on the same GPU, alternating steps.
# tiegrad is used from this checkout (src/ on PYTHONPATH), so nothing is installed.
# Usage: bash scripts/gpu_check.sh [STEPS]      (STEPS of the benchmark, default 30)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
STEPS="${1:-30}"

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
"$PY" - <<'PY'
import torch
assert torch.cuda.is_available(), "CUDA is not available to this PyTorch"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
PY

echo "== device tests on cuda"
TIEGRAD_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider tests/test_device_*.py

echo "== W1 tied-LM on cuda"
"$PY" -m benchmarks.device_w1 --device cuda --steps "$STEPS"
