"""The kNN benchmark of the algebraic pass runs end to end (``--tiny``) and its figures hang together."""

import json
import os
import subprocess
import sys

import pytest

from tests import ROOT


@pytest.mark.slow
def test_bench_knn_l2_tiny(tmp_path):
    out = tmp_path / "knn.json"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_knn_l2.py"), "--tiny",
                           "--repeat", "1", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "hlopass.jit naive" in done.stdout and "vs expanded" in done.stdout
    results = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert all(r["status"] == "ok" for r in results.values())
    hlopass_run, naive = results["hlopass.jit naive"], results["jax.jit naive"]
    assert hlopass_run["rewrites"] == ["squared_distance"]
    assert hlopass_run["stablehlo_max_bytes"] < naive["stablehlo_max_bytes"]
    assert hlopass_run["stablehlo_max_bytes"] <= results["jax.jit expanded"]["stablehlo_max_bytes"]
    assert all(r["same_neighbours"] == 1.0 for r in results.values())
