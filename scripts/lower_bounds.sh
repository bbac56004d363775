#!/usr/bin/env bash
# The lower-bound run: detdata's declared minimum versions (pyproject.toml) in a fresh virtual
# environment, with torch pinned, and the library tests (datasets, identity, the lean-install and
# newcomer tests) on them. Usage: bash scripts/lower_bounds.sh [VENV] (default /tmp/detdata-lb).
# Not part of `make test` (a second environment: about 1.5 GB and several minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-/tmp/detdata-lb}
PY=${PY:-python3}
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q 'torch==2.13.0' numpy==1.26.4 pyarrow==15.0.0 fsspec==2025.3.2 \
  blake3==0.4.1 tqdm==4.60.0 pytest==9.2.0 hypothesis==6.170.17 pytest-timeout==2.4.0 \
  pytest-xdist==3.8.0 psutil==7.2.2 setuptools==84.2.1 aiohttp==3.9.0 requests  # http extra
"$VENV/bin/python" setup.py -q build_ext --inplace
# Left out: the tests whose input is written with Hugging Face `datasets` (a dev tool, not a
# detdata dependency), and the S3 / GCS servers (their wheels are in the dev lock only: skipped).
PYTHONPATH=$PWD "$VENV/bin/python" -m pytest -q -p no:randomly -n 2 -p no:cacheprovider \
  tests/datasets tests/identity tests/test_lean_install.py tests/test_newcomer.py \
  -m "not multiproc and not slow" -k "not hf_ and not hugging_face and not save_to_disk"
