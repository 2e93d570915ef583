"""The GPU benchmark (tools/bench_gpu.py) at its CPU smoke sizes: every column of a kNN and a kernel
mat-vec case runs, the neighbours are exact and the values equal plain jax.jit's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests import ROOT


@pytest.mark.slow
def test_quick_run_writes_every_column(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "-m", "tools.bench_gpu", "--quick", "--cases", "knn3,matvec1e5",
                           "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = {c["case"]: c for c in json.loads(out.read_text())["cases"]}
    assert set(cases) == {"knn3", "matvec1e3"}   # the quick run labels the case by its size
    knn = {r["column"]: r for r in cases["knn3"]["rows"]}
    assert set(knn) == {"plain", "by_hand", "hlopass", "hlopass_100MB"}
    for name in ("by_hand", "hlopass", "hlopass_100MB"):
        assert knn[name]["status"] == "ok" and knn[name]["rows_wrong"] == 0, knn[name]
    matvec = [r for r in cases["matvec1e3"]["rows"] if r["column"].startswith("hlopass")]
    assert len(matvec) == 4 and all(r["status"] == "ok" and r["max_rel_diff"] < 1e-3 for r in matvec), matvec
