"""The adjoint pass with the time axis sharded over 4 host devices (in a child process):
gradients equal jax.grad, one state per device boundary, per-device memory."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

import hlopass
from hlopass.passes.adjoint import AdjointPass
from tests import ROOT

from .sharded_cases import CASES

pytestmark = pytest.mark.slow


@functools.lru_cache(maxsize=None)
def rows() -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               HLOPASS_RAISE_PASS_ERRORS="1")
    names = list(CASES)
    done = subprocess.run([sys.executable, "-m", "tests.passes.adjoint.sharded_cases", *names], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    found = [json.loads(line[4:]) for line in done.stdout.splitlines() if line.startswith("ROW ")]
    assert len(found) == len(names), done.stdout
    return dict(zip(names, found))


@pytest.mark.parametrize("case,tol", [("diagonal_f32", 2e-5), ("diagonal_f64", 1e-12), ("lm_f64", 1e-12),
                                      ("dense_f32", 2e-5), ("stacked_f64", 1e-12), ("rows_after_f64", 1e-12),
                                      ("no_inputs_f64", 1e-12), ("explicit_f64", 1e-12),
                                      ("tail_f64", 1e-12), ("two_levels_f64", 1e-12)])
def test_sharded_gradient_equals_jax_grad(case, tol):
    row = rows()[case]
    assert row["error"] < tol, row
    assert row["rewrites"] and all("sharded over mesh axis 'x' (4 devices" in r for r in row["rewrites"]), row


def test_two_levels_in_each_device_say_so():
    row = rows()["two_levels_f64"]
    assert all("two levels of checkpointing" in r and "per device" in r for r in row["rewrites"]), row


def test_time_axis_sharded_in_the_types_is_found_without_sequence_axis():
    """Under an ``Explicit`` mesh with the inputs cut along time, ``hlopass.jit`` with no options shards
    the adjoint along that axis and reads the inputs as they are sharded (``jax.jit`` gathers them
    whole for ``lax.scan``)."""
    row = rows()["detected_f64"]
    assert row["error"] < 1e-12, row
    assert len(row["rewrites"]) == 2 and all("sharded over mesh axis 'x' (4 devices" in r
                                             for r in row["rewrites"]), row
    assert all(plain >= 1 and ours == 0 for plain, ours in row["gathers"]), row


@pytest.mark.parametrize("case,reason", [("complex_f32", "complex recurrences are not sharded"),
                                         ("indivisible", "30 steps do not split evenly over 4 devices")])
def test_unsharded_forms_fall_back_and_say_why(case, reason):
    row = rows()[case]
    assert row["error"] < 2e-5, row
    assert any(reason in s for s in row["skips"]), row
    assert row["rewrites"] and not any("sharded over" in r for r in row["rewrites"])


def test_per_device_memory():
    """Per device, a quarter of the rows; the boundary states and one chunk's working set (each about
    sqrt(T) on one device) shrink by sqrt(1/4): about half of one device's adjoint in all."""
    row = rows()["memory"]
    assert row["error"] < 2e-5, row
    assert row["temp_sharded"] * 10 <= row["temp_plain"], row
    assert row["temp_sharded"] <= 0.6 * row["temp_one_device"], row
    assert row["all_reduces"] >= 1, row


def test_per_device_memory_of_stacked_layers():
    """The benchmark's 4-layer language model at 8192 tokens: the whole stack is one region per device."""
    row = rows()["lm_memory"]
    assert row["temp_sharded"] <= 0.55 * row["temp_one_device"], row
    # two levels in each device's rows: the boundary states shrink, one chunk's working set remains
    # (at 8192 tokens about a third of one device's; the bound at 131,072 is tools/bench_adjoint.py's)
    assert row["temp_sharded_two_levels"] <= 0.8 * row["temp_sharded"], row
    assert row["temp_sharded_two_levels"] <= 0.4 * row["temp_one_device"], row


def test_bad_sequence_axis_is_config_error():
    for bad in ("", 3):
        with pytest.raises(hlopass.ConfigError, match="sequence_axis="):
            AdjointPass(sequence_axis=bad)
    with pytest.raises(hlopass.ConfigError, match="cannot be combined"):
        AdjointPass(sequence_axis="x", truncate=4)
