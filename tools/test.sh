#!/usr/bin/env bash
# Set up the virtual environment (if needed) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh test,plot,explorer,docs
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
