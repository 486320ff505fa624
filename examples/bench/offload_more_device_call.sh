#!/usr/bin/env bash
# One device call: the activation-probe GPU tests, then offload placements the anchor harness has no flags for
# (1.3B benchmark model, bf16-mixed, micro-batch 8): zero2 with half the optimizer state on the host, and stage 3
# with optimizer state and parameters in files on the machine's disk. Results in $OUT/results.jsonl.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k probe > "$OUT/probe_tests.txt" 2>&1
echo "probe tests rc=$?"; tail -1 "$OUT/probe_tests.txt"; grep -E "^E  " "$OUT/probe_tests.txt" | head -8
M="--layers 24 --d-model 2048 --heads 16 --seq 2048 --batch 8 --plan"
timeout 150 python3 examples/bench/gpt_bench.py --strategy zero2 $M --warmup 2 --steps 5 --tag zero2_half_offload \
  --zero offload_optimizer=cpu offload_fraction=0.5 > "$OUT/zero2_half.log" 2>&1 || echo "FAIL zero2_half"
mkdir -p /tmp/lz_nvme
timeout 260 python3 examples/bench/gpt_bench.py --strategy zero3 $M --warmup 1 --steps 2 --tag zero3_offload_nvme \
  --zero offload_optimizer=nvme offload_params=nvme nvme_path=/tmp/lz_nvme nvme_buffer_bytes=6e9 > "$OUT/zero3_nvme.log" 2>&1 || echo "FAIL nvme"
ls /tmp/lz_nvme | head -3; echo "nvme files left: $(ls /tmp/lz_nvme | wc -l)"
python3 examples/bench/summary.py
