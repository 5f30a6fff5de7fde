#!/usr/bin/env bash
# GPU-machine run: install tiermem, run the CUDA tests and the benchmarks, logs under $OUT.
# Usage (device tool, carry .whl): bash scripts/device_run.sh PART   (PART: tests | optim | all | large13 | large20 | ...)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
part=${1:-all}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
SPILL=${SPILL:-$HOME/tiermem-spill}; mkdir -p "$SPILL"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
run() {  # run NAME SECONDS CMD...: one stage, its own log, bounded in time
  local name=$1 secs=$2; shift 2
  echo "=== $name: $*" | tee -a "$OUT/summary.txt"
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  tail -n 25 "$OUT/$name.log" | tee -a "$OUT/summary.txt"; echo "rc=$rc" | tee -a "$OUT/summary.txt"
}
if [[ $part == tests || $part == all ]]; then
  run cuda_tests 240 python3 -m pytest -m cuda -q -p no:cacheprovider tests
  run bench_transfer 60 tiermem bench transfer --nbytes 1GiB
  run bench_adam 90 tiermem bench adam --numel 200000000
  run bench_io 90 tiermem bench io --dir "$SPILL" --nbytes 1GiB
  run bench_activations 150 tiermem bench activations --steps 3 --warmup 1
fi
if [[ $part == optim || $part == all ]]; then
  run bench_optim 420 tiermem bench optim --steps 3 --nvme-steps 1 --nvme-dir "$SPILL"
fi
if [[ $part == cudatests_optim ]]; then
  run cuda_tests 150 python3 -m pytest -m cuda -q -p no:cacheprovider tests
  run bench_optim 420 tiermem bench optim --steps 3 --nvme-steps 1 --nvme-dir "$SPILL"
fi
if [[ $part == optim2 ]]; then
  run cuda_hybrid 100 python3 -m pytest -m cuda -q -p no:cacheprovider tests/optim/test_hybrid_adam.py
  run bench_optim 420 tiermem bench optim --steps 3 --nvme-steps 1 --setups gpu,0.25,0.5,1.0,1.0:nvme --nvme-dir "$SPILL"
fi
if [[ $part == hybrid ]]; then
  run cuda_hybrid 120 python3 -m pytest -m cuda -q -p no:cacheprovider tests/optim/test_hybrid_adam.py
fi
if [[ $part == diag ]]; then
  run diag_kernel 60 python3 -m pytest -m cuda -q -p no:cacheprovider tests/optim/test_hybrid_adam.py -k "same_inputs or 1.0-cpu-False"
  TIERMEM_NATIVE_ISA=avx2 run diag_avx2 60 python3 -m pytest -m cuda -q -p no:cacheprovider tests/optim/test_hybrid_adam.py -k "same_inputs or 1.0-cpu-False"
fi
if [[ $part == store ]]; then
  run cuda_store 90 python3 -m pytest -m cuda -q -p no:cacheprovider tests/store
fi
if [[ $part == facts || $part == large13 || $part == large20 ]]; then
  { free -g; df -h / /tmp "$SPILL"; nproc; } 2>&1 | tee "$OUT/facts.txt"
fi
if [[ $part == large13 ]]; then
  run cuda_tests 200 python3 -m pytest -m cuda -q -p no:cacheprovider tests
  run large_13b 330 python3 examples/train_large.py --config examples/configs/large/h200_13b_nvme.yaml --nvme-dir "$SPILL"
fi
if [[ $part == large ]]; then  # issue 10: 13B fp32 moments, 20B bf16 moments, a 32B refused
  { free -g; df -h "$SPILL"; } 2>&1 | tee "$OUT/facts.txt"
  run cuda_hybrid 100 python3 -m pytest -m cuda -q -p no:cacheprovider tests/optim tests/store
  run large_32b_refused 30 python3 examples/train_large.py --config examples/configs/large/h200_32b_too_big.yaml
  run large_13b 190 python3 examples/train_large.py --config examples/configs/large/h200_13b_nvme.yaml --nvme-dir "$SPILL"
  run large_20b 290 python3 examples/train_large.py --config examples/configs/large/h200_20b_bf16.yaml --nvme-dir "$SPILL"
fi
if [[ $part == perf ]]; then  # issues 4 and 6: CUDA tests, trace vs LRU, optimizer placement
  run cuda_optim 150 python3 -m pytest -m cuda -q -p no:cacheprovider tests/optim tests/schedule tests/offload tests/telemetry
  run tune_policy 240 tiermem tune --layers 24 --d-model 2048 --heads 16 --seq 2048 --batch 8 --vocab 32000 \
    --num-layers 23 --prefetch-depth 2 --offload-fraction 0.5 --state-tier cpu --policy lru,trace \
    --act-gpu-budget 2,64 --steps 3 --warmup 2 --gpu-budget 48GiB --telemetry-dir "$OUT/tune"
  run bench_optim 330 tiermem bench optim --steps 3 --setups gpu,0.5,0.5+fwd,1.0,1.0+fwd --nvme-dir "$SPILL"
  rm -f "$OUT/install.log" "$OUT/gpu.txt"  # at most 8 files come back
fi
if [[ $part == s3a ]]; then  # session 3: CUDA tests (trace placement, auto layers), chunk size, bf16 moments
  run cuda_tests 170 python3 -m pytest -m cuda -q -p no:cacheprovider tests/optim tests/schedule tests/offload tests/telemetry
  run bench_optim 330 tiermem bench optim --steps 3 --accum 1,4 \
    --setups gpu,0.5,0.5+chunk=16M,1.0,1.0+chunk=16M,1.0+chunk=64M,1.0+bf16+chunk=16M,0.5+fwd+chunk=16M
  run bench_activations 100 tiermem bench activations --layers 24 --d-model 2048 --heads 16 --seq 2048 \
    --batch 8 --vocab 32000 --steps 3 --warmup 2 --only "auto,all but last"
  rm -f "$OUT/install.log" "$OUT/gpu.txt"
fi
if [[ $part == s3b ]]; then  # session 3: the GPU lane (gpu_step_fraction), auto layers in tune
  run cuda_optim 120 python3 -m pytest -m cuda -q -p no:cacheprovider tests/optim
  run bench_optim_lane 330 tiermem bench optim --steps 3 --accum 1,4 \
    --setups gpu,1.0+chunk=16M,1.0+chunk=16M+gpu=0.3,1.0+chunk=16M+gpu=0.5,1.0+chunk=16M+gpu=0.7,0.5+chunk=16M+gpu=0.5,0.5+fwd+chunk=16M+gpu=0.5,1.0+fwd+chunk=16M+gpu=0.5
  run tune_auto 150 tiermem tune --layers 24 --d-model 2048 --heads 16 --seq 2048 --batch 8 --vocab 32000 \
    --num-layers auto,23 --prefetch-depth 2 --offload-fraction 0.5 --state-tier cpu --policy lru,trace \
    --act-gpu-budget 2 --steps 3 --warmup 5 --gpu-budget 48GiB --telemetry-dir "$OUT/tune"
  rm -f "$OUT/install.log" "$OUT/gpu.txt"
fi
if [[ $part == s3c ]]; then  # session 3: the final optimizer table (default chunks), lane on own streams
  run cuda_optim 120 python3 -m pytest -m cuda -q -p no:cacheprovider tests/optim
  run bench_optim_final 420 tiermem bench optim --steps 3 --accum 1,4 \
    --setups gpu,0.25,0.5,0.5+fwd,1.0,1.0+gpu=0.3,1.0+gpu=0.5,1.0+bf16,1.0+bf16+gpu=0.5
  rm -f "$OUT/install.log" "$OUT/gpu.txt"
fi
if [[ $part == s3d ]]; then  # session 3: how much of f=1 the GPU lane should take
  run bench_optim_lane_share 300 tiermem bench optim --steps 3 --accum 1,4 \
    --setups gpu,1.0+gpu=0.7,1.0+gpu=0.85,1.0+gpu=1.0
  rm -f "$OUT/install.log" "$OUT/gpu.txt"
fi
if [[ $part == s3e ]]; then  # session 3: bf16 moments through the GPU lane
  run cuda_lane 60 python3 -m pytest -m cuda -q -p no:cacheprovider tests/optim -k "lane or bf16"
  run bench_optim_bf16_lane 200 tiermem bench optim --steps 3 --accum 1,4 --setups gpu,1.0+bf16+gpu=1.0,1.0+bf16
  rm -f "$OUT/install.log" "$OUT/gpu.txt"
fi
if [[ $part == dist ]]; then  # issue 9 on nvidia-h200-x2: NCCL parity, bench optim --world 2
  nvidia-smi -L | tee "$OUT/gpus.txt"
  run cuda_dist 240 python3 -m pytest -m cuda -q -p no:cacheprovider tests/distributed
  run bench_optim_world2 240 tiermem bench optim --world 2 --steps 3 --accum 1,4 --setups gpu,0.5,1.0 --timeout 230
  rm -f "$OUT/install.log" "$OUT/gpu.txt"
fi
if [[ $part == dist_tests ]]; then
  run cuda_dist 240 python3 -m pytest -m cuda -q -p no:cacheprovider tests/distributed
  rm -f "$OUT/install.log"
fi
