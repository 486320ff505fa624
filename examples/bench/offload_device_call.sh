#!/usr/bin/env bash
# One device call: the GPU offload tests, then our offload strategies and the DeepSpeed/FSDP offload anchors
# side by side in the anchor harness (copied to .anchor/, see README.md here). SIZE=13 (1.3B, default) or 27
# (2.7B under a 24 GiB cap with activation checkpointing, as in the anchors' NOTES.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .anchor/.whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
if [ -n "$TESTS" ]; then
  timeout 220 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_two_ranks.py -k offload > $OUT/gpu_tests.txt 2>&1
  tail -1 $OUT/gpu_tests.txt; grep -E "^(FAILED|ERROR)|^E  " $OUT/gpu_tests.txt | head -10
fi
if [ "${SIZE:-13}" = 27 ]; then
  M="--layers 32 --d-model 2560 --heads 20 --seq 2048 --batch 8 --warmup 2 --steps 4 --ckpt --gpu-mem-cap-gb 24"
else
  M="--layers 24 --d-model 2048 --heads 16 --seq 2048 --batch 8 --warmup 2 --steps 5"
fi
for spec in ${RUNS:-zero2_offload zero3_offload deepspeed_stage_2_offload:pin deepspeed_stage_3_offload:pin fsdp_cpu_offload}; do
  s=${spec%%:*}; extra=""; [ "${spec#*:}" = pin ] && extra="--pin-memory"
  timeout ${RUN_T:-120} python3 .anchor/bench.py --strategy $s $extra $M --tag "$spec" > $OUT/$s.log 2>&1 || echo "FAIL $spec"
done
python3 examples/bench/summary.py
