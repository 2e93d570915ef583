"""Smoke run of tools/bench_split.py (--tiny) in a subprocess: it runs, prints the table, writes JSON."""

import json
import subprocess
import sys

from tests import ROOT


def test_bench_split_tiny(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "tools.bench_split", "--tiny", "--repeats", "1",
                           "--json", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "median time ratio split/jax.jit" in proc.stdout
    rows = json.loads(out.read_text())
    assert {r["workload"].split()[0] for r in rows} == {"kernel", "knn", "attention", "sgpr"}
    for row in rows:
        assert row["split_err"] < 1e-4 and row["map_err"] < 1e-4, row
        assert row["split_temp"] < row["jit_temp"], row


def test_bench_gp_tiny(tmp_path):
    """tools/bench_gp.py at tiny sizes: children run, the table prints, the bounds hold."""
    out = tmp_path / "gp.json"
    proc = subprocess.run([sys.executable, "-m", "tools.bench_gp", "--tiny", "--programs",
                           "gather,class_sums", "--passes", "split", "--json", str(out)], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| gather |" in proc.stdout and "| class_sums |" in proc.stdout
    rows = json.loads(out.read_text())
    ours = [r for r in rows if r["column"] == "hlopass"]
    assert len(ours) == 2 and all(r["status"] == "ok" and r["rewrites"] for r in ours), ours
    for row in ours:
        assert row["largest_tensor_bytes"] <= 1.5 * row["threshold"], row
