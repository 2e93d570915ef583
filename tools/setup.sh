#!/usr/bin/env bash
# Create .venv (if needed) and install hlopass into it with the given extras, e.g. `tools/setup.sh test,plot`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install --quiet -e ".[${1:-plot}]"
