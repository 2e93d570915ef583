"""The six Gaussian-process programs of issue 13 (``fixtures/gp.py``) at small sizes.

Each is split with a threshold of a few MB: no tensor of the lowered StableHLO may exceed 1.5
times the split size (arguments and results aside), and the numbers equal ``jax.jit`` of the
original (1e-10 relative in float64). ``tools/bench_gp.py`` runs them at the issue's sizes.
"""

import jax
import numpy as np
import pytest

from fixtures import gp
from tests.passes.split.helpers import assert_close, io_bytes, largest_tensor, split_jit, split_rewrites

#: name -> (sizes, threshold, float64)
SMALL = {
    "sgpr_bound_grad": (dict(n=20_011, m=41, d=4), "2MB", True),
    "predictive_variance": (dict(n_train=307, n_test=10_007), "2MB", False),
    "cg": (dict(n=1_511), "2MB", False),
    "class_sums": (dict(n_q=1_009, n_s=2_003), "2MB", False),
    "gather": (dict(n_q=1_009, n_s=2_003), "2MB", False),
    "sinkhorn": (dict(n=1_201, m=1_103), "1MB", False),
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_gp_program_is_bounded_and_equal(name):
    sizes, threshold, x64 = SMALL[name]
    fn, make, _, _ = gp.PROGRAMS[name]
    with jax.enable_x64(x64):
        args = make(**sizes)
        f = split_jit(fn, threshold)
        lowered = f.lower(*args)
        assert split_rewrites(lowered.report), lowered.report
        want = jax.jit(fn)(*args)
        limit = max(1.5 * _bytes(threshold), io_bytes(args, want))
        assert largest_tensor(lowered) <= limit, (largest_tensor(lowered), limit, str(lowered.report))
        got = lowered.compile()(*args)
        tolerance = dict(rtol=1e-10, atol=1e-10) if x64 else dict(rtol=2e-4, atol=2e-5)
        assert_close(got, want, **tolerance)


def _bytes(size: str) -> int:
    from hlopass.sizes import parse_size
    return parse_size(size, "threshold")


def test_sgpr_bound_float64_is_the_float64_bound():
    """The split keeps float64 throughout: against a float64 NumPy evaluation of the bound."""
    with jax.enable_x64(True):
        X, y, Z, log_params = gp.make_sgpr(3_001, 17, 2)
        value = split_jit(gp.sgpr_objective, "256kB")(X, y, Z, log_params)
        assert value.dtype == np.float64
        want = _numpy_sgpr(X, y, Z, np.exp(log_params))
        np.testing.assert_allclose(float(value), want, rtol=1e-10)


def _numpy_sgpr(X, y, Z, params):
    d = X.shape[1]
    ls, var, noise = params[:d], params[d], params[d + 1]

    def k(a, b):
        return var * np.exp(-0.5 * np.sum(((a[:, None] - b[None]) / ls) ** 2, -1))
    n, m = X.shape[0], Z.shape[0]
    L = np.linalg.cholesky(k(Z, Z) + 1e-6 * np.eye(m))
    A = np.linalg.solve(L, k(Z, X)) / np.sqrt(noise)
    AAT = A @ A.T
    LB = np.linalg.cholesky(AAT + np.eye(m))
    c = np.linalg.solve(LB, A @ y) / np.sqrt(noise)
    return (-0.5 * n * np.log(2 * np.pi) - np.sum(np.log(np.diag(LB))) - 0.5 * n * np.log(noise)
            - 0.5 * y @ y / noise + 0.5 * c @ c - 0.5 * n * var / noise + 0.5 * np.trace(AAT))


@pytest.mark.parametrize("name,loops", [("sgpr_bound_grad", 2), ("sinkhorn", 2)])
def test_two_pass_programs_recompute_once_per_stage(name, loops):
    """A large value read before and after its own reduction gets one copy per stage, not one per
    reader: SGPR's statistics and their gradient are two loops; each Sinkhorn iteration is one loop
    over rows (the rows' logsumexp for f, and with it the columns' logsumexp for g carried online:
    a running maximum and rescaled sum per column), and one loop for the final cost."""
    sizes, threshold, x64 = SMALL[name]
    fn, make, _, _ = gp.PROGRAMS[name]
    with jax.enable_x64(x64):
        args = make(**sizes)
        done = split_rewrites(split_jit(fn, threshold).trace(*args).report)
    assert len(done) == loops, [r.summary for r in done]
