"""The adjoint benchmark (tools/bench_adjoint.py): its tiny run, every column in a child, gradients equal."""

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
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    by_context = {}
    for r in data["rows"]:
        by_context.setdefault(r["context"], {})[r["column"].split(" (")[0]] = r
    assert set(by_context) == {256, 512}
    for context, rows in by_context.items():
        assert set(rows) == {"plain", "ckpt sqrt(T)", "remat", "adjoint", "sharded", "sharded2"}
        assert all(r["status"] == "ok" for r in rows.values()), rows
        assert rows["adjoint"]["temp_bytes"] * 5 < rows["plain"]["temp_bytes"]
        assert any("[adjoint]" in line and "together with 1 other recurrence" in line
                   for line in rows["adjoint"]["report"])
        # the time axis over 4 host devices: a time region per device, half of one device's temp or less
        assert any("sharded over mesh axis 'x' (4 devices" in line for line in rows["sharded"]["report"])
        assert rows["sharded"]["temp_vs_adjoint"] <= 0.75, rows["sharded"]
        assert any("two levels of checkpointing" in line for line in rows["sharded2"]["report"])
    small = by_context[256]
    for r in small.values():
        assert r["seconds"] > 0 and r["max_rel_diff_vs_plain"] < 1e-5
    capped = by_context[512]      # plain and adjoint run under the address-space cap, the others compile
    assert capped["adjoint"]["cap"] == "4GB" and capped["adjoint"]["seconds"] > 0
    assert capped["adjoint"]["max_rel_diff_vs_plain"] < 1e-5
    for column in ("sharded", "sharded2"):
        assert capped[column]["seconds"] > 0 and capped[column]["max_rel_diff_vs_plain"] < 1e-5
    assert capped["ckpt sqrt(T)"]["seconds"] is None and capped["ckpt sqrt(T)"]["note"] == "compiled only"
