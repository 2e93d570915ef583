"""hlopass on sharded programs (4 host devices, in a child process): shardings kept, shard_map in
and around hlopass functions, gradients; values, gradients, output shardings and per-device XLA
temporaries compared with ``jax.jit`` of the same program with the same shardings.

The programs are in :mod:`tests.core.sharded_programs`; one child process runs the cases a test
module needs (``XLA_FLAGS=--xla_force_host_platform_device_count=4``) so that the rest of the suite
keeps one device.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

from tests import ROOT
from tests.core.sharded_programs import CASES, LIMIT, M, N, SPLIT, THRESHOLD

pytestmark = pytest.mark.slow

#: float32 relative error allowed (sums reordered by the split), float64's.
TOLERANCE = {"float32": 2e-5, "float64": 1e-12}


def run_cases(names, timeout=900) -> dict:
    """Run the named cases of :mod:`tests.core.sharded_programs` on 4 host devices; their rows."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               HLOPASS_RAISE_PASS_ERRORS="1", HLOPASS_CHECK_PASSES="1")
    done = subprocess.run([sys.executable, "-m", "tests.core.sharded_programs", *names], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    rows = [json.loads(line[4:]) for line in done.stdout.splitlines() if line.startswith("ROW ")]
    assert len(rows) == len(names), done.stdout
    return {name: row for name, row in zip(names, rows)}


@functools.lru_cache(maxsize=None)
def _rows() -> dict:
    return run_cases(list(CASES))


def within_split_bound(figures: dict) -> bool:
    """Per-device temporaries within 3 split sizes plus the device's inputs and outputs."""
    return figures["temp"] <= 3 * SPLIT + figures["arguments"] + figures["outputs"]


def check_row(row: dict, dtype: str = "float32", grads: bool = True, bounded_grads: bool = True) -> None:
    tol = TOLERANCE[dtype]
    assert row["value_error"] <= tol, row
    assert row["same_value_shardings"], (row["value_shardings"], row["ref_value_shardings"])
    assert within_split_bound(row["hlopass"]), row["hlopass"]
    assert not within_split_bound(row["jit"]), "the program is too small to show the split: " + str(row["jit"])
    if grads:
        assert row["grad_error"] <= tol, row
        assert row["same_grad_shardings"], (row["grad_shardings"], row["ref_grad_shardings"])
        if bounded_grads:
            assert within_split_bound(row["grad_hlopass"]), row["grad_hlopass"]


@pytest.mark.parametrize("case", ["placed_auto", "placed_explicit"])
def test_shardings_of_placed_inputs_are_kept(case):
    """Row 1: inputs placed with NamedSharding(mesh, P("x")), no shardings given: the output is
    sharded P("x") as jax.jit's (it came back replicated), and bounded per device."""
    row = _rows()[case]
    check_row(row)
    assert row["splits"] >= 1 and 0 not in row["split_axes"], row["split_axes"]
    assert row["value_shardings"][0].startswith("P('x'")
    # the split size bounds each device's step (a quarter of the rows), not the whole array's: fewer steps
    column = N // 4 * 4  # bytes of one column of a device's (N/4, M) kernel matrix (the distance is expanded)
    assert -(-M * column // SPLIT) <= row["iterations"][0] < -(-M * 4 * column // SPLIT), row["iterations"]
    assert row["new_check_per_sharding"] and row["whole_error"] <= TOLERANCE["float32"]
    explained = row["explain"]  # hlopass.explain: the compiled program's splits and per-device figures
    assert explained["split_axes"] == row["split_axes"]
    assert explained["before"] == row["jit"]["temp"] and explained["after"] == row["hlopass"]["temp"]


@pytest.mark.parametrize("case", ["per_device_auto", "per_device_explicit"])
def test_threshold_is_compared_with_each_devices_share(case):
    """The difference is over the threshold as a whole array but each device's quarter is under it:
    not split, the program is jax.jit's (values, gradients, shardings equal; the same per-device temp)."""
    row = _rows()[case]
    assert row["device_difference"] <= THRESHOLD < row["global_difference"]
    assert row["splits"] == 0 and row["iterations"] == []
    assert row["value_error"] <= TOLERANCE["float32"] and row["grad_error"] <= TOLERANCE["float32"], row
    assert row["same_value_shardings"] and row["same_grad_shardings"], row
    assert row["hlopass"]["temp"] <= 1.05 * row["jit"]["temp"], (row["hlopass"], row["jit"])
    assert within_split_bound(row["hlopass"]) and within_split_bound(row["grad_hlopass"]), row


@pytest.mark.parametrize("case", ["memory_limit_auto", "memory_limit_explicit"])
def test_split_pass_checks_one_devices_footprint(case):
    """With a memory limit, the split pass compiles its program with the arguments' shardings: one
    device's footprint (equal to the compiled function's) is within the limit, so it does not split
    again, though the same program compiled on whole arrays would be over it."""
    row = _rows()[case]
    check_row(row, grads=case.endswith("auto"))
    (entry,) = row["memory_checks"]
    figures = row["hlopass"]
    assert entry["kind"] == "memory_check" and entry["limit"] == LIMIT
    assert entry["footprint"] == figures["temp"] + figures["arguments"] + figures["outputs"] <= LIMIT, entry
    if case.endswith("auto"):
        assert sum(row["unsharded"].values()) > LIMIT, row["unsharded"]


def test_float64_placed_inputs():
    check_row(_rows()["placed_auto_f64"], dtype="float64")


def test_in_and_out_shardings_given():
    """Row 2: in_shardings / out_shardings given; gradients keep them too."""
    check_row(_rows()["given"])


def test_shard_map_inside_a_hlopass_function():
    """Row 3: a shard_map body (with a psum) is split under its manual axes. Its gradient is bounded
    too: the backward program's recomputed forward shard_map and the transposed one, which reads its
    large per-device values, are joined into one body and split across them."""
    row = _rows()["shard_map_inside"]
    check_row(row)
    assert row["splits"] >= 1
    assert row["grad_hlopass"]["temp"] < row["grad_jit"]["temp"] / 4, (row["grad_hlopass"], row["grad_jit"])


def test_hlopass_function_inside_a_shard_map_body():
    """Row 4: the loop carries take the body's varying manual axes."""
    row = _rows()["inside_shard_map"]
    check_row(row)
    assert row["splits"] >= 1


def test_grad_of_a_row_sharded_loss():
    """Row 5: jax.grad of a row-sharded loss (the gradient program compared as a whole)."""
    check_row(_rows()["grad"], grads=False)


def test_with_sharding_constraint_inside_a_nested_hlopass_function():
    """The constraint says which axis is sharded (the operands are not jit arguments there)."""
    row = _rows()["constraint"]
    check_row(row)
    assert row["value_shardings"][0].startswith("P('x'")


@pytest.mark.parametrize("case", ["knn_auto", "knn_explicit"])
def test_knn_of_row_sharded_queries(case):
    """A running top-k over the unsharded axis; values and indices keep the queries' sharding."""
    row = _rows()[case]
    check_row(row, grads=False)
    assert row["splits"] >= 1


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def test_two_processes():
    """Two processes on localhost (jax.distributed, CPU, two devices each): query rows sharded
    across both; hlopass's kernel matvec and kNN equal jax.jit's, shardings kept, each process's
    devices bounded."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               HLOPASS_RAISE_PASS_ERRORS="1")
    port = str(_free_port())
    children = [subprocess.Popen([sys.executable, "-m", "tests.core.two_processes", str(k), port], cwd=ROOT,
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for k in range(2)]
    outputs = []
    try:
        for child in children:
            outputs.append(child.communicate(timeout=600))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
    for child, (out, err) in zip(children, outputs):
        assert child.returncode == 0, out[-2000:] + err[-6000:]
    rows = [json.loads(line[4:]) for out, _ in outputs for line in out.splitlines() if line.startswith("ROW ")]
    assert sorted(r["process"] for r in rows) == [0, 1]
    for row in rows:
        for name in ("matvec", "knn"):
            figures = row[name]
            assert figures["local_error"] <= TOLERANCE["float32"], (name, figures)
            assert figures["gathered_error"] <= TOLERANCE["float32"], (name, figures)
            assert figures["same_shardings"] and figures["shardings"][0].startswith("P('x'"), figures
            assert figures["splits"] >= 1, figures
            assert within_split_bound(figures), figures
            assert not within_split_bound(dict(figures, temp=figures["jit_temp"])), figures
