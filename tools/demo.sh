#!/usr/bin/env bash
# Set up the virtual environment (if needed) and run the main demonstration.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh plot
exec .venv/bin/python -m hlopass.inspection.demo "$@"
