#!/usr/bin/env bash
# One device call: how the host step of offload hides, 1.3B GPT (24 x 2048), seq 2048, micro-batch 8,
# bf16-mixed, gradient clipping 1.0 (what most LLM recipes use): the GPU alone (auto); zero2_offload with the
# host step speculative during backward (the default) and after backward (speculative_step=False); the
# delayed step (delayed_step=True); zero3_offload speculative. Output: $OUT/results.jsonl, run_*.log.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SHAPE=${SHAPE:---layers 24 --d-model 2048 --heads 16 --seq 2048 --batch 8}
CLIP=${CLIP:-1.0}
one() {  # tag, then gpt_bench arguments
  local tag=$1; shift
  timeout "${RUN_T:-120}" python3 examples/bench/gpt_bench.py $SHAPE --warmup "${WARMUP:-3}" --steps "${STEPS:-8}" \
    --tag "$tag" "$@" > "$OUT/run_$tag.log" 2>&1
  echo "$tag rc=$?"; grep -E "^lightning_zero|RESULT|Error" "$OUT/run_$tag.log" | cut -c1-400 | tail -3
}
Z2="stage=2 offload_optimizer=cpu"
for run in ${RUNS:-auto spec after delayed z3spec}; do
  case $run in
    auto) one auto --strategy auto --precision bf16-mixed --clip "$CLIP" ;;
    spec) one z2off_spec --strategy zero2_offload --clip "$CLIP" ;;
    after) one z2off_after --strategy zero2 --clip "$CLIP" --zero $Z2 speculative_step=False ;;
    delayed) one z2off_delayed --strategy zero2 --clip "$CLIP" --zero $Z2 delayed_step=True ;;
    noclip) one z2off_noclip --strategy zero2_offload ;;
    z3spec) one z3off_spec --strategy zero3_offload --clip "$CLIP" ;;
  esac
done
