"""One of two processes sharing JAX's persistent compilation cache, started by
``tests/core/test_compile_speed.py``:

    python -m tests.core.cache_child CACHE_DIR PASSES THRESHOLD [cholesky | scaled:S]

calls a small program through ``hlopass.jit`` (the given passes and threshold; with ``cholesky``, one
that also factors a matrix, a LAPACK kernel on CPU; with ``scaled:S``, one whose jitted helper closes
over an array of S) and prints one ``ROW`` JSON line: how many
times each test pass ran, how many times the pipeline ran passes at all, how many of hlopass's
compiles XLA's persistent cache served, whether scipy was imported by the call (JAX loads LAPACK's
kernels through it), the result, ``jax.jit``'s result, and the entries under ``CACHE_DIR/hlopass``.
"""

from __future__ import annotations

import json
import os
import sys


def program(x, y):
    d = ((x[:, None, :] - y[None, :, :]) ** 2).sum(-1)
    return (d.min(1) + x.sum(1)).sum()


def scaled_program(scale: float):
    """``program`` with ``y`` scaled by a jitted function closing over an array of ``scale`` (a constant
    JAX keeps inside the call's sub-program, which ``str(jaxpr)`` does not print)."""
    import jax
    import numpy as np
    weights = np.full((3,), scale, np.float32)

    @jax.jit
    def scaled(y):
        return y * weights

    return lambda x, y: program(x, scaled(y))


def factoring_program(x, y):
    import jax.numpy as jnp
    gram = x.T @ x + jnp.eye(x.shape[1])
    return program(x, y) + jnp.linalg.cholesky(gram).sum()


def main(cache_dir: str, passes: str, threshold: str, which: str = "plain") -> None:
    import jax
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    import numpy as np

    import hlopass
    from hlopass import pipeline
    from tests.core.spy_pass import RUNS

    ran, hits = [], []
    run_passes = pipeline._run_passes
    pipeline._run_passes = lambda *a, **k: ran.append(1) or run_passes(*a, **k)
    jax.monitoring.register_event_listener(
        lambda event, **_: hits.append(1) if event == "/jax/compilation_cache/cache_hits" else None)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((300, 3), np.float32), rng.standard_normal((200, 3), np.float32)
    fun = (factoring_program if which == "cholesky" else
           scaled_program(float(which.split(":")[1])) if which.startswith("scaled:") else program)
    out = hlopass.jit(fun, passes=passes, threshold=threshold)(x, y)
    served = len(hits)
    scipy_imported = "scipy" in sys.modules
    expected = jax.jit(fun)(x, y)
    folder = os.path.join(cache_dir, "hlopass")
    entries = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    print("ROW " + json.dumps({"runs": dict(RUNS), "pipeline_runs": len(ran), "xla_cache_hits": served,
                               "scipy_imported": scipy_imported, "out": float(out), "expected": float(expected), "entries": entries}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:5])
