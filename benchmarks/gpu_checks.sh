#!/usr/bin/env bash
# The GPU checks in one run, for a machine with a CUDA device (none is needed anywhere else):
#   bash benchmarks/gpu_checks.sh [OUT_DIR]
# tests/test_cuda.py (every optimizer on CUDA vs the CPU, bf16 state, zero gradients, DeepSpeed fp16 loss
# scaling), the single-process tests on that machine, then the host-overhead and step-time benchmarks with
# --device cuda. Results (and logs) go to OUT_DIR (default benchmarks/results).
set -uo pipefail
out="${1:-benchmarks/results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
unset DS_ACCELERATOR
py="${PYTHON:-python3}"
status=0
xdist=$("$py" -c "import xdist" 2>/dev/null && echo "-n 8")
"$py" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" || exit 2
"$py" -m pytest tests/test_cuda.py -q -p no:cacheprovider $xdist 2>&1 | tee "$out/test_cuda.log" | tail -3 || status=1
"$py" -m pytest tests -q -p no:cacheprovider $xdist --timeout 300 2>&1 | tee "$out/tests_on_gpu_machine.log" | tail -3 || status=1
"$py" -m benchmarks.overhead --device cuda --results-dir "$out" 2>&1 | tail -20 || status=1
"$py" -m benchmarks.step_time --device cuda --results-dir "$out" 2>&1 | tail -28 || status=1
exit $status
