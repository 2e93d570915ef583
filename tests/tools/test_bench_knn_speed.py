"""Smoke test of tools/bench_knn_speed.py (issue 14's kNN speed benchmark) at tiny sizes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests import ROOT


@pytest.mark.slow
def test_bench_knn_speed_tiny(tmp_path):
    out = tmp_path / "knn.json"
    done = subprocess.run([sys.executable, "-m", "tools.bench_knn_speed", "--tiny", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "speedup (wall): plain/hlopass" in done.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kind"], r["d"]) for r in rows] == [("l2", 3), ("l2", 16), ("l1", 3), ("l1", 16)]
    for row in rows:
        for column in ("hlopass", "hlopass, no unroll", "hand"):
            assert row[column]["same_neighbours"] >= 0.99, (row["kind"], row["d"], column, row[column])
            assert row[column]["wall_s"] > 0 and row[column]["cpu_s"] >= 0
        assert "split:split" in row["rewrites"], row["rewrites"]
    assert all("split:unrolled" in r["rewrites"] for r in rows if r["kind"] == "l1"), rows
