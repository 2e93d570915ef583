"""No pass fails on custom derivatives ("Trustworthy at the frontier", item 3).

An entropic optimal-transport solve written as optimal-transport libraries (ott-jax) write it:
Sinkhorn iterations whose ``logsumexp`` is a ``functools.partial(jax.custom_jvp,
nondiff_argnums=(1, 2, 4))`` with a ``defjvp`` rule (called positionally, and with keywords as
ott-jax's geometry calls it: the body's argument names then outnumber its inputs, which JAX's
dead-code elimination asserts against), and the same solve with a ``custom_vjp``
logsumexp. Every pass of the registry alone, and the default pipeline, on its value and its
gradient (taken inside the hlopass function and of it), float32 and float64, at prime sizes
(37 and 53 points in d = 3): the numbers match ``jax.jit`` of the same function and no report
names a pass that raised. A custom_jvp and a custom_vjp function whose primal holds what passes
rewrite (a squared distance, a product chain) are rewritten inside, with the report saying so.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hlopass
from hlopass.passes import BUILTIN

PASSES = [*BUILTIN, "default"]  # the built-in passes (other test modules register test passes)
DTYPES = ["float32", "float64"]
#: Every pass alone in float32, the default pipeline in both types (float64 runs are the slow ones).
CASES = [(passes, custom, dtype) for passes in PASSES for custom in ("jvp", "vjp") for dtype in DTYPES
         if dtype == "float32" or passes == "default"]
#: float32: 20 Sinkhorn iterations at epsilon 0.1 amplify rounding; relative to the largest entry
TOLERANCE = {"float32": 2e-3, "float64": 1e-9}
N, M, D = 37, 53, 3  # primes
EPS = 0.1


@pytest.fixture(autouse=True)
def _report_failures(monkeypatch):
    # a pass that raises is skipped and named in the report (the behaviour users get): the tests
    # read the report for it, as well as the numbers
    monkeypatch.setenv("HLOPASS_RAISE_PASS_ERRORS", "0")


def precision(dtype):
    return jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext()


# -- logsumexp with custom derivatives, as ott-jax writes it ----------------------------------

@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 4))
def lse_jvp(mat, axis=None, keepdims=False, b=None, return_sign=False):
    amax = lax.stop_gradient(jnp.max(mat, axis=axis, keepdims=True))
    weighted = jnp.exp(mat - amax) if b is None else b * jnp.exp(mat - amax)
    out = amax + jnp.log(jnp.sum(weighted, axis=axis, keepdims=True))
    out = out if keepdims else jnp.squeeze(out, axis=axis)
    return (out, jnp.ones_like(out)) if return_sign else out


@lse_jvp.defjvp
def _lse_jvp_rule(axis, keepdims, return_sign, primals, tangents):
    mat, b = primals
    g_mat, g_b = tangents
    out = lse_jvp(mat, axis, keepdims, b, return_sign)
    lse = out[0] if return_sign else out
    lse_k = lse if keepdims else jnp.expand_dims(lse, axis)
    if b is None:
        t = jnp.sum(jnp.exp(mat - lse_k) * g_mat, axis=axis, keepdims=keepdims)
    else:
        t = jnp.sum(jnp.exp(mat - lse_k) * (b * g_mat + g_b), axis=axis, keepdims=keepdims)
    return out, ((t, jnp.zeros_like(t)) if return_sign else t)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def lse_vjp(mat, axis, b):
    amax = lax.stop_gradient(jnp.max(mat, axis=axis, keepdims=True))
    return jnp.squeeze(amax, axis) + jnp.log(jnp.sum(b * jnp.exp(mat - amax), axis=axis))


def _lse_vjp_fwd(mat, axis, b):
    out = lse_vjp(mat, axis, b)
    return out, (mat, b, out)


def _lse_vjp_bwd(axis, res, g):
    mat, b, out = res
    e = jnp.exp(mat - jnp.expand_dims(out, axis))
    g = jnp.expand_dims(g, axis)
    return g * b * e, g * e


lse_vjp.defvjp(_lse_vjp_fwd, _lse_vjp_bwd)


def sinkhorn(x, y, custom="jvp", iterations=20):
    """Entropic OT cost between uniform point clouds ``x`` and ``y`` (log-domain Sinkhorn)."""
    cost = jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, axis=-1)
    n, m = cost.shape
    log_a, log_b = jnp.log(jnp.full(n, 1.0 / n, x.dtype)), jnp.log(jnp.full(m, 1.0 / m, x.dtype))
    ones = jnp.ones_like(cost)

    def lse(mat, axis):
        if custom == "jvp_keywords":  # as ott-jax's geometry calls it: keywords, ``b`` left out
            return lse_jvp(mat, axis=axis, return_sign=False)
        if custom == "jvp":
            return lse_jvp(mat, axis, False, ones if axis == 1 else None, False)
        return lse_vjp(mat, axis, ones)

    def step(_, fg):
        f, g = fg
        f = EPS * log_a - EPS * lse((g[None, :] - cost) / EPS, 1)
        g = EPS * log_b - EPS * lse((f[:, None] - cost) / EPS, 0)
        return f, g

    f, g = lax.fori_loop(0, iterations, step, (jnp.zeros(n, x.dtype), jnp.zeros(m, x.dtype)))
    plan = jnp.exp((f[:, None] + g[None, :] - cost) / EPS)
    return jnp.sum(plan * cost)


def clouds(dtype):
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.standard_normal((N, D)), dtype), jnp.asarray(rng.standard_normal((M, D)), dtype))


# -- a custom_jvp / custom_vjp whose primal holds what the passes rewrite -----------------------

@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def kernel_smooth(x, y, v, scale):
    """``exp(-|x_i - y_j|^2 / scale) @ (y @ y.T @ v)``: a squared distance and a product chain."""
    sq = jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, axis=-1)
    return jnp.exp(-sq / scale) @ (y @ y.T @ v)


def _kernel_smooth_plain(x, y, v, scale):
    sq = jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, axis=-1)
    return jnp.exp(-sq / scale) @ (y @ y.T @ v)


@kernel_smooth.defjvp
def _kernel_smooth_rule(scale, primals, tangents):
    return jax.jvp(lambda *a: _kernel_smooth_plain(*a, scale), primals, tangents)


@jax.custom_vjp
def kernel_smooth_vjp(x, y, v):
    return _kernel_smooth_plain(x, y, v, 2.0)


def _kernel_smooth_fwd(x, y, v):
    out, pullback = jax.vjp(lambda *a: _kernel_smooth_plain(*a, 2.0), x, y, v)
    return out, (x, y, v)


def _kernel_smooth_bwd(res, g):
    return jax.vjp(lambda *a: _kernel_smooth_plain(*a, 2.0), *res)[1](g)


kernel_smooth_vjp.defvjp(_kernel_smooth_fwd, _kernel_smooth_bwd)


def smoothed(x, y, v, custom="jvp"):
    out = kernel_smooth(x, y, v, 2.0) if custom == "jvp" else kernel_smooth_vjp(x, y, v)
    return jnp.sum(jnp.tanh(out))


def smoothing_inputs(dtype):
    rng = np.random.default_rng(1)
    return (jnp.asarray(rng.standard_normal((N, D)), dtype), jnp.asarray(rng.standard_normal((M, D)), dtype),
            jnp.asarray(rng.standard_normal((M, 5)) / 10, dtype))


# -- checks -------------------------------------------------------------------------------------

def hjit(fun, passes):
    # small enough that the passes fire at these sizes (the cost matrix is 7.8 kB in float32)
    return hlopass.jit(fun, passes=passes, threshold="1kB", split_size="1kB")


def assert_close(got, want, dtype):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape
        tol = TOLERANCE[dtype]
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * max(1.0, float(np.max(np.abs(w)))))


def failures(reports):
    """The report entries of passes that raised (and were skipped for the whole program)."""
    return [str(s) for r in reports for s in r.skipped if s.location == "<pass>"]


def check(fun, args, passes, dtype):
    """``fun`` under hlopass.jit matches jax.jit; so does the gradient of the hlopass function.
    No report names a failed pass. Returns the reports (the function's, then its gradient's)."""
    h = hjit(fun, passes)
    assert_close(h(*args), jax.jit(fun)(*args), dtype)
    reports = [h.trace(*args).report]
    argnums = tuple(range(len(args)))
    assert_close(jax.jit(jax.value_and_grad(h, argnums))(*args), jax.jit(jax.value_and_grad(fun, argnums))(*args),
                 dtype)
    reports += hlopass.reports(jax.value_and_grad(h, argnums), *args)
    assert not failures(reports), failures(reports)
    return reports


@pytest.mark.parametrize("passes, custom, dtype", CASES + [(p, "jvp_keywords", "float32") for p in PASSES])
def test_sinkhorn(passes, custom, dtype):
    """The Sinkhorn cost, and its gradient in both point clouds taken inside hlopass.jit and of it."""
    with precision(dtype):
        args = clouds(dtype)
        fun = functools.partial(sinkhorn, custom=custom)
        check(fun, args, passes, dtype)
        grad = jax.value_and_grad(fun, (0, 1))
        h = hjit(grad, passes)
        assert_close(h(*args), jax.jit(grad)(*args), dtype)
        report = h.trace(*args).report
        assert not failures([report]), failures([report])


@pytest.mark.parametrize("passes, custom, dtype", CASES)
def test_rewrites_inside_custom_derivative(passes, custom, dtype):
    """A squared distance and a product chain in a custom_jvp (with a nondiff argnum) or custom_vjp primal."""
    with precision(dtype):
        args = smoothing_inputs(dtype)
        reports = check(functools.partial(smoothed, custom=custom), args, passes, dtype)
    forward = reports[0]
    by_pass = {}
    for r in forward.rewrites:
        by_pass.setdefault(r.pass_name, []).append((r.kind, r.location))
    body = "kernel_smooth" if custom == "jvp" else "_kernel_smooth_plain"
    # rewritten inside the custom-derivative function's primal, at its source lines
    if passes in ("algebraic", "default"):
        assert ("squared_distance", f"test_custom_derivatives.py:{_line(body, 'sq =')} ({body})") in by_pass["algebraic"]
    if passes in ("matrix_chain", "default"):  # y @ y.T @ v, reordered with the kernel product
        assert [kind for kind, where in by_pass["matrix_chain"] if body in where] == ["reorder"]
    if passes == "split":
        assert [kind for kind, where in by_pass["split"] if body in where] == ["split"]
    if passes in ("hvp", "remat"):  # no inner gradient; no memory pressure
        assert not forward.rewrites


def _line(function, text):
    """The line of ``function``'s body that holds ``text``."""
    import inspect
    fun = {"kernel_smooth": kernel_smooth.fun, "_kernel_smooth_plain": _kernel_smooth_plain}[function]
    lines, start = inspect.getsourcelines(fun)
    return start + next(k for k, line in enumerate(lines) if text in line)
