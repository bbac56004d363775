# Two commands on a fresh machine:  make demo   and   make test
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup services demo test lint bench clean

$(STAMP): requirements-lock.txt pyproject.toml setup.py detdata/storage/_fileread.c
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# --no-deps: the lock is the exact environment CI tests (torchtitan and ai2-olmo-core pin
	# ranges that disagree with fsspec/filelock/huggingface-hub pins the rest needs; none of
	# those code paths is used by the framework tests)
	$(BIN)/pip install -q --no-deps -r requirements-lock.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/detdata demo --out demo_out

lint: $(STAMP)
	$(BIN)/ruff check detdata tests benchmarks examples
	$(BIN)/ruff format --check detdata tests benchmarks examples
	$(BIN)/mypy detdata

# nginx for the HTTP range-read tests (apt; SeaweedFS and the GCS emulator come from the lock
# file). Best effort here so that `make test` works without root; CI (.ci/run) requires it.
services:
	@bash .ci/services.sh || echo "make: could not install nginx; the HTTP remote tests will skip (loudly)"

test: $(STAMP) lint services
	$(BIN)/python -m pytest -q -n 2 tests

bench: $(STAMP)
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
