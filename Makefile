# Two commands do everything on a fresh machine:
#   make train   set up (.venv, torch 2.14.1, build) and run the main job: 2 processes on CPU
#   make test    set up and run the test suite
# Set-up steps run only when their inputs change.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
NPROC  ?= 2
ARGS   ?= --compare

DEPS_STAMP  := $(VENV)/.deps-installed
BUILD_STAMP := $(VENV)/.dearcomm-built
SOURCES     := $(shell find csrc -type f) setup.py

.PHONY: setup build train test bench gpu-check clean

setup: $(BUILD_STAMP)
build: $(BUILD_STAMP)

$(DEPS_STAMP): requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

# --no-build-isolation: an isolated build would download and build against a second torch.
$(BUILD_STAMP): $(DEPS_STAMP) $(SOURCES)
	$(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	$(PY) -c "import dearcomm; print('dearcomm built:', dearcomm.build_info())"
	touch $@

train: $(BUILD_STAMP)
	$(VENV)/bin/torchrun --nproc_per_node=$(NPROC) examples/train.py $(ARGS)

test: $(BUILD_STAMP)
	$(PY) -m pytest tests -v -rs --durations=15

bench: $(BUILD_STAMP)
	$(VENV)/bin/torchrun --nproc_per_node=2 benchmarks/overhead.py

# On a GPU machine: every GPU test and the NCCL microbenchmarks, into results/gpu-check.txt.
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf build *.egg-info dearcomm/*.so $(BUILD_STAMP)
