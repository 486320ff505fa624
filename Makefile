# The two commands of the README: `make train` (the main job) and `make test` (the suite).
PY ?= python3
PIP := $(PY) -m pip
TORCH_PIN ?= torch==2.13.0
# PyTorch's CPU index beside PyPI: pip then prefers 2.13.0+cpu (a few hundred MB) over PyPI's CUDA build (GBs);
# where that index is unreachable, a local CPU wheel (pip's find-links) or PyPI's build is taken instead.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
ARGS ?=

.PHONY: setup train test parity-full lint bench-cpu

# Keep a torch that is already installed (a CUDA build, say); install the CPU pin only when missing.
setup:
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_PIN)" --extra-index-url "$(TORCH_CPU_INDEX)"
	@$(PIP) install -q -e ".[test]"

train: setup
	$(PY) -m lightning_zero.train $(ARGS)

test: setup
	$(PY) -m pytest -q tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; exit $$rc

# Every cell of the parity matrix (the suite runs one slice of it per run): about 2 minutes on 2 cores.
parity-full: setup
	PARITY_SLICE=all $(PY) -m pytest -q tests/test_parity_matrix.py

lint: setup
	$(PY) -m ruff check lightning_zero tests examples

bench-cpu: setup
	$(PY) examples/bench/cpu_step.py
