"""The benchmark suite (tools/bench_suite.py): its tiny run, and the table it generates."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

import hlopass

from tests import ROOT
from tools import bench_suite, harness


def test_sample_difference_is_relative_and_refuses_mismatched_shapes():
    assert harness.sample_difference([[1.0, 2.0]], [[1.0, 2.0]]) == 0.0
    assert harness.sample_difference([[1.0, 2.2]], [[1.0, 2.0]]) == pytest.approx(0.1)
    assert harness.sample_difference([[1.0]], [[1.0, 2.0]]) is None
    assert harness.sample_difference([[1.0]], None) is None


def test_markdown_table_has_ratios_and_marks_out_of_memory():
    rows = [
        {"workload": "w", "column": "plain", "status": "failed", "error": "RESOURCE_EXHAUSTED: Out of memory"},
        {"workload": "w", "column": "hand", "status": "ok", "median_seconds": 2.0, "xla_temp_bytes": 4e7},
        {"workload": "w", "column": "hlopass", "status": "ok", "median_seconds": 1.0, "xla_temp_bytes": 2e7,
         "max_rel_diff": 1e-7, "peak_rss_bytes": 3e8},
        {"workload": "v", "column": "plain", "status": "ok", "median_seconds": 3.0, "xla_temp_bytes": 1e9},
        {"workload": "v", "column": "hlopass", "status": "ok", "median_seconds": 1.5, "xla_temp_bytes": 1e7},
    ]
    table = bench_suite.markdown_table(rows, {"w": "a workload"}, tiny=False)
    assert "| w | OOM | 2 s, temp 40.00 MB | - | 1 s, temp 20.00 MB, RSS 300.00 MB | - | - | 2.00x | 1.0e-07 |" in table
    assert "| v | 3 s, temp 1.00 GB | - | - | 1.5 s, temp 10.00 MB | 100.00x | 2.00x | - | - |" in table
    assert "Machine:" in table and "cores" in table and "- w: a workload" in table


@pytest.mark.slow
def test_tiny_run_writes_results_that_check_out(tmp_path):
    out = tmp_path / "bench"
    done = subprocess.run([sys.executable, "-m", "tools.bench_suite", "--tiny", "--no-keops", "--out", str(out),
                           "--json", str(tmp_path / "copy.json")], capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[1/1]" in done.stdout and "| workload |" in done.stdout  # progress, then the table
    results = json.loads((out / "results.json").read_text())["results"]
    assert json.loads((tmp_path / "copy.json").read_text())["results"] == results
    by_key = {(r["workload"], r["column"]): r for r in results}
    workloads = {r["workload"] for r in results}
    assert {"kernel_matvec", "knn_l2", "knn_l1", "matrix_chain"} <= workloads
    for (workload, column), row in by_key.items():
        if row["status"] == "n/a":
            continue
        assert row["status"] == "ok", row
        assert row["median_seconds"] > 0
        if column != "plain":
            assert row["max_rel_diff"] is not None and row["max_rel_diff"] < 1e-4, row
    if "split" in hlopass.available_passes():
        ours, plain = by_key[("kernel_matvec", "hlopass")], by_key[("kernel_matvec", "plain")]
        assert ours["rewrites"] and ours["xla_temp_bytes"] < plain["xla_temp_bytes"] / 4
    with open(out / "results.csv") as handle:
        assert len(list(csv.DictReader(handle))) == len(results)
    table = (out / "results.md").read_text()
    assert "| workload | plain jax.jit |" in table and "--tiny" in table
    assert (out / "bench.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_scaling_tiny_run_fits_time_against_n_squared(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tools.scaling", "--sizes", "1000,2000",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((tmp_path / "scaling.json").read_text())
    ours = [r for r in data["rows"] if r["mode"] == "hlopass"]
    assert [r["n"] for r in ours] == [1000, 2000] and all(r["status"] == "ok" for r in ours)
    assert all(r["error_vs_float64"] < 1e-4 for r in ours)
    assert data["fit"] is not None and data["fit"][0] > 0
    assert (tmp_path / "scaling.png").read_bytes().startswith(b"\x89PNG")
    assert "| n | dense kernel |" in done.stdout


def test_update_readme_replaces_only_the_marked_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\nbefore\n{bench_suite.README_START}\nold table\n{bench_suite.README_END}\nafter\n")
    bench_suite.update_readme(str(readme), "| new | table |")
    assert readme.read_text() == (f"# title\nbefore\n{bench_suite.README_START}\n| new | table |\n"
                                  f"{bench_suite.README_END}\nafter\n")
    (tmp_path / "plain.md").write_text("no markers\n")
    with pytest.raises(SystemExit, match="no"):
        bench_suite.update_readme(str(tmp_path / "plain.md"), "x")
