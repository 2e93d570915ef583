"""JAX's own tests through hlopass, a CI-sized subset: ``tools/peer_tests.py`` on chosen cases of
JAX 0.10.2's reducer and einsum tests (the ones where rewrites fire at a 1-byte threshold), compared
with a checked-in list of known, explained failures. The full run is ``python -m tools.peer_tests``
(results in tools/results/peer_tests.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fuzz import runner

ROOT = Path(__file__).resolve().parents[2]
#: The two files of the subset, vendored (tests/fuzz/jax_peer/README.md): a clone needs nothing beside it.
PEER_DIR = Path(__file__).resolve().parent / "jax_peer"
FILES = "reducers,einsum"
SELECTION = "testReducerWhere or testCumulativeSum or from_dask or test_one_operand"
#: "file:Class::test" -> "owner: why". A listed test that passes again is reported (delete its line).
KNOWN: dict[str, str] = {}


@pytest.mark.slow
def test_jax_peer_tests_subset_through_hlopass(tmp_path):
    if not (PEER_DIR / "lax_numpy_reducers_test.py").exists():
        pytest.fail(f"JAX's test files are not in {PEER_DIR}")
    out = tmp_path / "peer.json"
    proc = subprocess.run([sys.executable, "-m", "tools.peer_tests", "--files", FILES, "-k", SELECTION,
                           "--json", str(out), "--peer-dir", str(PEER_DIR)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    failures = summary["failures"]
    unexplained = {k: f for k, f in failures.items() if k not in KNOWN}
    fixed = sorted(k for k in KNOWN if k not in failures)
    runner.SUMMARY_LINES.append(
        f"JAX peer tests ({FILES}, -k '{SELECTION}'): {dict(summary['outcomes'])}; tests with rewrites "
        f"{summary['tests_with_rewrites']}; rewrites {dict(summary['rewrites'])}"
        + (f"; known failures now passing (delete from KNOWN): {fixed}" if fixed else ""))
    assert not unexplained, "\n".join(f"{k}: [{f['category']}] {f['message']}" for k, f in unexplained.items())
    assert summary["outcomes"].get("passed", 0) > 50, summary["outcomes"]
    assert summary["tests_with_rewrites"] > 20, "rewrites no longer fire in JAX's tests"
