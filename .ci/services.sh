#!/usr/bin/env bash
# Install system packages the tests need (servers are started by the test fixtures by PID).
set -euo pipefail
true
