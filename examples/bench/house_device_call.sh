#!/usr/bin/env bash
# One device call after a refactor: the GPU test files, then the figures the README reports that a change to the
# step, gradients or offload could move (1.3B on one GPU: auto, zero2/zero3 bf16-true, zero2/zero3 offload), in the
# anchor harness (copied to .anchor/, see README.md here). Records: $OUT/results.jsonl; summary printed.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ -z "$NO_TESTS" ]; then
  timeout ${TEST_T:-300} python3 -m pytest -q -p no:cacheprovider ${TEST_ARGS:-tests/test_gpu.py tests/test_gpu_two_ranks.py} \
    > $OUT/gpu_tests.txt 2>&1
  echo "gpu tests rc=$?"; tail -1 $OUT/gpu_tests.txt; grep -E "^(FAILED|ERROR)|^E  " $OUT/gpu_tests.txt | head -20
fi
M="--layers 24 --d-model 2048 --heads 16 --seq 2048 --batch 8"
for spec in ${RUNS:-auto:bf16-mixed zero2:bf16-true zero3:bf16-true zero2_offload:bf16-mixed zero3_offload:bf16-mixed}; do
  s=${spec%%:*}; p=${spec##*:}; steps="--warmup 3 --steps 10"
  case $s in *offload*) steps="--warmup 2 --steps 5";; esac
  timeout ${RUN_T:-150} python3 .anchor/bench.py --strategy $s --precision $p $M $steps --tag "$s $p" > $OUT/$s.log 2>&1 \
    || echo "FAIL $spec"
done
python3 examples/bench/summary.py
