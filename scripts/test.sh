#!/usr/bin/env bash
# Lint and the test suite (arguments go to pytest). This is what CI runs (.ci/run).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

.venv/bin/python -m ruff check .
.venv/bin/python -m pytest "$@"
