#!/usr/bin/env bash
# One device call for the offload figures: the anchor harness on the 1.3B GPT (24 x 2048, seq 2048, micro-batch 8,
# bf16-mixed, no clipping — the anchors' setting): the GPU alone, zero2_offload, zero3_offload, the delayed step,
# zero2_offload with 14 host-step threads (two cores left to the training loop and the copies), MORE_RUNS; then one step of
# zero2_offload profiled without and with clipping 1.0 (gpt_bench --profile, text timelines by trace_summary.py);
# then where the NVMe path's host memory goes; then LARGE (the largest GPT under zero_auto, default 41 x 5120) and the GPU tests in TEST_ARGS.
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
SHAPE13="--layers 24 --d-model 2048 --heads 16 --seq 2048 --batch 8 --warmup 3 --steps 8"
[ -z "${SKIP_13:-}" ] && RUNS="auto 90 --strategy auto $SHAPE13
z2off 90 --strategy zero2_offload $SHAPE13
z3off 90 --strategy zero3_offload $SHAPE13
z2delayed 90 --strategy zero2 $SHAPE13 --zero stage=2 offload_optimizer=cpu delayed_step=True
z2off_t14 90 OMP_NUM_THREADS=14 --strategy zero2_offload $SHAPE13
${MORE_RUNS:-}" bash examples/bench/anchor_runs_call.sh
for clip in 0 1.0; do
  [ -n "${SKIP_PROFILE:-}" ] && break
  timeout 100 python3 examples/bench/gpt_bench.py --strategy zero2_offload --layers 24 --d-model 2048 --heads 16 \
    --seq 2048 --batch 8 --warmup 3 --steps 3 --clip $clip --tag "profile_clip$clip" --profile /tmp/trace_$clip.json \
    > "$OUT/run_profile_clip$clip.log" 2>&1
  echo "== profile clip=$clip rc=$?"; grep -E "^lightning_zero|Error" "$OUT/run_profile_clip$clip.log" | cut -c1-300 | tail -4
  python3 examples/bench/trace_summary.py /tmp/trace_$clip.json | tee "$OUT/timeline_clip$clip.txt"
done
if [ -z "${SKIP_NVME:-}" ]; then  # where the NVMe path's host memory goes: anonymous vs file pages, setup vs training
  mkdir -p /tmp/lz_nvme
  timeout 120 python3 examples/bench/gpt_bench.py --strategy zero3 --layers 24 --d-model 2048 --heads 16 --seq 2048 \
    --batch 8 --warmup 1 --steps 2 --plan --tag nvme --zero offload_optimizer=nvme offload_params=nvme \
    nvme_path=/tmp/lz_nvme nvme_buffer_bytes=6e9 > "$OUT/run_nvme.log" 2>&1
  echo "== nvme rc=$?"; grep -E "^RESULT" "$OUT/run_nvme.log" | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line[7:])
    print({k: v for k, v in r.items() if 'host' in k or k in ('status', 'error', 'tokens_per_s', 'plan_host_gib')})"
fi
LARGE=${LARGE-41 5120 40}
if [ -n "$LARGE" ]; then
  set -- $LARGE
  QUIET=1 RUNS="large 240 --strategy zero_auto --layers $1 --d-model $2 --heads $3 --batch 6 --accumulate 6 --ckpt --warmup 1 --steps 2" \
    bash examples/bench/anchor_runs_call.sh
fi
if [ -n "${TEST_ARGS:-}" ]; then
  timeout "${TEST_T:-150}" python3 -m pytest -q -p no:cacheprovider --tb=short $TEST_ARGS > "$OUT/gpu_tests.txt" 2>&1
  echo "gpu tests rc=$?"; tail -1 "$OUT/gpu_tests.txt"; grep -E "^(FAILED|ERROR)|^E  " "$OUT/gpu_tests.txt" | head -30
fi
