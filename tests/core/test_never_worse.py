"""Never worse than plain: a program the passes change but cannot bound (an exact GP marginal
likelihood and its gradient: the Cholesky of an n x n kernel) runs as the better of the rewritten
and the original program by XLA's figures; the report says which and what blocked the bound. Its
memory and the compile time of the program kept are no worse than ``jax.jit``'s."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlopass
from fixtures import exact_gp
from hlopass import call, never_worse
from hlopass.memory import MemoryCheck
from hlopass.pipeline import PipelineResult
from hlopass.report import PipelineReport

pytestmark = pytest.mark.usefixtures("x64")


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def gp_inputs(n=300, seed=0):
    return exact_gp.inputs(n, seed=seed)


THRESHOLD = "256kB"  # the 300 x 300 float64 kernel (720 kB) is above it; nothing can split a Cholesky


def plain_figures(fun, args):
    fresh = lambda *a: fun(*a)  # noqa: E731 - a new function object: nothing cached
    start = time.perf_counter()
    compiled = jax.jit(fresh).lower(*args).compile()
    seconds = time.perf_counter() - start
    analysis = compiled.memory_analysis()
    footprint = (analysis.temp_size_in_bytes + analysis.argument_size_in_bytes + analysis.output_size_in_bytes
                 - analysis.alias_size_in_bytes)
    return footprint, seconds


def test_gp_value_and_grad_no_worse_than_plain():
    args = gp_inputs()
    fun = jax.value_and_grad(exact_gp.negative_log_likelihood)
    h = hlopass.jit(fun, threshold=THRESHOLD, never_worse=True)  # on by default; the test suite turns it off
    value, grad = h(*args)
    plain_value, plain_grad = jax.jit(fun)(*args)
    plain_footprint, plain_seconds = plain_figures(fun, args)

    comparison = h.trace(*args).report.comparison
    assert comparison is not None, "the passes changed this program without bounding it"
    assert comparison.blocked and any("f64[300,300]" in b for b in comparison.blocked)
    assert any("triangular_solve" in r or "cholesky" in r for r in comparison.reasons), comparison.reasons
    [check] = h.memory_checks()
    assert check.footprint <= plain_footprint
    if comparison.kept == "original":  # jax.jit's program itself: the same numbers
        np.testing.assert_array_equal(value, plain_value)
        np.testing.assert_array_equal(grad, plain_grad)
        assert comparison.original_compile_s <= 1.5 * plain_seconds + 1.0
    else:
        assert comparison.rewritten_bytes <= never_worse.KEEP_REWRITTEN_BELOW * comparison.original_bytes
        np.testing.assert_allclose(grad, plain_grad, rtol=1e-6)
    assert "kept the" in str(h.trace(*args).report)


def test_gp_under_outer_jit_of_grad_no_worse_than_plain():
    """The composition path: the lowering rule compares the two programs compiled alone."""
    args = gp_inputs(seed=1)
    h = hlopass.jit(exact_gp.negative_log_likelihood, threshold=THRESHOLD, never_worse=True)
    fun = jax.value_and_grad(h)
    compiled = jax.jit(fun).lower(*args).compile()
    plain_footprint, _ = plain_figures(jax.value_and_grad(exact_gp.negative_log_likelihood), args)
    analysis = compiled.memory_analysis()
    assert analysis.temp_size_in_bytes + analysis.argument_size_in_bytes + analysis.output_size_in_bytes \
        <= plain_footprint
    reports = hlopass.reports(fun, *args)
    assert any(r.comparison is not None for r in reports)
    np.testing.assert_allclose(compiled(*args)[1], jax.grad(exact_gp.negative_log_likelihood)(*args), rtol=1e-6)


_IDENTITY = jax.make_jaxpr(lambda v: v)(1.0)


def _result(limit=None):
    report = PipelineReport(label="f", config_line="")
    config = hlopass.resolve_config({"memory_limit": limit or "off", "passes": "none"})
    return PipelineResult(_IDENTITY, None, report, config)


def test_never_worse_off_runs_the_rewritten_program():
    args = gp_inputs(n=120)
    fun = jax.value_and_grad(exact_gp.negative_log_likelihood)
    h = hlopass.jit(fun, threshold="16kB", never_worse=False)
    np.testing.assert_allclose(h(*args)[1], jax.jit(fun)(*args)[1], rtol=1e-6)
    report = h.trace(*args).report
    assert report.rewrites and report.comparison is None and "never_worse=off" in report.config_line


def test_never_worse_is_on_by_default(monkeypatch):
    monkeypatch.delenv("HLOPASS_NEVER_WORSE")
    assert hlopass.resolve_config().never_worse


def _check(footprint, limit=None):
    return MemoryCheck("f", temp_bytes=footprint, argument_bytes=0, output_bytes=0, alias_bytes=0,
                       generated_code_bytes=0, limit=limit)


@pytest.mark.parametrize("rewritten, original, limit, kept", [
    (90, 100, None, "rewritten"),   # 10 % less: worth it
    (97, 100, None, "original"),    # less than 5 % gain: jax.jit's program, bit-identical
    (120, 100, None, "original"),   # worse: never
    (97, 200, 150, "rewritten"),    # only the rewritten one fits the limit
    (160, 100, 150, "original"),    # only the original one fits
])
def test_decide(rewritten, original, limit, kept):
    result = _result(limit)
    assert never_worse.decide(result, _check(rewritten, limit), 1.0, _check(original, limit), 0.5) == kept
    assert result.kept == kept and result.report.comparison.kept == kept
    assert result.check.footprint == (rewritten if kept == "rewritten" else original)


def test_linearize_saves_the_cholesky_factor_instead_of_recomputing_it():
    """When large residuals are rematerialised, what an expensive, unsplittable primitive makes (a
    Cholesky factor) is still saved: the backward program does not factorise again."""
    closed = jax.make_jaxpr(lambda a: jnp.sum(jnp.linalg.cholesky(a @ a.T + 300 * jnp.eye(300))))(
        jnp.ones((300, 300)))
    config = hlopass.resolve_config({"threshold": "100kB", "passes": "none"})
    used, primal, num_res, _, _, tangent = call.primal_tangent_split(closed, [True], True, config)
    assert [e.primitive.name for e in _all_eqns(primal)].count("cholesky") == 1
    assert "cholesky" not in [e.primitive.name for e in _all_eqns(tangent)]
    residuals = primal.out_avals[len(primal.out_avals) - num_res:]
    assert any(a.shape == (300, 300) for a in residuals)  # the factor is saved


def test_linearize_rematerialises_cheap_large_residuals():
    closed = jax.make_jaxpr(lambda x: jnp.sum(jnp.exp(-((x[:, None] - x[None, :]) ** 2))))(jnp.ones(300))
    config = hlopass.resolve_config({"threshold": "100kB", "passes": "none"})
    used, primal, num_res, *_ = call.primal_tangent_split(closed, [True], True, config)
    assert used is not closed
    residuals = primal.out_avals[len(primal.out_avals) - num_res:]
    assert max((a.size for a in residuals), default=0) < 300 * 300


def _all_eqns(closed):
    from hlopass.jaxpr_utils import iter_eqns
    return list(iter_eqns(closed))

