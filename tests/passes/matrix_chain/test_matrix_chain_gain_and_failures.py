"""The matrix-chain pass: the minimum gain (``min_gain=``, ``HLOPASS_MIN_GAIN``), and programs on which
the pass used to fail and be skipped (each test named after the defect of issue 12).

Every rewrite is compared with ``jax.jit`` of the unrewritten program, values and gradients, in
float32 and float64, at odd sizes.
"""

from __future__ import annotations

import contextlib

import jax
from hlopass import internals as jx
import jax.numpy as jnp
import numpy as np
import pytest

import hlopass
from hlopass import ConfigError
from hlopass.passes import matrix_chain as chain_pass
from hlopass.passes.matrix_chain import MatrixChainPass
from hlopass.settings import resolve

TOLERANCE = {np.dtype("float32"): 2e-4, np.dtype("float64"): 1e-11}


def precision(dtype):
    return jax.enable_x64(True) if np.dtype(dtype) == np.float64 else contextlib.nullcontext()


def normal(seed, shape, dtype):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) / np.sqrt(shape[-1]), dtype)


def chain_rewrites(report):
    return [r for r in report.rewrites if r.pass_name == "matrix_chain"]


def assert_close(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = TOLERANCE[np.dtype(want.dtype)] if np.dtype(want.dtype) in TOLERANCE else 2e-2
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol,
                               atol=tol * max(1.0, float(np.max(np.abs(want.astype(np.float64))))))


def check_values_and_grads(fun, hfun, args):
    """``hfun`` matches ``jax.jit(fun)`` in value and in the gradient of a fixed linear functional."""
    want = jax.jit(fun)(*args)
    assert_close(hfun(*args), want)
    weights = normal(99, np.shape(want) or (1,), want.dtype).reshape(np.shape(want))
    argnums = tuple(range(len(args)))
    loss = lambda f: (lambda *a: jnp.sum(weights * f(*a)))  # noqa: E731
    for got, expected in zip(jax.jit(jax.grad(loss(hfun), argnums))(*args), jax.jit(jax.grad(loss(fun), argnums))(*args)):
        assert_close(got, expected)


# -- the minimum gain --------------------------------------------------------------------------

#: (M1 @ M2) @ M3 costs 10*12*10 + 10*10*11 = 2,300 multiply-adds; written M1 @ (M2 @ M3) it costs
#: 12*10*11 + 10*12*11 = 2,640: reordering gains 2640/2300 = 1.148x, under the default 1.25.
SMALL_GAIN_SHAPES = ((10, 12), (12, 10), (10, 11))


def small_gain_chain(m1, m2, m3):
    return m1 @ (m2 @ m3)


def small_gain_args(dtype):
    return tuple(normal(i, s, dtype) for i, s in enumerate(SMALL_GAIN_SHAPES))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_min_gain_below_the_default_leaves_the_order_as_written_and_says_so(dtype):
    with precision(dtype):
        args = small_gain_args(dtype)
        hfun = hlopass.jit(small_gain_chain, passes="matrix_chain")
        traced = hfun.trace(*args)
        assert chain_rewrites(traced.report) == []
        [skip] = [s for s in traced.report.skipped if s.pass_name == "matrix_chain"]
        assert "minimum gain 1.25" in skip.reason and "2,640 -> 2,300" in skip.reason and "1.15x" in skip.reason
        assert skip.location.startswith("test_matrix_chain_gain_and_failures.py:")
        dots = [e for e in traced.rewritten_jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
        assert [d.outvars[0].aval.shape for d in dots] == [(12, 11), (10, 11)]  # as written
        np.testing.assert_array_equal(hfun(*args), jax.jit(small_gain_chain)(*args))  # bit-identical


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_min_gain_keyword_lets_a_small_gain_through(dtype):
    with precision(dtype):
        args = small_gain_args(dtype)
        hfun = hlopass.jit(small_gain_chain, passes="matrix_chain", min_gain=1.1)
        [entry] = chain_rewrites(hfun.trace(*args).report)
        assert (entry.details["flops_before"], entry.details["flops_after"]) == (2 * 2640, 2 * 2300)
        check_values_and_grads(small_gain_chain, hfun, args)


def test_min_gain_environment_variable(monkeypatch):
    args = small_gain_args("float32")
    monkeypatch.setenv("HLOPASS_MIN_GAIN", "1.1")
    assert len(chain_rewrites(hlopass.jit(small_gain_chain, passes="matrix_chain").trace(*args).report)) == 1
    monkeypatch.setenv("HLOPASS_MIN_GAIN", " 1.2 ")
    assert chain_rewrites(hlopass.jit(small_gain_chain, passes="matrix_chain").trace(*args).report) == []
    # the keyword wins over the environment
    assert len(chain_rewrites(hlopass.jit(small_gain_chain, passes="matrix_chain", min_gain="1")
                              .trace(*args).report)) == 1


def test_min_gain_large_blocks_even_big_gains():
    A, B, v = (normal(i, s, jnp.float32) for i, s in enumerate(((31, 31), (31, 31), (31,))))
    fun = lambda A, B, v: A @ B @ v  # noqa: E731  (n^3 + n^2 -> 2n^2: a 16x gain)
    assert len(chain_rewrites(hlopass.jit(fun, passes="matrix_chain", min_gain=15.9).trace(A, B, v).report)) == 1
    traced = hlopass.jit(fun, passes="matrix_chain", min_gain=16.1).trace(A, B, v)
    assert chain_rewrites(traced.report) == [] and "minimum gain 16.1" in traced.report.skipped[0].reason


@pytest.mark.parametrize("value", ["0.5", "0", "-2", "abc", "", "inf", "nan", True])
def test_min_gain_bad_values_name_the_setting(value, monkeypatch):
    with pytest.raises(ConfigError, match="min_gain=.*accepted forms"):
        hlopass.jit(small_gain_chain, min_gain=value)
    monkeypatch.setenv("HLOPASS_MIN_GAIN", str(value))
    with pytest.raises(ConfigError, match="HLOPASS_MIN_GAIN"):
        resolve({})


def test_min_gain_parsing():
    assert resolve({}).min_gain == 1.25
    assert resolve({"min_gain": "2"}).min_gain == 2.0
    assert resolve({"min_gain": 1}).min_gain == 1.0
    assert resolve({}, environ={"HLOPASS_MIN_GAIN": "1.5"}).min_gain == 1.5


def test_a_chain_over_the_threshold_is_reordered_whatever_the_gain():
    """Memory first: a written order whose intermediate breaks the threshold is replaced even when
    the multiply-adds barely change (the threshold test of test_matrix_chain.py, at min_gain 3)."""
    rng = np.random.default_rng(9)
    args = [rng.standard_normal(s).astype(np.float32) for s in ((1, 2), (2, 2000), (2000, 2))]
    fun = lambda a, b, c: a @ b @ c  # noqa: E731
    [entry] = chain_rewrites(hlopass.jit(fun, passes="matrix_chain", threshold="1kB", min_gain=3)
                             .trace(*args).report)
    assert entry.details["peak_intermediate_after"] == 16


def test_shared_product_is_recomputed_only_for_the_minimum_gain():
    """``M = A @ B`` read by ``M @ v`` and ``M.T @ w``: recomputing it in both chains cuts n^3 + 2n^2
    to 4n^2 multiply-adds; at a minimum gain above that ratio it stays a boundary."""
    n = 13
    A, B = normal(0, (n, n), jnp.float32), normal(1, (n, n), jnp.float32)
    v, w = normal(2, (n,), jnp.float32), normal(3, (n,), jnp.float32)

    def fun(A, B, v, w):
        M = A @ B
        return M @ v + M.T @ w

    ratio = (n**3 + 2 * n * n) / (4 * n * n)
    done = chain_rewrites(hlopass.jit(fun, passes="matrix_chain", min_gain=ratio * 0.99).trace(A, B, v, w).report)
    assert len(done) == 2 and all(r.details["shared_equations"] == 1 for r in done)
    kept = hlopass.jit(fun, passes="matrix_chain", min_gain=ratio * 1.01)
    assert chain_rewrites(kept.trace(A, B, v, w).report) == []
    check_values_and_grads(fun, hlopass.jit(fun, passes="matrix_chain", min_gain=ratio * 0.99), (A, B, v, w))


# -- programs the pass used to fail on (and be skipped for the whole function) --------------------

@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_strict_dtype_promotion_with_a_widening_cast(dtype):
    """Under ``jax_numpy_dtype_promotion='strict'`` the chain's emitted products cast explicitly."""
    with precision(dtype):
        A, B = normal(0, (23, 23), jnp.float16), normal(1, (23, 23), jnp.float16)
        v = normal(2, (23,), dtype)

        def fun(A, B, v):
            return (A @ B).astype(v.dtype) @ v

        with jax.numpy_dtype_promotion("strict"):
            hfun = hlopass.jit(fun, passes="matrix_chain")
            [entry] = chain_rewrites(hfun.trace(A, B, v).report)
            assert entry.details["flops_after"] < entry.details["flops_before"]
            got = hfun(A, B, v)
            want = jax.jit(fun)(A, B, v)
        # the written order rounds A @ B to float16; the new one computes B @ v in the wider type
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=2e-2, atol=2e-2)
        assert got.dtype == want.dtype


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_custom_linear_solve_jnp_linalg_solve(dtype):
    """``jnp.linalg.solve`` is a ``custom_linear_solve`` whose sub-jaxprs sit in a namedtuple."""
    n = 17
    with precision(dtype):
        A, B, v = normal(0, (n, n), dtype), normal(1, (n, n), dtype), normal(2, (n,), dtype)

        def fun(A, B, v):
            return jnp.linalg.solve(A @ A.T + n * jnp.eye(n, dtype=A.dtype), A @ B @ v)

        hfun = hlopass.jit(fun, passes="matrix_chain")
        traced = hfun.trace(A, B, v)
        assert [r.kind for r in chain_rewrites(traced.report)] == ["reorder"]
        assert not [s for s in traced.report.skipped if "raised" in s.reason]
        check_values_and_grads(fun, hfun, (A, B, v))


def test_custom_linear_solve_conjugate_gradients_body_is_reordered():
    n = 19
    A, B, y = normal(0, (n, n), jnp.float32), normal(1, (n, n), jnp.float32), normal(2, (n,), jnp.float32)

    def fun(A, B, y):
        return jax.scipy.sparse.linalg.cg(lambda u: (A @ B) @ (B.T @ (A.T @ u)) + n * u, y, maxiter=5)[0]

    hfun = hlopass.jit(fun, passes="matrix_chain")
    assert len(chain_rewrites(hfun.trace(A, B, y).report)) >= 1
    assert_close(hfun(A, B, y), jax.jit(fun)(A, B, y))


def test_programs_that_take_and_return_a_token():
    """The pass itself keeps tokens in and out (the pipeline's signature check is the engine's)."""
    A, B, v = normal(0, (13, 13), jnp.float32), normal(1, (13, 13), jnp.float32), normal(2, (13,), jnp.float32)
    closed = jax.make_jaxpr(lambda tok, A, B, v: (tok, A @ B @ v))(jax.lax.create_token(), A, B, v)
    new, report = MatrixChainPass().run(closed, resolve({"passes": "matrix_chain"}))
    assert [r.kind for r in report.rewrites] == ["reorder"]
    assert new.in_avals == closed.in_avals and new.out_avals == closed.out_avals
    out = jax.jit(jx.jaxpr_as_fun(new))(jax.lax.create_token(), A, B, v)
    assert_close(out[1], A @ B @ v)


def test_one_chain_that_fails_to_emit_does_not_cost_the_others(monkeypatch):
    """A failure inside one chain is a skip with its source line; the other chain is reordered."""
    original = chain_pass._emit

    def emit_failing_for_matrix_results(network, path, *values):
        if len(network.output) == 2:
            raise RuntimeError("simulated failure")
        return original(network, path, *values)

    monkeypatch.setattr(chain_pass, "_emit", emit_failing_for_matrix_results)
    n = 11
    A, B, C = (normal(i, s, jnp.float32) for i, s in enumerate(((n, n), (n, n), (n, 2))))
    v = normal(4, (n,), jnp.float32)

    def fun(A, B, C, v):
        return A @ B @ v, (A @ B @ C)[:, :1] @ v[:1]

    traced = hlopass.jit(fun, passes="matrix_chain").trace(A, B, C, v)
    assert len(chain_rewrites(traced.report)) == 1
    [skip] = [s for s in traced.report.skipped if "simulated failure" in s.reason]
    assert "could not be reordered" in skip.reason
    assert skip.location.startswith("test_matrix_chain_gain_and_failures.py:")
    for got, want in zip(hlopass.jit(fun, passes="matrix_chain")(A, B, C, v), jax.jit(fun)(A, B, C, v)):
        assert_close(got, want)
