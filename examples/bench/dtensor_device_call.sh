#!/usr/bin/env bash
# One device call: DTensor state and ZeRO <-> FSDP2 checkpoints on CUDA (tests/test_gpu_dtensor.py: ZeRO on two
# ranks sharing the GPU over gloo, FSDP2 on one rank over NCCL), then the DeepSpeed drop-in's device call
# (examples/bench/deepspeed_device_call.sh). Output under $OUT: dtensor_tests.txt and that script's files.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/tests
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)"
timeout ${DT_T:-300} python3 -m pytest -v -p no:cacheprovider --tb=short tests/test_gpu_dtensor.py > $OUT/dtensor_tests.txt 2>&1
echo "dtensor tests rc=$?"; tail -1 $OUT/dtensor_tests.txt; grep -E "^(FAILED|ERROR)|^E  " $OUT/dtensor_tests.txt | head -20
bash examples/bench/deepspeed_device_call.sh
