#!/usr/bin/env bash
# Set up the virtual environment (if needed) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh test,plot,explorer,docs
# Two worker processes (pytest-xdist), each test file on one of them; HLOPASS_TEST_WORKERS=0 runs in this
# process, and a later `-n N` on the command line wins.
workers="${HLOPASS_TEST_WORKERS:-2}"
unset HLOPASS_TEST_WORKERS   # this script's own setting: hlopass warns about HLOPASS_ names it does not know
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "$workers" --dist loadfile "$@"
