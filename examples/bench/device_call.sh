#!/usr/bin/env bash
# The one device call behind the README figures: GPU tests, then anchors and ours side by side.
# Needs the anchor harness copied to .anchor/ (see README.md here); RUNS="strategy:precision ...".
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .anchor/.whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
timeout 200 python3 -m pytest -q -p no:cacheprovider -rA tests/test_gpu.py > $OUT/gpu_tests.txt 2>&1; echo "pytest rc=$?"
grep -E "passed|failed|Error|differ|assert" $OUT/gpu_tests.txt | tail -15

M13="--layers 24 --d-model 2048 --heads 16 --seq 2048 --batch 8"
for spec in $RUNS; do
  s=${spec%%:*}; p=${spec##*:}
  echo "=== $s $p" >> $OUT/log.txt
  timeout ${RUN_T:-140} python3 .anchor/bench.py --strategy $s --precision $p $M13 --tag "$s $p" >> $OUT/log.txt 2>&1 || echo "FAIL $s $p"
done
python3 - <<'PY'
import json, os
p = os.path.join(os.environ["OUT"], "results.jsonl")
rows = [json.loads(l) for l in open(p)] if os.path.exists(p) else []
auto = next((r["tokens_per_s"] for r in rows if r["strategy"] == "auto" and r.get("tokens_per_s")), None)
for r in rows:
    t = r.get("tokens_per_s")
    print(f"{r['tag']:<28} {r['status']:<5} tok/s {t} ratio {round(t/auto,3) if t and auto else '-'} mfu {r.get('mfu')} alloc {r.get('gpu_peak_alloc_gib')} resv {r.get('gpu_peak_reserved_gib')} med {r.get('step_s_median')} {r.get('error','')[:300]}")
PY
