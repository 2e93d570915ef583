"""The adjoint benchmark (tools/bench_adjoint.py): its tiny run, every column, gradients equal."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests import ROOT


@pytest.mark.slow
def test_tiny_run_writes_every_column(tmp_path):
    out = tmp_path / "adjoint.json"
    proc = subprocess.run([sys.executable, "-m", "tools.bench_adjoint", "--tiny", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["column"].split(" (")[0]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"plain", "ckpt sqrt(T)", "remat", "adjoint"}
    assert rows["adjoint"]["temp_bytes"] < rows["plain"]["temp_bytes"]
    assert any("[adjoint]" in line and "diagonal" in line for line in rows["adjoint"]["report"])
    for r in rows.values():
        assert r["seconds"] > 0 and r["max_rel_diff_vs_plain"] < 1e-5
