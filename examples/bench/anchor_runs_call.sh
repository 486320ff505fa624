#!/usr/bin/env bash
# One device call: runs of the anchor harness (.anchor/bench.py, copied from the anchor bench) listed in RUNS, one per
# line as "tag timeout_s [VAR=value ...] bench.py arguments...", each with the machine's used host memory sampled every second
# (free -m: ru_maxrss misses pinned pages) into $OUT/host_samples.txt ("tag seconds used_MiB") and its log appended
# to $OUT/logs.txt (few files: a device call returns at most eight). Prints each run's rc, sampled host peak, our log
# lines and the RESULT line.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
[ -d .anchor/.whl ] && [ ! -d /tmp/site ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .anchor/.whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests
[ -z "${QUIET:-}" ] && { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; free -g | head -2; df -h /tmp | tail -1; }
while read -r tag limit args; do
  [ -z "$tag" ] && continue
  start=$(date +%s) peak=0 envs=()
  set -- $args
  while [[ "${1:-}" == [A-Z]*=* ]]; do envs+=("$1"); shift; done
  env "${envs[@]}" timeout "$limit" python3 .anchor/bench.py "$@" --tag "$tag" > "$OUT/run_$tag.log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    used=$(free -m | awk '/Mem:/{print $3}'); [ "$used" -gt "$peak" ] && peak=$used
    echo "$tag $(( $(date +%s) - start )) $used" >> "$OUT/host_samples.txt"; sleep 1; done
  wait "$pid"; rc=$?
  echo "== $tag rc=$rc wall_s=$(( $(date +%s) - start )) host_used_peak_gib=$(python3 -c "print(round($peak / 1024, 1))")"
  grep -E "^lightning_zero|Error|Killed|warn" "$OUT/run_$tag.log" | cut -c1-400 | tail -12
  grep -E "^RESULT" "$OUT/run_$tag.log" | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line[7:])
    print({k: r.get(k) for k in ('status', 'error', 'tokens_per_s', 'mfu', 'step_s_median', 'gpu_peak_alloc_gib',
                                 'host_peak_rss_gib', 'plan_name', 'plan_host_gib', 'plan_gpu_total_gib')})"
  { echo "===== $tag rc=$rc"; cat "$OUT/run_$tag.log"; } >> "$OUT/logs.txt"; rm -f "$OUT/run_$tag.log"
done <<< "$RUNS"
