"""The remat benchmark (tools/bench_remat.py): its tiny run in a subprocess, every column present, the
hand-written checkpointing and hlopass's gradients equal to plain's, hlopass within its limit, and where
its compile went."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests import ROOT


@pytest.mark.slow
def test_tiny_run_writes_every_column_and_hlopass_fits(tmp_path):
    out = tmp_path / "remat.json"
    command = [sys.executable, "-m", "tools.bench_remat", "--tiny", "--json", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    for program in ("loop", "scan"):
        mine = {r["column"]: r for r in rows if r["program"] == program}
        assert set(mine) == {"plain", "hlopass", "ckpt every layer", "ckpt every 3"}
        assert not mine["plain"]["fits"]                     # the automatic limit forces recomputation
        assert mine["hlopass"]["fits"] and mine["hlopass"]["footprint_bytes"] < mine["plain"]["footprint_bytes"]
        assert any("[remat]" in n and "recomputed" in n for n in mine["hlopass"]["notes"])
        for r in mine.values():
            assert r["max_rel_diff"] < 1e-5 and r["seconds"] > 0 and r["ratio_to_plain"] > 0
            assert r["first_call_seconds"] > r["first_call_less_run"] > 0
        stages = mine["hlopass"]["compile_stages"]           # where its compile went
        assert stages["passes"]["remat"] > 0 and stages["rewritten_alone_s"] > 0 and stages["original_alone_s"] > 0
        assert mine["plain"]["compile_stages"] is None
    assert "| layers in lax.scan | hlopass |" in proc.stdout
