#!/usr/bin/env bash
# One device call: the GPU test files (NCCL on one GPU, two ranks over gloo, the engine API under torchrun) and
# both Hugging Face examples on the GPU. Hydra travels as wheels in .anchor/.whl (the device image lacks it).
# Output under $OUT: gpu_tests.txt, hf_engine.txt, hf_lightning.txt.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
[ -d .anchor/.whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .anchor/.whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout ${TEST_T:-240} python3 -m pytest -q -p no:cacheprovider ${TEST_ARGS:-tests/test_gpu.py tests/test_gpu_two_ranks.py} \
  > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$?"; tail -1 $OUT/gpu_tests.txt; grep -E "^(FAILED|ERROR)|^E  " $OUT/gpu_tests.txt | head -20
timeout ${HF_T:-120} torchrun --nproc_per_node 1 examples/hf_gpt2_engine.py --epochs ${HF_EPOCHS:-2} \
  --out /tmp/hf_engine_saved > $OUT/hf_engine.txt 2>&1
echo "hf engine rc=$?"; grep -E "epoch|saved|checksum|Error" $OUT/hf_engine.txt | tail -6
timeout ${HF_T:-120} python3 examples/hf_gpt2_lightning.py accelerator=gpu devices=1 epochs=${HF_EPOCHS:-2} \
  checkpointing=true out=/tmp/hf_lightning_saved hydra.run.dir=/tmp/hf_run > $OUT/hf_lightning.txt 2>&1
echo "hf lightning rc=$?"; grep -E "epoch|saved|checksum|Error|val" $OUT/hf_lightning.txt | tail -6
