#!/usr/bin/env bash
# One device call: the GPU test files (TEST_ARGS), then zero_auto against explicit presets in the anchor harness
# (.anchor/bench.py, copied from the anchor bench; see its NOTES) on one shape with a GPU memory cap — by default
# the 2.7B GPT (32 x 2560) under a 24 GiB cap, micro-batch 8, checkpointing. Machine-wide host memory is sampled
# during each run (free -m; ru_maxrss misses pinned pages). Output under $OUT: gpu_tests.txt, run_*.log, results.jsonl.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
[ -d .anchor/.whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .anchor/.whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; free -g | head -2
if [ -n "${TEST_ARGS:-}" ]; then
  timeout "${TEST_T:-300}" python3 -m pytest -q -p no:cacheprovider --tb=short $TEST_ARGS > "$OUT/gpu_tests.txt" 2>&1
  echo "gpu tests rc=$?"; tail -1 "$OUT/gpu_tests.txt"; grep -E "^(FAILED|ERROR)|^E  " "$OUT/gpu_tests.txt" | head -30
fi
SHAPE=${SHAPE:---layers 32 --d-model 2560 --heads 20 --seq 2048 --batch 8 --ckpt --gpu-mem-cap-gb 24}
for s in ${STRATS-zero_auto zero2_offload}; do  # STRATS= (empty): the tests only
  timeout "${RUN_T:-180}" python3 .anchor/bench.py --strategy "$s" $SHAPE --warmup "${WARMUP:-2}" --steps "${STEPS:-5}" \
    --tag "$s" ${EXTRA:-} > "$OUT/run_$s.log" 2>&1 &
  pid=$! peak=0
  while kill -0 "$pid" 2>/dev/null; do
    used=$(free -m | awk '/Mem:/{print $3}'); [ "$used" -gt "$peak" ] && peak=$used; sleep 1; done
  wait "$pid"; echo "$s rc=$? host_used_peak_gib=$(python3 -c "print(round($peak / 1024, 1))")"
  grep -E "^lightning_zero|RESULT|Error|warn" "$OUT/run_$s.log" | cut -c1-400 | tail -6
done
