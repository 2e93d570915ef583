"""The split pass under a real memory cap: a kernel mat-vec that plain ``jax.jit`` cannot run.

Each case runs in a child process whose address space is capped like
``ulimit -v 4000000`` (4,000,000 KiB), so the machine's other users are safe
and an out-of-memory failure stays in the child.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests import ROOT
CAP_KIB = 4_000_000

CHILD = textwrap.dedent("""
    import json, resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, ({cap} * 1024, {cap} * 1024))
    import jax, numpy as np
    import hlopass
    from fixtures.kernels import kernel_matvec

    n = {n}
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = rng.normal(size=(n, 3)).astype(np.float32)
    v = rng.uniform(size=n).astype(np.float32)
    result = {{}}
    start = time.perf_counter()
    try:
        if "{mode}" == "jit":
            out = jax.jit(kernel_matvec)(x, y, v)
        else:
            f = hlopass.jit(kernel_matvec, passes="split", threshold="{threshold}")
            out = f(x, y, v)
            check = f.memory_checks()[0]
            result.update(temp=check.temp_bytes, footprint=check.footprint,
                          splits=[r.summary for r in f.trace(x, y, v).report.rewrites])
        out = np.asarray(out)
        result["seconds"] = time.perf_counter() - start
        rows = rng.choice(n, 16, replace=False)
        d2 = ((x[rows, None, :].astype(np.float64) - y[None].astype(np.float64)) ** 2).sum(-1)
        want = np.exp(-0.5 * d2) @ v.astype(np.float64)
        result.update(ok=True, rel_err=float(np.max(np.abs(out[rows] - want) / np.abs(want))))
    except Exception as err:  # the parent inspects the message
        result.update(ok=False, error=f"{{type(err).__name__}}: {{str(err)[:500]}}")
    print("RESULT " + json.dumps(result))
""")


def run_capped(mode: str, n: int, threshold: str = "100MB") -> dict:
    """Run the kernel mat-vec in a capped child; its JSON result."""
    code = CHILD.format(cap=CAP_KIB, n=n, mode=mode, threshold=threshold)
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"child died (rc={proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.slow
def test_kernel_matvec_40k_fails_with_jax_jit_and_runs_split():
    plain = run_capped("jit", 40_000)
    assert not plain["ok"] and "RESOURCE_EXHAUSTED" in plain["error"], plain
    split = run_capped("split", 40_000)
    assert split["ok"], split
    assert split["rel_err"] < 1e-5, split
    assert split["footprint"] < CAP_KIB * 1024, split
    assert split["splits"], split


def test_capped_child_smoke():
    """The same harness on a small size: both finish and agree with float64."""
    for mode in ("jit", "split"):
        result = run_capped(mode, 3_001, threshold="1MB")
        assert result["ok"] and result["rel_err"] < 1e-5, result
