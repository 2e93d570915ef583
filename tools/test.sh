#!/usr/bin/env bash
# Set up a virtual environment (if needed) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install --quiet -e ".[test,plot]"
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
