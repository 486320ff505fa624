#!/usr/bin/env bash
# Checkpoint save/restore figures on the GPU (README "Checkpoints"): RUNS="name:strategy[:zero-overrides] ...".
# DeepSpeed comes from the anchor harness's wheels (.anchor/.whl, see examples/bench/README.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .anchor/.whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
M13="--layers 24 --d-model 2048 --heads 16 --seq 2048 --batch 8"
CK=${CKPT_DIR:-/tmp/ckpt_bench}
mkdir -p $CK
for spec in $RUNS; do
  IFS=: read -r name strategy zero <<< "$spec"
  extra=""; [ -n "$zero" ] && extra="--zero ${zero//,/ }"
  for phase in save restore; do
    echo "=== $name $phase" >> $OUT/ckpt_log.txt
    timeout ${RUN_T:-200} python3 examples/bench/ckpt_bench.py --phase $phase --path $CK/$name.ckpt \
      --strategy $strategy $extra $M13 --tag $name >> $OUT/ckpt_log.txt 2>&1 || echo "FAIL $name $phase"
  done
  rm -rf $CK/$name.ckpt
done
grep -h RESULT $OUT/ckpt_log.txt | cut -c1-400
