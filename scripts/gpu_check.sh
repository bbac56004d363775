#!/usr/bin/env bash
# GPU checks for the device path (detdata/_device.py), in one go, < 8 minutes.
#
#   scripts/gpu_check.sh            # from anywhere; results under $OUT if set, else benchmarks/results/_tmp_gpu_check/
#
# 1. picks a Python: .venv (running `make setup` first if there is none; falls back to
#    the system python3 with this checkout on PYTHONPATH if setup cannot install offline),
# 2. refuses to go on without CUDA (the point is to run what CPU machines skip),
# 3. runs tests/loading/test_device.py: the CUDA tests must run, not skip (any skip fails the check),
# 4. runs benchmarks/gpu_feed.py --device cuda (bandwidth + training feed), JSON to $OUT.
# Exit status: 0 only if the tests passed with no skips and the benchmark finished.
# Limits: setup 150 s + tests 120 s + benchmark 200 s (expected: ~30 s + ~1 min).
# GPU_CHECK_DRY_CPU=1 rehearses the plumbing on a CPU machine (CUDA tests skip, benchmark
# in CPU smoke mode); its results say nothing about a GPU.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUTDIR="${OUT:-$ROOT/benchmarks/results/_tmp_gpu_check}"  # _tmp*: git-ignored
mkdir -p "$OUTDIR"
LOG="$OUTDIR/gpu_check.log"
: >"$LOG"
say() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "$LOG"; }
START=$SECONDS

# ---------------------------------------------------------------- python
PY=""
if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch, pytest, blake3" 2>/dev/null; then
    PY="$ROOT/.venv/bin/python"
else
    say "no usable .venv: running make setup (limit 150 s)"
    if timeout 150 make setup >>"$LOG" 2>&1 && .venv/bin/python -c "import torch, pytest" 2>/dev/null; then
        PY="$ROOT/.venv/bin/python"
    elif python3 -c "import torch, pytest, blake3, numpy, fsspec, pyarrow" 2>/dev/null; then
        say "make setup failed (see log); using system python3 with PYTHONPATH=$ROOT"
        PY="$(command -v python3)"
        export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    else
        say "FAIL: no Python with torch + pytest + detdata's dependencies"; exit 2
    fi
fi
say "python: $PY"
"$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import torch
print("torch", torch.__version__, "cuda build", torch.version.cuda, "available", torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    print(f"  cuda:{i}", torch.cuda.get_device_name(i))
EOF
DEVICE=cuda
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    if [ "${GPU_CHECK_DRY_CPU:-0}" = 1 ]; then
        say "DRY RUN on CPU (GPU_CHECK_DRY_CPU=1): CUDA tests will skip, benchmark in smoke mode"
        DEVICE=cpu
    else
        say "FAIL: CUDA is not available here; this script is for a GPU machine"; exit 2
    fi
fi
command -v nvidia-smi >/dev/null && nvidia-smi -L >>"$LOG" 2>&1

# ----------------------------------------------------------------- tests
say "tests/loading/test_device.py (limit 120 s)"
timeout 120 "$PY" -m pytest -q -rs -p no:cacheprovider tests/loading/test_device.py \
    --junitxml="$OUTDIR/test_device.xml" 2>&1 | tee "$OUTDIR/test_device.log" | tail -25 | tee -a "$LOG"
TEST_RC=${PIPESTATUS[0]}
if [ "$DEVICE" = cuda ] && grep -q "SKIPPED" "$OUTDIR/test_device.log"; then
    say "FAIL: some device tests were skipped on a GPU machine"; [ "$TEST_RC" -eq 0 ] && TEST_RC=3
fi
say "tests exit status: $TEST_RC"

# ------------------------------------------------------------- benchmark
say "benchmarks/gpu_feed.py --device $DEVICE (limit 200 s)"
timeout 200 "$PY" benchmarks/gpu_feed.py --device "$DEVICE" --out "$OUTDIR/gpu_feed.json" 2>&1 \
    | tee "$OUTDIR/gpu_feed.txt" | tee -a "$LOG"
BENCH_RC=${PIPESTATUS[0]}
if [ "$BENCH_RC" -eq 0 ] && [ "$DEVICE" = cuda ]; then
    mkdir -p benchmarks/results && cp "$OUTDIR/gpu_feed.json" benchmarks/results/gpu_feed.json
fi
say "benchmark exit status: $BENCH_RC"

say "done in $((SECONDS - START)) s; results in $OUTDIR"
[ "$TEST_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ]
