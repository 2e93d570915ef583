"""Regions inside sub-programs and across their boundaries: loop bodies (while, scan, fori), cond and
switch branches, nested jit, custom_jvp/custom_vjp functions, remat, closed_call, linear solves;
forward and backward programs. A sub-program the pass cannot handle is left untouched and named.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from hlopass import internals as jx

from tests.passes.split.helpers import backward_rewrites, check, split_jit, split_rewrites

THRESHOLD = "256kB"


def data(dtype=np.float32, n=1009, m=211, d=3, key=0):
    rng = np.random.default_rng(key)
    return (rng.normal(size=(n, d)).astype(dtype), rng.normal(size=(m, d)).astype(dtype),
            rng.normal(size=m).astype(dtype))


def kmv(x, y, v):
    return jnp.exp(-0.5 * jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, -1)) @ v


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_scan_body_forward_and_backward(dtype):
    x, y, v = data(dtype)

    def fn(x, y, v):
        def step(carry, scale):
            return carry + jnp.sum(jnp.tanh(kmv(x * scale, y, v + carry[:1]))), None
        return lax.scan(step, jnp.zeros(1, x.dtype), jnp.linspace(0.5, 1.5, 3).astype(x.dtype))[0]
    done = check(fn, x, y, v, threshold=THRESHOLD, grad_argnums=(0, 1, 2))
    assert all("inside scan" in r.summary for r in done)
    assert backward_rewrites(fn, THRESHOLD, x, y, v, argnums=(0, 1))


def test_while_body_with_a_traced_trip_count():
    x, y, v = data(np.float64)

    def fn(x, y, v, steps):
        return lax.fori_loop(0, steps, lambda i, u: jnp.tanh(kmv(x, y, u[:211]))[:211] + u, v)
    done = check(fn, x, y, v, np.int32(3), threshold=THRESHOLD)
    assert any("inside while" in r.summary for r in done)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cond_and_switch_branches(dtype):
    x, y, v = data(dtype)

    def fn(x, y, v, k):
        a = lax.cond(k > 0, lambda: kmv(x, y, v), lambda: jnp.tanh(kmv(x, y, 2 * v)))
        b = lax.switch(k, [lambda: jnp.max(x @ y.T, 1), lambda: jnp.min(x @ y.T, 1), lambda: kmv(x, y, v)])
        return jnp.sum(a) + b
    done = check(fn, x, y, v, np.int32(2), threshold=THRESHOLD, grad_argnums=(0, 1, 2))
    assert any("inside cond" in r.summary for r in done)
    f = split_jit(fn, THRESHOLD)
    for k in (0, 1):  # the other branches, same compiled programs
        np.testing.assert_allclose(f(x, y, v, np.int32(k)), jax.jit(fn)(x, y, v, np.int32(k)), rtol=2e-4, atol=2e-4)


def test_nested_jit_receiving_the_large_matrix_as_an_argument():
    x, y, v = data(np.float32)
    lse = jax.jit(lambda m: jax.nn.logsumexp(m, axis=1))

    def fn(x, y):
        return lse(-jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, -1))
    f = split_jit(fn, THRESHOLD)
    report = f.trace(x, y).report
    assert not [s for s in report.skipped if "not computed here" in s.reason], report
    check(fn, x, y, threshold=THRESHOLD, grad_argnums=(0, 1))


@jax.custom_jvp
def squared_distance(x, y):
    """A library's distance with its own derivative rule."""
    return jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, -1)


@squared_distance.defjvp
def _squared_distance_jvp(primals, tangents):
    x, y = primals
    dx, dy = tangents
    diff = x[:, None, :] - y[None, :, :]
    return squared_distance(x, y), jnp.sum(2 * diff * (dx[:, None, :] - dy[None, :, :]), -1)


@jax.custom_vjp
def gaussian(d):
    return jnp.exp(-0.5 * d)


gaussian.defvjp(lambda d: (gaussian(d), d), lambda d, g: (-0.5 * jnp.exp(-0.5 * d) * g,))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_custom_jvp_and_custom_vjp_functions_are_looked_through(dtype):
    x, y, v = data(dtype)
    check(lambda x, y, v: gaussian(squared_distance(x, y)) @ v, x, y, v, threshold=THRESHOLD,
          grad_argnums=(0, 1, 2))


def test_remat_and_closed_call():
    x, y, v = data(np.float64)

    def fn(x, y, v):
        k = jax.checkpoint(lambda x, y: jnp.exp(-jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, -1)))(x, y)
        closed = jax.make_jaxpr(lambda k, v: jnp.tanh(k) @ v)(k, v)
        call = jx.closed_call_p
        return call.bind(k, v, **call.get_bind_params({"call_jaxpr": closed}))[0]
    check(fn, x, y, v, threshold=THRESHOLD, grad_argnums=(0, 1, 2))


def test_linear_solve_and_cg_bodies():
    x, y, v = data(np.float32, n=701)

    def fn(x, b):
        k = lambda u: jnp.exp(-0.5 * jnp.sum((x[:, None, :] - x[None, :, :]) ** 2, -1)) @ u + u  # noqa: E731
        sol, _ = jax.scipy.sparse.linalg.cg(k, b, maxiter=4)
        return sol, jax.lax.custom_linear_solve(k, b, lambda _, r: r / 2.0, symmetric=True)
    b = np.random.default_rng(1).normal(size=701).astype(np.float32)
    done = check(fn, x, b, threshold="1MB", grad_argnums=(0, 1))
    assert any("custom_linear_solve" in r.summary for r in done)


def test_an_unhandled_sub_program_is_left_untouched_and_named(monkeypatch):
    from hlopass.passes.split import driver as split_pass
    x, y, v = data(np.float32)

    def fn(x, y, v):
        scanned = lax.scan(lambda c, s: (c + jnp.sum(kmv(x * s, y, v)), None), 0.0, jnp.ones(2, x.dtype))[0]
        return scanned, jnp.max(x @ y.T, 1)
    original = split_pass.split_level

    def failing(closed, config, report, options=split_pass.SplitOptions()):
        if any(e.primitive.name == "dot_general" and e.outvars[0].aval.shape == (1009,) for e in closed.jaxpr.eqns):
            raise RuntimeError("injected failure inside the scan body")
        return original(closed, config, report, options)
    monkeypatch.setattr(split_pass, "split_level", failing)
    f = split_jit(fn, THRESHOLD)
    report = f.trace(x, y, v).report
    skipped = [s for s in report.skipped if "injected failure" in s.reason]
    assert skipped and skipped[0].location != "<unknown>", report
    assert [r for r in split_rewrites(report) if "reduce_max" in r.summary], report  # the rest is still split
    got, want = f(x, y, v), jax.jit(fn)(x, y, v)
    jax.tree_util.tree_map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5), got, want)
