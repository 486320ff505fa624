#!/usr/bin/env bash
# One device call: convergence of the delayed host step. GPT-2 small (12 x 768) on the embedded character corpus
# through the app, zero2_offload, bf16-mixed, clipping 1.0, STEPS steps: the exact host step and delayed_step=True
# from the same seed; then the GPU test files (TEST_ARGS). Hydra travels as wheels in .anchor/.whl.
# Output: $OUT/conv_<mode>/ (the CSV logs: train/loss, val/loss), $OUT/conv_<mode>.txt, gpu_tests.txt.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
[ -d .anchor/.whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .anchor/.whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests
for mode in exact delayed; do
  delayed=false; [ "$mode" = delayed ] && delayed=true
  timeout "${CONV_T:-150}" python3 -m lightning_zero.train model=gpt2_124m strategy=zero2_offload \
    strategy.delayed_step=$delayed precision=bf16-mixed trainer.max_steps="${STEPS:-400}" \
    trainer.val_check_interval=50 trainer.log_every_n_steps=10 trainer.enable_progress_bar=false \
    data.seq_len=256 data.batch_size=32 sample_chars=0 hydra.run.dir="$OUT/conv_$mode" > "$OUT/conv_$mode.txt" 2>&1
  echo "$mode rc=$?"; grep -E "val/loss|host step|Error" "$OUT/conv_$mode.txt" | tail -12
done
if [ -n "${TEST_ARGS:-}" ]; then
  timeout "${TEST_T:-300}" python3 -m pytest -q -p no:cacheprovider --tb=short $TEST_ARGS > "$OUT/gpu_tests.txt" 2>&1
  echo "gpu tests rc=$?"; tail -1 "$OUT/gpu_tests.txt"; grep -E "^(FAILED|ERROR)|^E  " "$OUT/gpu_tests.txt" | head -30
fi
