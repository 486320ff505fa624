#!/usr/bin/env bash
# One device call: FIRST_RUNS (anchor-harness lines, see anchor_runs_call.sh); the offload figures on the 1.3B GPT
# (24 x 2048, seq 2048, micro-batch 8, bf16-mixed, no clipping — the anchors' setting): the GPU alone, zero2_offload,
# zero3_offload, the delayed step, MORE_RUNS (ONLY13: the tags to run); one step profiled at each clipping value in CLIPS for each of PROFILES
# ("strategy" or "strategy:KEY=VALUE,...", default zero2_offload; gpt_bench --profile; text timelines by
# trace_summary.py); the NVMe path's host memory (anonymous vs file pages,
# setup vs training; SKIP_NVME=1 skips it); LARGE ("layers d_model heads": the largest GPT under zero_auto) when
# more than 200 s of DEADLINE (s, default 590) are left; the GPU tests in TEST_ARGS. Few files come back from a
# device call: logs go to $OUT/logs.txt, timelines to $OUT/timelines.txt, records to $OUT/results.jsonl.
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
begin=$(date +%s)
[ -n "${FIRST_RUNS:-}" ] && RUNS="$FIRST_RUNS" bash examples/bench/anchor_runs_call.sh
SHAPE13="--layers 24 --d-model 2048 --heads 16 --seq 2048 --batch 8 --warmup 3 --steps 8"
RUNS13="auto 90 --strategy auto $SHAPE13
z2off 90 --strategy zero2_offload $SHAPE13
z3off 90 --strategy zero3_offload $SHAPE13
z2delayed 90 --strategy zero2 $SHAPE13 --zero stage=2 offload_optimizer=cpu delayed_step=True
${MORE_RUNS:-}"
if [ -n "${ONLY13:-}" ]; then  # the tags to run, e.g. "auto z2delayed"
  RUNS13=$(echo "$RUNS13" | awk -v only=" $ONLY13 " 'index(only, " " $1 " ")')
fi
[ -z "${SKIP_13:-}" ] && QUIET=1 RUNS="$RUNS13" bash examples/bench/anchor_runs_call.sh
for profiled in ${PROFILES:-zero2_offload}; do  # "strategy" or "strategy:KEY=VALUE,KEY=VALUE" (its --zero fields)
for clip in ${CLIPS-0 1.0}; do
  strategy=${profiled%%:*} fields=""; [[ "$profiled" == *:* ]] && fields=${profiled#*:} && fields=${fields//,/ }
  timeout 100 python3 examples/bench/gpt_bench.py --strategy $strategy --layers 24 --d-model 2048 --heads 16 \
    --seq 2048 --batch 8 --warmup 3 --steps 3 --clip $clip --tag "profile_clip$clip" --profile /tmp/trace_$clip.json \
    ${fields:+--zero $fields} > /tmp/profile.log 2>&1
  echo "== profile $profiled clip=$clip rc=$?"; grep -E "^lightning_zero|Error" /tmp/profile.log | cut -c1-300 | tail -4
  { echo "===== profile $profiled clip=$clip"; cat /tmp/profile.log; } >> "$OUT/logs.txt"
  { echo "== $profiled clip $clip"; python3 examples/bench/trace_summary.py /tmp/trace_$clip.json; } | tee -a "$OUT/timelines.txt"
done
done
if [ -z "${SKIP_NVME:-}" ]; then  # where the NVMe path's host memory goes: anonymous vs file pages, setup vs training
  mkdir -p /tmp/lz_nvme
  # the same training without offload: the process's own anonymous memory (interpreter, torch, the CUDA context and
  # the kernels it loads, Lightning, the data) that no placement plan counts
  timeout 100 python3 examples/bench/gpt_bench.py --strategy zero3 --layers 24 --d-model 2048 --heads 16 --seq 2048 \
    --batch 8 --warmup 1 --steps 2 --tag nvme_base > /tmp/nvme_base.log 2>&1
  echo "== nvme_base rc=$?"; grep -E "^RESULT" /tmp/nvme_base.log | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line[7:])
    print({k: v for k, v in r.items() if 'host' in k or k in ('status', 'error', 'tokens_per_s')})"
  { echo "===== nvme_base"; cat /tmp/nvme_base.log; } >> "$OUT/logs.txt"
  timeout 120 python3 examples/bench/gpt_bench.py --strategy zero3 --layers 24 --d-model 2048 --heads 16 --seq 2048 \
    --batch 8 --warmup 1 --steps 2 --plan --tag nvme --zero offload_optimizer=nvme offload_params=nvme \
    nvme_path=/tmp/lz_nvme nvme_buffer_bytes=6e9 > /tmp/nvme.log 2>&1
  echo "== nvme rc=$?"; grep -E "^RESULT" /tmp/nvme.log | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line[7:])
    print({k: v for k, v in r.items() if 'host' in k or k in ('status', 'error', 'tokens_per_s', 'plan_host_gib')})"
  { echo "===== nvme"; cat /tmp/nvme.log; } >> "$OUT/logs.txt"
fi
LARGE=${LARGE-41 5120 40}
left=$(( ${DEADLINE:-590} - ($(date +%s) - begin) ))
if [ -n "$LARGE" ] && [ "$left" -gt 200 ]; then
  set -- $LARGE
  QUIET=1 RUNS="large $((left - 20)) --strategy zero_auto --layers $1 --d-model $2 --heads $3 --batch 6 --accumulate 6 --ckpt --warmup 1 --steps 2" \
    bash examples/bench/anchor_runs_call.sh
elif [ -n "$LARGE" ]; then echo "== large skipped: ${left} s left"; fi
if [ -n "${TEST_ARGS:-}" ]; then
  timeout "${TEST_T:-150}" python3 -m pytest -q -p no:cacheprovider --tb=short $TEST_ARGS > "$OUT/gpu_tests.txt" 2>&1
  echo "gpu tests rc=$?"; tail -1 "$OUT/gpu_tests.txt"; grep -E "^(FAILED|ERROR)|^E  " "$OUT/gpu_tests.txt" | head -30
fi
