"""Smoke run of tools/bench_hvp.py (--tiny) through a subprocess."""

import json
import subprocess
import sys

from tests import ROOT


def test_bench_hvp_tiny(tmp_path):
    out = tmp_path / "hvp.json"
    proc = subprocess.run([sys.executable, "-m", "tools.bench_hvp", "--tiny", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "handwritten" in proc.stdout and "hlopass_grad" in proc.stdout
    rows = json.loads(out.read_text())
    assert {r["method"] for r in rows} == {"default", "handwritten", "hlopass", "hlopass_grad"}
    for r in rows:
        assert r["rel_err_vs_default"] < 1e-4
        if r["method"].startswith("hlopass"):
            assert r["temp_ratio_vs_handwritten"] <= 1.25
