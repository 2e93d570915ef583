"""tools/bench_attention.py: the hand-written columns equal jax.jit, the table, and a tiny run of every column."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests import ROOT
from tools import bench_attention


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hand", ["hand_flash", "hand_map"])
def test_hand_columns_equal_jax_jit(hand, causal):
    q, k, v, ct = bench_attention.inputs(48, 2, 4)
    want = jax.jit(bench_attention.forward_backward, static_argnames="causal")(q, k, v, ct, causal=causal)
    fn = getattr(bench_attention, hand)
    got = jax.jit(fn, static_argnames=("causal", "chunk"))(q, k, v, ct, causal=causal, chunk=16)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5 * float(np.max(np.abs(w))))


def test_table_ratios_reference_and_not_run():
    common = {"threshold": 64_000, "own_largest_bytes": 8e3, "compile_seconds": 1.0, "io_bytes": 1e4}
    rows = [
        {**common, "column": "plain", "status": "not run", "xla_temp_bytes": 3.443e10, "own_largest_bytes": 8.6e9,
         "error": "not run: XLA temp 34.43 GB over the run limit 6.00 GB"},
        {**common, "column": "hlopass", "status": "ok", "xla_temp_bytes": 2e5, "median_seconds": 1.0,
         "median_cpu_seconds": 1.5, "sample": [[1.0, 2.2]]},
        {**common, "column": "flash", "status": "ok", "xla_temp_bytes": 3e5, "median_seconds": 0.5,
         "median_cpu_seconds": 0.6, "sample": [[1.0, 2.0]]},
    ]
    text = bench_attention.table(rows, "title")
    assert "max rel. diff from flash" in text, text
    assert "| 8.60 GB | 34.43 GB | 1 s | not run: XLA temp 34.43 GB over the run limit" in text, text
    assert "| 1 s | 1.5 s | 1.00 | 1.0e-01 |" in text, text
    assert "| 0.5 s | 0.6 s | 2.00 | - |" in text, text
    assert bench_attention.attention_bounds({**rows[1], "all_io_bytes": 8e4}) == (True, True)
    assert bench_attention.attention_bounds({**rows[0], "all_io_bytes": 8e4}) == (False, False)


@pytest.mark.slow
def test_tiny_run_is_bounded_and_equal(tmp_path):
    out = tmp_path / "attention.json"
    proc = subprocess.run([sys.executable, "-m", "tools.bench_attention", "--tiny", "--repeats",
                           "1", "--json", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    rows = {r["column"]: r for r in data["rows"]}
    assert {c for c, r in rows.items() if r["status"] == "ok"} == set(bench_attention.COLUMNS), rows
    ours = rows["hlopass"]
    assert ours["own_largest_bytes"] <= 1.5 * ours["threshold"]
    assert rows["plain"]["own_largest_bytes"] > 10 * ours["threshold"]
    assert ours["splits"], ours  # (at these sizes one loop over query blocks, each row's softmax whole)
    assert "max rel. diff from plain" in proc.stdout
    diffs = [float(line.rsplit("|", 2)[-2]) for line in proc.stdout.splitlines()
             if line.startswith("| ") and line.rsplit("|", 2)[-2].strip() not in ("-", "max rel. diff from plain")
             and not line.startswith("|---")]
    assert len(diffs) == 3 and max(diffs) < 1e-5, proc.stdout
