"""Smoke run of tools/bench_sharded.py (--tiny) in a subprocess (4 host devices there): it runs, prints
the table, writes JSON whose rows keep jax.jit's shardings, equal numbers and less per-device temp,
within 3 split sizes plus the device's inputs and outputs."""

import json
import os
import subprocess
import sys

import pytest

from tests import ROOT


@pytest.mark.slow
def test_bench_sharded_tiny(tmp_path):
    out = tmp_path / "sharded.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, "-m", "tools.bench_sharded", "--tiny", "--repeats", "1",
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "| kernel matvec | 2,404 x 3,001 |" in done.stdout and "| kNN (k=5) |" in done.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["program"] for r in rows] == ["kernel matvec", "kNN (k=5)"]
    for row in rows:
        assert row["devices"] == 4 and row["same_shardings"], row
        assert row["shardings"][0].startswith("P('x'"), row
        assert row["relative_error"] < 2e-5, row
        ours = row["hlopass"]  # per device: within 3 split sizes (the threshold, by default) plus its inputs and outputs
        assert ours["temp"] <= 3 * row["threshold"] + ours["arguments"] + ours["outputs"], row
        assert ours["temp"] < row["jit"]["temp"] / 1.5, row
