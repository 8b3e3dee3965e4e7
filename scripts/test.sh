#!/usr/bin/env bash
# Lint and the test suite (arguments go to pytest). This is what CI runs (.ci/run).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

# tests/test_report.py opens the HTML report in headless Chromium: Debian's package, where we may install it (root,
# apt-get); elsewhere that test fails saying how to install a browser. The demo does not need it.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ]; then
    echo "test: installing chromium (apt-get), for the report's browser test" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi

.venv/bin/python -m ruff check .
.venv/bin/python -m pytest "$@"
