#!/usr/bin/env bash
# One device call for the DeepSpeed drop-in on CUDA: the DeepSpeed test files (engines on the GPU; two ranks share
# it over gloo), then the GPT-2 DeepSpeed script on NCCL (bf16, zero.Init, stage 3), run twice so the second resumes.
# Output under $OUT: ds_tests.txt, gpt2_first.txt, gpt2_resume.txt.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/tests
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# -v: one line a test as it ends, so a run stopped by the timeout still says which passed; the GPT-2 script's own
# runs are below (its pytest twins would repeat them)
LIGHTNING_ZERO_BACKEND=gloo timeout ${TEST_T:-300} python3 -m pytest -v -p no:cacheprovider --tb=short \
  ${DS_TESTS:-tests/test_deepspeed_checkpoints.py tests/test_engine_methods.py tests/test_skip_schedule.py \
  tests/test_deepspeed_scripts.py} -k "not gpt2" > $OUT/ds_tests.txt 2>&1
echo "ds tests rc=$?"; tail -1 $OUT/ds_tests.txt; grep -E "^(FAILED|ERROR)|^E  " $OUT/ds_tests.txt | head -20
python3 - > /tmp/ds_bf16.json <<'PY'
import json; c = json.load(open("examples/ds_config_gpt2.json")); c["bf16"] = {"enabled": True}; print(json.dumps(c))
PY
for run in first resume; do
  timeout 120 torchrun --nproc_per_node 1 examples/deepspeed_gpt2_script.py --deepspeed --deepspeed_config /tmp/ds_bf16.json \
    --zero_init --epochs $([ $run = first ] && echo 2 || echo 3) --save_dir /tmp/gpt2_ds --export_dir /tmp/gpt2_export \
    > $OUT/gpt2_$run.txt 2>&1
  echo "gpt2 $run rc=$?"; grep -E "resumed|eval loss|Error" $OUT/gpt2_$run.txt | tail -4
done
