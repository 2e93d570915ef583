"""The matrix-chain benchmark's tiny run: every chain reordered, same values as jax.jit."""

import json
import subprocess
import sys

import pytest

from tests import ROOT


@pytest.mark.slow
def test_tiny_run_reorders_every_chain(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "-m", "tools.bench_matrix_chain", "--tiny",
                             "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "speedup" in result.stdout and "A@B@v" in result.stdout
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 6
    for row in rows:
        assert row["rewrites"], row["chain"]
        assert row["flops_after"] < row["flops_before"]
        # XLA may fuse a small reduction into the product (no temp at all); never an n x n temp
        assert row["temp_hlopass_bytes"] <= max(row["temp_jax_jit_bytes"], 1024)
        assert row["max_rel_diff"] < 1e-4
