"""The algebraic pass's visit budget (``ExpansionLimits.max_visits``) leaves room for the rewrites it makes.

The budget bounds what a root that finds nothing costs (a gradient's chains of sums and products are
followed until it stops them); the rewrites below, the deepest the tests and benchmark programs make,
must need at most half of it, so that lowering the budget, or a change that makes expansions visit
more, shows here rather than as a rewrite silently lost. Values are compared with ``jax.jit`` of the
program as written, gradients included, at sizes no chunk divides.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlopass
from hlopass.passes.algebraic import AlgebraicPass
from hlopass.passes.algebraic.expansion import ExpansionLimits
from fixtures import kernels
from fixtures.gp import make_sgpr, sgpr_value_and_grad


def _kernel_matvec_ard_grad(dtype=np.float32):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((37, 3)).astype(dtype), rng.standard_normal((53, 3)).astype(dtype)
    v, ell = rng.standard_normal(53).astype(dtype), np.linspace(0.5, 2.0, 3).astype(dtype)

    def loss(x, y, v, ell):
        return jnp.sum(kernels.kernel_matvec_ard(x, y, v, ell) ** 2)

    return jax.value_and_grad(loss, argnums=(0, 1, 3)), (x, y, v, ell), "1kB"


def _sgpr_bound_grad(dtype=np.float32):
    return sgpr_value_and_grad, make_sgpr(1_009, 13, 5, dtype=dtype), "8kB"


PROGRAMS = {"kernel_matvec_ard_grad": _kernel_matvec_ard_grad, "sgpr_bound_grad": _sgpr_bound_grad}


#: Tolerances relative to the largest magnitude of each output (the expanded forms cancel).
TOLERANCE = {np.dtype("float32"): 2e-5, np.dtype("float64"): 1e-12}


def assert_close(got, want) -> None:
    def close(a, b):
        a, b = np.asarray(a), np.asarray(b)
        tol = TOLERANCE[b.dtype]
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, float(np.max(np.abs(b)))))
    jax.tree.map(close, got, want)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_rewrites_stay_well_within_the_visit_budget(name, dtype):
    with jax.enable_x64(dtype == "float64"):
        fun, args, threshold = PROGRAMS[name](np.dtype(dtype))
        f = hlopass.jit(fun, passes="algebraic", threshold=threshold)
        found = [r for r in f.trace(*args).report.rewrites if r.pass_name == "algebraic"]
        assert found, "the program must have algebraic rewrites for the budget to be tested"
        budget = ExpansionLimits().max_visits
        assert all(0 < r.details["visits"] <= budget // 2 for r in found), [(r.kind, r.details["visits"]) for r in found]
        assert_close(f(*args), jax.jit(fun)(*args))


def test_a_budget_below_a_rewrite_loses_it_and_says_why():
    fun, args, threshold = _kernel_matvec_ard_grad()
    f = hlopass.jit(fun, passes="algebraic", threshold=threshold)
    needed = min(r.details["visits"] for r in f.trace(*args).report.rewrites)
    starved = hlopass.jit(fun, passes=[AlgebraicPass(max_visits=needed // 4)], threshold=threshold)
    report = starved.trace(*args).report
    assert len(report.rewrites) < len(f.trace(*args).report.rewrites)
    assert any("too large to expand" in s.reason for s in report.skipped)
    assert_close(starved(*args), jax.jit(fun)(*args))
