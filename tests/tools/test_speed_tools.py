"""Smoke tests of speed tools at tiny sizes: bench_chunks, profile_knn, bench_overhead and probe_spmd_threads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests import ROOT


def run_tool(*argv: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.mark.slow
def test_bench_chunks_tiny(tmp_path):
    out = tmp_path / "chunks.json"
    run_tool("-m", "tools.bench_chunks", "--tiny", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["program"] for r in rows] == ["kNN L1", "kNN L2", "kernel mat-vec"]
    for row in rows:
        assert {"default", "no cache cap", "no even chunk", "no unroll", "hand (lax.map)"} <= set(row["variants"])
        for label, cell in row["variants"].items():
            assert cell["same_as_default"], (row["program"], label)
            assert cell["wall_s"] > 0 and cell["temp_bytes"] is not None


@pytest.mark.slow
def test_profile_knn_tiny():
    """The grouped selection it measures returns jax.jit's neighbours (the tool exits 1 otherwise)."""
    done = run_tool("-m", "tools.profile_knn", "--queries", "40", "--points", "4096", "--group", "16", "--repeats", "1")
    assert "same neighbours as jax.jit for 100.0000%" in done.stdout
    for part in ("distances only", "top_k only", "hlopass", "grouped, fused (G = 16)", "plain jax.jit"):
        assert part in done.stdout, done.stdout


def test_bench_overhead_tiny(tmp_path):
    out = tmp_path / "overhead.json"
    run_tool("-m", "tools.bench_overhead", "--tiny", "--json", str(out))
    figures = json.loads(out.read_text())
    assert set(figures["programs"]) == {"forward", "gradient"}
    for row in figures["programs"].values():
        assert row["equations"] > 20 and row["xla_compile_s"] > 0 and row["passes_s"] >= 0
        assert row["passes_over_xla_compile"] == pytest.approx(row["passes_s"] / row["xla_compile_s"])
    assert figures["recall_hlopass_us"] > 0


def test_probe_spmd_threads_tiny(tmp_path):
    """The probe behind docs/passes/adjoint.md's note on simulated devices' cores runs its three modes,
    the last on 4 host devices, each in its own process (its figures are the benchmark's to judge)."""
    out = tmp_path / "spmd.json"
    run_tool("-m", "tools.probe_spmd_threads", "--tiny", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["devices"]) for r in rows] == [("jit", 1), ("one_device_mesh", 1), ("four_device_mesh", 4)]
    assert all(r["best_s"] > 0 and r["cores_used"] >= 0 for r in rows)
