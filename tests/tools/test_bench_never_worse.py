"""tools/bench_never_worse.py: its tiny run (a subprocess) and the figures it writes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests import ROOT


@pytest.mark.slow
def test_tiny_run_keeps_no_worse_than_plain_and_writes_json(tmp_path):
    out = tmp_path / "never_worse.json"
    done = subprocess.run([sys.executable, "-m", "tools.bench_never_worse", "--tiny",
                           "--json", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ratios hlopass/plain" in done.stdout
    figures = json.loads(out.read_text())
    assert figures["n"] == 200 and figures["threshold"] == "64kB"
    rows = figures["rows"]
    plain, ours = rows["plain jax.jit(value_and_grad(f))"], rows["hlopass.jit(value_and_grad(f))"]
    nested = rows["jax.jit(value_and_grad(hlopass.jit(f)))"]
    for row in (plain, ours, nested, rows["eager value_and_grad(hlopass.jit(f))"]):
        assert row["first_call_s"] > 0 and row["run_s"] > 0
    # the passes change the GP program but cannot bound it: both ways compiled, the better kept
    assert ours["comparisons"] and nested["comparisons"]
    for comparison in ours["comparisons"] + nested["comparisons"]:
        assert comparison["kept"] in ("original", "rewritten")
        kept_bytes = comparison[f"{comparison['kept']}_bytes"]
        assert kept_bytes <= min(comparison["original_bytes"], comparison["rewritten_bytes"]) / 0.95
    assert ours["temp"] <= plain["temp"] and nested["temp"] <= plain["temp"]
