#!/usr/bin/env bash
# Build benchmarks/peers/.venv: the project's torch (2.13.0, CPU) plus each peer loader,
# every install constrained to that torch (constraints.txt). A peer that cannot be installed
# is reported in benchmarks/peers/.venv/install-status.txt and shows as n/a in the table;
# the others still run. Never touches the project's .venv.
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PY:-python3}"
VENV="$HERE/.venv"
PIP="$VENV/bin/pip"
C="$HERE/constraints.txt"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$PIP" install -q torch==2.13.0 || { echo "torch==2.13.0 could not be installed"; exit 1; }
# detdata's own dependencies, matplotlib (figures), pytest and hypothesis (data_wait's smoke
# test with the peers), at the versions of the project's lock file
"$PIP" install -q -c "$C" $(grep -E '^(numpy|pyarrow|fsspec|blake3|tqdm|matplotlib|pytest|hypothesis)==' "$ROOT/requirements-lock.txt")
"$PIP" install -q --no-deps -e "$ROOT"
: > "$VENV/install-status.txt"
grep -vE '^(#|torch==|$)' "$HERE/requirements.txt" | while read -r peer; do
  if "$PIP" install -q -c "$C" "$peer" > "$VENV/install-$peer.log" 2>&1; then
    echo "$peer ok" >> "$VENV/install-status.txt"
  else
    echo "$peer FAILED (see $VENV/install-$peer.log)" >> "$VENV/install-status.txt"
  fi
done
# litdata and mosaicml-streaming require torchvision; the wheel pip finds is not built for the
# CPU torch and cannot be imported next to it. Neither peer needs it for token data, but
# streaming imports two names from it: remove it and put the stub (stubs/) on the path.
"$PIP" uninstall -y -q torchvision || true
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$HERE/stubs" > "$SITE/detdata-peers-stubs.pth"
"$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
cat "$VENV/install-status.txt"
