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
    done = subprocess.run([sys.executable, "-m", "tools.bench_knn_l2", "--tiny",
                           "--repeat", "1", "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "hlopass.jit naive" in done.stdout and "vs expanded" in done.stdout
    results = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert all(r["status"] == "ok" for r in results.values())
    hlopass_run, naive = results["hlopass.jit naive"], results["jax.jit naive"]
    assert hlopass_run["rewrites"] == ["squared_distance"]
    assert hlopass_run["stablehlo_max_bytes"] < naive["stablehlo_max_bytes"]
    assert hlopass_run["stablehlo_max_bytes"] <= results["jax.jit expanded"]["stablehlo_max_bytes"]
    assert all(r["same_neighbours"] == 1.0 for r in results.values())


@pytest.mark.slow
def test_bench_exact_rewrites_tiny(tmp_path):
    """The exact-rewrite benchmark runs with no settings, every workload rewritten, same numbers."""
    out = tmp_path / "exact.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HLOPASS_")}
    done = subprocess.run([sys.executable, "-m", "tools.bench_exact_rewrites", "--tiny",
                           "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "speedup" in done.stdout and "diag(A@B)" in done.stdout and "HLOPASS_* unset: True" in done.stdout
    rows = {r["workload"]: r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == 6
    kinds = {"diag(A@B)": "algebraic:diagonal_of_product", "trace(A@B)": "algebraic:trace_of_product",
             "sum(eye*(A@B))": "algebraic:trace_of_product",
             "(x[:,None]*y[None]).sum(-1)": "algebraic:contraction",
             "batched broadcast-multiply-sum": "algebraic:contraction"}
    assert rows["grad of broadcast-multiply-sum"]["rewrites"] == ["algebraic:contraction"] * 3
    for name, kind in kinds.items():
        assert rows[name]["rewrites"] == [kind], rows[name]
        assert rows[name]["max_rel_diff"] < 1e-5
        assert rows[name]["temp_hlopass_bytes"] <= max(rows[name]["temp_jax_jit_bytes"], 16 * 1024)
        assert rows[name]["speedup_vs_jax_jit"] > 0 and rows[name]["hlopass_vs_by_hand"] > 0
