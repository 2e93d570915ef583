"""The demo (python -m hlopass.inspection.demo): capped children, the failure of plain jax.jit, the rescue."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import hlopass
from hlopass.inspection import demo

#: Small enough to be quick, large enough that plain jax.jit cannot fit under the cap:
#: the 784 MB kernel on top of the ~1.6 GB address space a JAX process needs to start.
N = 14_000
CAP = "2GB"


def test_run_capped_reads_the_child_result():
    code = f"import json; print('noise'); print({demo.RESULT_MARKER!r} + json.dumps({{'status': 'ok', 'x': 3}}))"
    result = demo.run_capped(["-c", code], cap_bytes=None)
    assert result["status"] == "ok" and result["x"] == 3 and result["process_seconds"] > 0


def test_run_capped_reports_a_crash_and_applies_the_cap():
    result = demo.run_capped(["-c", "import sys; sys.stderr.write('boom\\n'); sys.exit(3)"], cap_bytes=None)
    assert result["status"] == "crashed" and result["returncode"] == 3 and "boom" in result["error"]
    code = ("import resource, json; soft, _ = resource.getrlimit(resource.RLIMIT_AS); "
            f"print({demo.RESULT_MARKER!r} + json.dumps({{'status': 'ok', 'cap': soft}}))")
    assert demo.run_capped(["-c", code], cap_bytes=3 * 2**30)["cap"] == 3 * 2**30  # ulimit -v counts KiB


def test_reference_rows_match_a_direct_float64_computation():
    x, y, v = demo.example_inputs(50, seed=3)
    rows = np.array([0, 7, 49])
    kernel = np.exp(-0.5 * ((x.astype(float)[:, None] - y.astype(float)[None]) ** 2).sum(-1))
    np.testing.assert_allclose(demo.reference_rows(x, y, v, rows), (kernel @ v.astype(float))[rows], rtol=1e-12)
    assert demo.relative_error([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert demo.relative_error([1.0, 2.5], [1.0, 2.0]) == pytest.approx(0.25)


def test_plain_jit_fails_under_the_cap():
    result = demo.run_capped(["-m", "hlopass.inspection.demo", "--child", "plain", "--n", str(N)],
                             cap_bytes=hlopass.parse_size(CAP, "cap"))
    assert result["status"] == "failed", result
    assert "RESOURCE_EXHAUSTED" in result["error"]
    assert result["xla_temp_bytes"] >= N * N * 4  # XLA itself asks for the whole kernel


def test_table_lists_outcomes_memory_and_rewrites():
    results = {"plain": {"status": "failed", "error": "RESOURCE_EXHAUSTED: Out of memory", "xla_temp_bytes": 2.5e9,
                         "peak_rss_bytes": 2.2e8},
               "hlopass": {"status": "ok", "xla_temp_bytes": 1.5e8, "peak_rss_bytes": 6e8, "compile_seconds": 0.5,
                           "run_seconds": 4.2, "error_vs_float64": 3e-7, "error_vs_plain_rows": 1e-7,
                           "passes": ["split"], "rewrites": ["[split] kernels.py:27: split into 17 chunks"]}}
    table = demo.format_table(results)
    assert "| outcome | failed: RESOURCE_EXHAUSTED: Out of memory | ok |" in table
    assert "| XLA temp memory | 2.50 GB | 150.00 MB |" in table
    assert "4.20 s" in table and "3.0e-07" in table
    assert "[split] kernels.py:27" in table


@pytest.mark.slow
def test_demo_rescues_the_program():
    results = demo.run_demo(n=N, cap=CAP, echo=lambda line: None)
    plain, ours = results["plain"], results["hlopass"]
    assert plain["status"] == "failed" and "RESOURCE_EXHAUSTED" in plain["error"]
    assert ours["status"] == "ok", ours
    assert ours["error_vs_float64"] < 1e-4 and ours["error_vs_plain_rows"] < 1e-4
    assert ours["xla_temp_bytes"] < N * N * 4 / 4
    assert any("split" in r for r in ours["rewrites"])
    assert results["rescued"]


@pytest.mark.slow
def test_demo_command_line(tmp_path):
    import json
    import subprocess
    done = subprocess.run([sys.executable, "-m", "hlopass.inspection.demo", "--n", str(N), "--cap", CAP,
                           "--json", str(tmp_path / "demo.json")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rescued" in done.stdout and "| XLA temp memory |" in done.stdout
    assert json.loads((tmp_path / "demo.json").read_text())["rescued"] is True
