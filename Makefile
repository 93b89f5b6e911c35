# Two entry points for a fresh machine: `make run` (the main job) and `make test` (everything).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export VIRTUAL_ENV := $(CURDIR)/$(VENV)
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: run test build lint bench

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "maturin>=1.5,<2" "torch==2.14.0" "cuda-python>=12.8" "nvidia-cuda-nvrtc" \
		"pytest>=8" "hypothesis>=6.100" "ruff>=0.6" "matplotlib>=3.7"
	# vLLM for the integration tests (tests/test_vllm_*.py): the wheel without its serving stack, plus what
	# its config, scheduler, KV cache manager and connector modules import (torch is pinned above).
	$(PY) -m pip install -q --no-deps "vllm==0.33.0"
	$(PY) -m pip install -q "pydantic>=2.12" regex cbor2 psutil pyzmq "transformers>=5.16.1,<5.21" requests \
		msgspec cloudpickle cachetools pybase64 py-cpuinfo prometheus_client einops "aiohttp>=3.14.4" \
		openai-harmony openai uvloop "xgrammar==0.2.8" "fastapi<0.137" partial-json-parser "llguidance>=1.7,<1.8"
	touch $@

build: $(STAMP)
	maturin develop --release -q > /dev/null  # pip lists every satisfied requirement on stdout

run: build
	$(PY) -m hisparse demo

lint: $(STAMP)
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -q -- -D warnings
	$(PY) -m ruff check python tests benches

test: build lint
	cargo test -p hisparse-core -q
	$(PY) -m pytest -q

bench: build
	$(PY) benches/step_cost.py
	$(PY) benches/vllm_step.py
