#!/usr/bin/env bash
# One device call: the host step under gradient clipping, speculative (during backward, redone when the norm
# clips) against after backward (speculative_step=False), beside the GPU alone (auto) and offload without
# clipping; 1.3B GPT (24 x 2048), seq 2048, micro-batch 8, bf16-mixed. Output: $OUT/results.jsonl, run_*.log.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SHAPE=${SHAPE:---layers 24 --d-model 2048 --heads 16 --seq 2048 --batch 8}
one() {  # tag, then gpt_bench arguments
  local tag=$1; shift
  timeout "${RUN_T:-150}" python3 examples/bench/gpt_bench.py $SHAPE --warmup "${WARMUP:-3}" --steps "${STEPS:-8}" \
    --tag "$tag" "$@" > "$OUT/run_$tag.log" 2>&1
  echo "$tag rc=$?"; grep -E "^lightning_zero|RESULT|Error" "$OUT/run_$tag.log" | cut -c1-300 | tail -4
}
one auto --strategy auto --precision bf16-mixed
one z2off --strategy zero2_offload
one z2off_clip_spec --strategy zero2_offload --clip ${CLIP:-1.0}
one z2off_clip_after --strategy zero2_offload --clip ${CLIP:-1.0} --zero stage=2 offload_optimizer=cpu speculative_step=False
one z3off_clip_spec --strategy zero3_offload --clip ${CLIP:-1.0}
