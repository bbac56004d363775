# Two commands on a fresh machine:  make demo   and   make check (= make test + make test-slow)
#   make demo: a virtual environment from the runtime lock only (torch, numpy, pyarrow, fsspec,
#              blake3, tqdm and their dependencies; requirements-runtime-lock.txt), then the demo.
#   make test: adds the dev lock (test tools, servers, the frameworks the integrations test;
#              requirements-lock.txt) to the same environment, then ruff + mypy + pytest of
#              every test not marked `slow`.
#   make test-slow: the tests marked `slow` (framework runs, soak and stress loops) at their
#              bounded counts (tests/soak.py).
#   make check: both, every test: what CI (.ci/run) runs and the README's test command.
#   make test-soak: the whole suite at the full soak counts.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUNTIME := $(VENV)/.runtime-installed
DEV := $(VENV)/.dev-installed

.PHONY: setup demo test test-slow test-soak check lint bench clean

$(RUNTIME): requirements-runtime-lock.txt pyproject.toml setup.py detdata/storage/_fileread.c
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -r requirements-runtime-lock.txt
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(RUNTIME)

# --no-deps: the dev lock is the exact environment CI tests, resolved once with torch pinned;
# `pip check` on it reports only the conflicts explained at the top of requirements-lock.txt.
$(DEV): $(RUNTIME) requirements-lock.txt
	$(BIN)/pip install -q --no-deps -r requirements-lock.txt
	touch $(DEV)

setup: $(DEV)

demo: $(RUNTIME)
	$(BIN)/detdata demo --out demo_out

lint: $(DEV)
	$(BIN)/ruff check detdata tests benchmarks examples
	$(BIN)/ruff format --check detdata tests benchmarks examples
	$(BIN)/mypy detdata

# --durations=20: every run prints its slowest 20 tests (where the suite's time goes).
PYTEST := $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=20

test: $(DEV) lint
	$(PYTEST) -m "not slow" tests

# DETDATA_SOAK=0: `-m slow` alone asks for the full soak counts (tests/soak.py); CI runs the
# bounded ones. `make test-soak`: the whole suite at the full counts (not part of CI).
test-slow: $(DEV)
	DETDATA_SOAK=0 $(PYTEST) -m slow tests

check: test
	$(MAKE) test-slow

test-soak: $(DEV)
	$(PYTEST) --soak tests

bench: $(DEV)
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) demo_out .pytest_cache .mypy_cache .ruff_cache build detdata/storage/*.so

# Peer loaders (Mosaic Streaming, grain, litData, WebDataset, torchdata) next to detdata on the
# same bytes, in their own environment (benchmarks/peers/.venv, torch pinned; never .venv):
# see benchmarks/peers/README.md. Writes benchmarks/results/peers.json and peers.md.
.PHONY: bench-peers
PEERS_VENV := benchmarks/peers/.venv
$(PEERS_VENV)/.installed: benchmarks/peers/requirements.txt benchmarks/peers/constraints.txt benchmarks/peers/install.sh
	PY=$(PY) bash benchmarks/peers/install.sh
	touch $@

bench-peers: $(PEERS_VENV)/.installed
	$(PEERS_VENV)/bin/python -m benchmarks.peers
