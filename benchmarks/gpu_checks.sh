#!/usr/bin/env bash
# The GPU checks and figures in one bounded run, for a machine with a CUDA device (none is needed anywhere else):
#   bash benchmarks/gpu_checks.sh [OUT_DIR]
# tests/test_cuda.py (every optimizer on CUDA vs the CPU, bf16 state, zero gradients, DeepSpeed fp16 loss scaling
# where DeepSpeed is installed, no synchronizing call, the skip decided on the device equal to the host check's, and
# Megatron-core's DistributedOptimizer on its real CUDA path at world size 1 where megatron-core is installed),
# tests/test_iterative.py, tests/test_device_skip.py and tests/test_factorization_census.py (no eigh/svd/qr between
# refreshes on CUDA's own routes), then the step-time, training-throughput (with the default
# non-finite check and, for the rules that decide it on the device, without it) and step-profile benchmarks with
# --device cuda (130M and 350M). Each phase has a time limit, so the whole run fits one call of a short GPU lease
# (under 10 minutes on an H200); results and logs go to OUT_DIR (default benchmarks/results). The factorization
# benchmark is apart: python -m benchmarks.factorizations --device cuda.
set -uo pipefail
out="${1:-benchmarks/results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
unset DS_ACCELERATOR
py="${PYTHON:-python3}"
status=0
xdist=$("$py" -c "import xdist" 2>/dev/null && echo "-n 8")
"$py" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" || exit 2
phase() {  # phase SECONDS LOG COMMAND...: run with a time limit, keep the log, show its tail
    local limit=$1 log=$2; shift 2
    echo "== $* (limit ${limit} s)"
    timeout "$limit" "$@" > "$out/$log" 2>&1 || { echo "   exit $?"; status=1; }
    grep -v -E "USDT|UserWarning|_warn_once|real_accelerator" "$out/$log" | tail -n 30
}
phase 150 test_cuda.log "$py" -m pytest tests/test_cuda.py tests/test_iterative.py tests/test_device_skip.py \
    tests/test_factorization_census.py -q \
    -p no:cacheprovider $xdist --timeout 100
phase 140 step_time.log "$py" -m benchmarks.step_time --device cuda --sizes 130m,350m --repeats 6 --max-seconds 5 \
    --results-dir "$out"
phase 170 throughput.log "$py" -m benchmarks.throughput --device cuda --sizes 130m,350m --iters 6 --warmup 2 \
    --results-dir "$out"
phase 80 throughput_ignore.log "$py" -m benchmarks.throughput --device cuda --sizes 350m --iters 6 --warmup 2 \
    --optimizers scale,sinkgd,dasgo,racs,alice,alice0 --variants "" --on-nonfinite ignore --out throughput_cuda_ignore \
    --results-dir "$out"
phase 50 step_profile.log "$py" -m benchmarks.step_profile --device cuda --sizes 130m \
    --optimizers sinkgd,racs,asgo,sumo,alice --results-dir "$out"
# ZeRO-Offload on one GPU over NCCL (issue 56): every rule steps CPU partitions whose statistics and gathers are
# staged through the GPU (shardopt/sharding/staging.py); within 1e-5 of one process after 3 steps
rules=scale,sinkgd,racs,muon,swan,asgo,dasgo,sumo,alice,alice0
phase 150 offload_gpu.log env DS_ACCELERATOR=cuda "$py" -m torch.distributed.run --nproc_per_node 1 \
    tests_dist/offload_worker.py --backend nccl --api initialize --engine zero3p --batch 4 --optimizer $rules \
    --reference --out "$out/offload_gpu.pt"
phase 20 offload_gpu_check.log "$py" -c "
import sys, torch
r = torch.load('$out/offload_gpu.pt')
bad = 0
for n in '$rules'.split(','):
    ref = r['reference.' + n]
    d = max((r[n][k].cpu() - ref[k]).abs().max().item() for k in ref)
    print(n, r[n]['__meta__'].get('stepped'), f'{d:.3g}')
    bad += d > 1e-5 or r[n]['__meta__'].get('stepped') == 'DeepSpeedCPUAdam'
sys.exit(1 if bad else 0)"
# Lightning's GPU-only strategies (issue 64; DDP and ModelParallelStrategy run in CI on CPU, tests_dist/test_trainers.py):
# configure_optimizers returns shardopt.create_optimizer(self, ...); 2 steps, a checkpoint, fit(ckpt_path=...) to 4
# steps on one GPU, against 4 steps in one CPU process within 1e-5
for strategy in fsdp deepspeed_stage_2 deepspeed_stage_3; do
    phase 120 "lightning_$strategy.log" "$py" -m torch.distributed.run --nproc_per_node 1 \
        tests_dist/trainers_worker.py --trainer lightning --accelerator gpu --strategy $strategy --phase resume \
        --optimizer racs --dir "$out/lightning_$strategy" --out "$out/lightning_$strategy.pt"
    phase 20 "lightning_${strategy}_check.log" "$py" -c "
import sys, torch
r = torch.load('$out/lightning_$strategy.pt')
d = max((r['params'][k].cpu() - r['reference']['params'][k]).abs().max().item() for k in r['params'])
print('lightning $strategy racs vs one CPU process', f'{d:.3g}', r['meta'] == r['reference']['meta'])
sys.exit(0 if d <= 1e-5 and r['meta'] == r['reference']['meta'] else 1)"
done
exit $status
