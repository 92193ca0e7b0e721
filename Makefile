# raydlrm: `make demo` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU build: torch 2.13.0 + fbgemm-gpu-cpu 1.8.0 (the pinned pair). Use EXTRA=gpu on CUDA hosts.
EXTRA ?= cpu
STAMP := $(VENV)/.installed-$(EXTRA)

.PHONY: install demo test test-scenarios test-fast lint format clean bench-deps bench-sharded

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned, so nothing resolves a different (CUDA) build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[$(EXTRA),dev]"
	touch $(STAMP)

install: $(STAMP)

# The quickstart's synthetic data set (kept when it is there), then the training job.
demo: $(STAMP)
	$(BIN)/python -m raydlrm data generate --config configs/quickstart.toml
	$(BIN)/python -m raydlrm train --config configs/quickstart.toml

# Two tiers (README "Development"): `make test`, the default tier (15 minutes on a quiet 2-core
# machine), and `make test-scenarios`, the long end-to-end scenarios; CI runs both (.ci/run).
# Each ends with its 40 slowest tests; PYTEST_ARGS adds options (CI: every duration, JUnit XML).
PYTEST := $(BIN)/python -m pytest -q --timeout=900 --durations=40
PYTEST_ARGS ?=

test: $(STAMP)
	$(PYTEST) -m "not gpu and not scenario" $(PYTEST_ARGS) tests

test-scenarios: $(STAMP)
	$(PYTEST) -m "scenario and not gpu" $(PYTEST_ARGS) tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not gpu and not ray and not slow and not scenario" tests

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

clean:
	rm -rf $(VENV) runs mlflow.db mlartifacts data/synthetic

# Benchmark-only dependencies: TorchRec, the baseline of benchmarks/sharded_step.py, and
# LightGBM, the GBDT of benchmarks/baselines.py (src/ never imports them). --no-deps keeps pip
# from replacing the pinned torch / fbgemm-gpu-cpu pair.
bench-deps: $(STAMP)
	$(BIN)/pip install --no-deps torchrec==1.8.0
	$(BIN)/pip install tensordict torchmetrics==1.0.3 pyre-extensions lightgbm==4.7.0

bench-sharded: bench-deps
	$(BIN)/python benchmarks/sharded_step.py

# The GPU check (README "GPU check"): the gpu-marked tests and benchmarks/worker_loop.py on CUDA,
# one line and exit 0 without CUDA. It never builds .venv (the lent GPU machine has no network):
# the venv's python where there is one, else $(PYTHON) with src on the path and the wheels that
# `make gpu-wheels` saved in .whl/ (pydantic and its needs, for Python 3.12).
.PHONY: gpu-check gpu-wheels
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))

gpu-check:
	@$(GPU_PYTHON) benchmarks/gpu_check.py

gpu-wheels:
	$(GPU_PYTHON) benchmarks/gpu_check.py wheels
