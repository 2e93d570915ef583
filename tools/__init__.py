"""The repository's tools, run from its root as modules: ``python -m tools.bench_x`` (shared code in ``tools/harness.py``)."""
