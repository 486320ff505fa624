#!/usr/bin/env bash
# One device call: the largest GPT on one H200 with its 128 GB host. The planner's prediction first
# (python -m lightning_zero.estimate, same shape), then the training run: stage 3 (built on the meta device,
# materialized shard by shard), a share of the optimizer state on the host and stepped there during backward,
# micro-batch gradients of the offloaded share added on the host (no device accumulator), activation
# checkpointing, accumulation. Falls back to 6.7B when 13B fails. Results in $OUT/results.jsonl.
# Shape and schedule from the environment: L D H (layers, d_model, heads), MB ACC FRAC STEPS RUN_T ACT ACCEL.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
free -g | head -2; command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
L=${L:-40} D=${D:-5120} H=${H:-40} MB=${MB:-6} ACC=${ACC:-6} FRAC=${FRAC:-0.55}
N=$(python3 -c "import sys; sys.path.insert(0, 'examples/bench'); from gpt_bench import param_counts; print(param_counts(32000, 2048, $L, $D)[0])")
python3 -m lightning_zero.estimate --params "$N" --batch "$MB" --seq 2048 --accumulate "$ACC" --activations "${ACT:-15}" \
  --host-mem 125 --gpu-mem 139 | tee "$OUT/estimate.txt"
run() {  # layers d_model heads offload_fraction tag
  timeout "${RUN_T:-420}" python3 examples/bench/gpt_bench.py --accelerator "${ACCEL:-gpu}" --strategy zero3 \
    --layers "$1" --d-model "$2" --heads "$3" --seq "${SEQ:-2048}" --batch "$MB" --accumulate "$ACC" --ckpt \
    --warmup 1 --steps "${STEPS:-2}" --tag "$5" --plan \
    --zero offload_optimizer=cpu offload_fraction="$4" offload_accumulation=host > "$OUT/run_$5.log" 2>&1 &
  local pid=$! peak=0 used rc
  while kill -0 "$pid" 2>/dev/null; do  # the machine's used host memory, sampled (ru_maxrss misses pinned pages)
    used=$(free -m | awk '/Mem:/{print $3}'); [ "$used" -gt "$peak" ] && peak=$used; sleep 2; done
  wait "$pid"; rc=$?
  echo "$5 rc=$rc host_used_peak_gib=$(python3 -c "print(round($peak / 1024, 1))")" | tee -a "$OUT/host_peaks.txt"
  grep -E "^(lightning_zero|  )" "$OUT/run_$5.log" | head -40; grep -E "Error|error" "$OUT/run_$5.log" | tail -3
  return "$rc"
}
run "$L" "$D" "$H" "$FRAC" capacity_13b || run "${L2:-32}" "${D2:-4096}" "${H2:-32}" "$FRAC" capacity_6_7b
python3 examples/bench/summary.py
