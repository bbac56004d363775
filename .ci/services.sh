#!/usr/bin/env bash
# Install system packages the tests need (servers are started by the test fixtures by PID).
#   nginx-light: the HTTP(S) range-read server of tests/storage/test_remote.py (started per test session,
#                never as a system service). SeaweedFS (S3) and gcp-storage-emulator (GCS)
#                come from the pip lock file, so nothing else is needed here.
# Idempotent and fast when already installed; `apt-get update` only when the install fails.
set -euo pipefail

need=()
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || need+=(nginx-light)
if [ "${#need[@]}" -eq 0 ]; then
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
# Do not start the packaged service: the tests run their own nginx on a free port.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
  $SUDO chmod +x "$policy"
  created_policy=1
fi
cleanup() { if [ "$created_policy" -eq 1 ]; then $SUDO rm -f "$policy"; fi; }
trap cleanup EXIT

install() { $SUDO apt-get install -y -q --no-install-recommends "${need[@]}"; }
if ! install; then
  echo "services.sh: apt-get install failed; running apt-get update and retrying" >&2
  $SUDO apt-get update -q
  install
fi
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || {
  echo "services.sh: nginx still missing after installing ${need[*]}" >&2
  exit 1
}
