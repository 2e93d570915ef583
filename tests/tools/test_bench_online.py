"""tools/bench_online.py: a tiny run of one row (every column in its own capped child), and its table."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests import ROOT
from tools import bench_online


def test_table_ratios_and_bounds():
    rows = [
        {"row": "contrastive", "column": "plain", "status": "ok", "threshold": 2_000_000, "own_largest_bytes": 8e6,
         "xla_temp_bytes": 2.56e8, "median_seconds": 2.0, "io_bytes": 1e6, "sample": [[1.0, 2.0]]},
        {"row": "contrastive", "column": "hlopass", "status": "ok", "threshold": 2_000_000,
         "own_largest_bytes": 2e6, "xla_temp_bytes": 4e6, "median_seconds": 1.0, "io_bytes": 1e6,
         "sample": [[1.0, 2.2]]},
        {"row": "contrastive", "column": "hand", "status": "ok", "threshold": 2_000_000, "own_largest_bytes": 2e6,
         "xla_temp_bytes": 4e6, "median_seconds": 0.5, "io_bytes": 1e6},
    ]
    text = bench_online.table(rows)
    assert "| 0.50 | 2.00 | 1.0e-01 |" in text, text
    assert bench_online.bounds(rows[1]) == (True, True)
    assert bench_online.bounds(rows[0]) == (False, False)


@pytest.mark.slow
def test_tiny_run_is_bounded_and_equal(tmp_path):
    out = tmp_path / "online.json"
    proc = subprocess.run([sys.executable, "-m", "tools.bench_online", "--tiny", "--rows",
                           "contrastive", "--repeats", "1", "--json", str(out)], capture_output=True, text=True,
                          cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| contrastive loss" in proc.stdout
    import json
    rows = json.loads(out.read_text())["rows"]
    assert {r["column"] for r in rows if r["status"] == "ok"} == {"plain", "hlopass", "hand"}
    ours = next(r for r in rows if r["column"] == "hlopass")
    assert ours["own_largest_bytes"] <= 1.5 * ours["threshold"]
    assert any("rescaled" in s for s in ours["splits"]), ours["splits"]


def test_side_by_side_tiny(tmp_path):
    out = tmp_path / "side.json"
    assert bench_online.main(["--side-by-side", "--tiny", "--rows", "decoding", "--repeats", "1",
                              "--json", str(out)]) == 0
    import json
    (row,) = json.loads(out.read_text())["side_by_side"]
    assert row["row"] == "decoding" and row["hlopass_cpu_seconds"] > 0 and row["hand_cpu_seconds"] > 0
