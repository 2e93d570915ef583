"""Exact rewrites fire at default settings (issue 14); inexact ones need the threshold.

An exact rewrite computes the same products and sums them in another order (``diag(A @ B)``,
``trace(A @ B)``, a broadcast-multiply-sum as a ``dot_general``): it fires whatever the threshold, as
matrix-chain reordering does. Every test compares values and gradients with ``jax.jit`` of the
unrewritten program, float32 and float64, odd sizes, with nothing set (the tests' environment has no
``HLOPASS_*`` variable).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlopass
from tests.passes.algebraic.test_algebraic import DTYPES, assert_close, normal, precision, stablehlo_max_bytes

EXACT = {
    "diag": (lambda a, b: jnp.diag(a @ b), ((61, 53), (53, 61)), "diagonal_of_product", (61, 61)),
    "diagonal": (lambda a, b: jnp.diagonal(a @ b), ((61, 53), (53, 61)), "diagonal_of_product", (61, 61)),
    "trace": (lambda a, b: jnp.trace(a @ b), ((61, 53), (53, 61)), "trace_of_product", (61, 61)),
    "trace_by_eye": (lambda a, b: jnp.sum(jnp.eye(61, dtype=a.dtype) * (a @ b)), ((61, 53), (53, 61)),
                     "trace_of_product", (61, 61)),
    "broadcast_multiply_sum": (lambda x, y: (x[:, None, :] * y[None, :, :]).sum(-1), ((61, 7), (53, 7)),
                               "contraction", (61, 53, 7)),
    "batched_broadcast_multiply_sum": (lambda x, y: jnp.sum(x[:, :, None, :] * y[:, None], -1),
                                       ((3, 29, 5), (3, 31, 5)), "contraction", (3, 29, 31, 5)),
}


def weights_like(value):
    return normal(99, np.shape(value), value.dtype)


def check(fun, hfun, args):
    want = jax.jit(fun)(*args)
    assert_close(hfun(*args), want)
    weights = weights_like(want)
    argnums = tuple(range(len(args)))
    loss = lambda f: (lambda *a: jnp.sum(weights * f(*a)))  # noqa: E731
    for got, expected in zip(jax.jit(jax.grad(loss(hfun), argnums))(*args), jax.jit(jax.grad(loss(fun), argnums))(*args)):
        assert_close(got, expected)


@pytest.mark.parametrize("name", sorted(EXACT))
@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_rewrites_fire_with_no_settings(name, dtype):
    fun, shapes, kind, skipped_shape = EXACT[name]
    with precision(dtype):
        args = tuple(normal(i, s, dtype) for i, s in enumerate(shapes))
        hfun = hlopass.jit(fun)  # default passes, default threshold (far above these sizes)
        assert hfun.config().threshold > 10**6
        rewrites = [r for r in hfun.trace(*args).report.rewrites if r.pass_name == "algebraic"]
        assert [r.kind for r in rewrites] == [kind] and rewrites[0].details["exact"]
        check(fun, hfun, args)
        skipped = int(np.prod(skipped_shape)) * np.dtype(dtype).itemsize
        assert stablehlo_max_bytes(hfun, *args) < skipped <= stablehlo_max_bytes(jax.jit(fun), *args)


@pytest.mark.parametrize("threshold", ["off", "10GB"])
def test_exact_rewrites_fire_whatever_the_threshold(threshold):
    fun, shapes, kind, _ = EXACT["diag"]
    args = tuple(normal(i, s, jnp.float32) for i, s in enumerate(shapes))
    assert [r.kind for r in hlopass.jit(fun, threshold=threshold).trace(*args).report.rewrites] == [kind]


@pytest.mark.parametrize("dtype", DTYPES)
def test_sum_of_product_fires_with_no_settings_without_matrix_chain(dtype):
    fun = lambda a, b: jnp.sum(a @ b, axis=1)  # noqa: E731
    with precision(dtype):
        args = normal(0, (61, 5), dtype), normal(1, (5, 67), dtype)
        hfun = hlopass.jit(fun, passes="algebraic")
        assert [r.kind for r in hfun.trace(*args).report.rewrites] == ["sum_of_product"]
        check(fun, hfun, args)
        # with the default pipeline the reordering is the matrix-chain pass's (min_gain applies)
        assert [r.kind for r in hlopass.jit(fun).trace(*args).report.rewrites] == ["reorder"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_inexact_distance_needs_the_threshold(dtype):
    """The expanded distance costs accuracy: with nothing set it is not used at these sizes."""
    fun = lambda x, y: jnp.exp(-jnp.sum((x[:, None] - y[None]) ** 2, -1))  # noqa: E731
    with precision(dtype):
        args = normal(0, (61, 7), dtype), normal(1, (53, 7), dtype)
        assert hlopass.jit(fun).trace(*args).report.rewrites == []
        assert [r.kind for r in hlopass.jit(fun, threshold="10kB").trace(*args).report.rewrites] == ["squared_distance"]


def test_exact_rewrites_in_a_long_program_stay_cheap_to_find():
    """Roots that no product feeds are not expanded at all (the pass stays linear in the program)."""
    def fun(x, w):
        for _ in range(200):
            x = jnp.tanh(x @ w) * 0.5 + x
        return jnp.sum(x)
    x, w = normal(0, (8, 8), jnp.float32), normal(1, (8, 8), jnp.float32)
    report = hlopass.jit(fun, passes="algebraic").trace(x, w).report
    assert report.rewrites == [] and report.passes[0].seconds < 2.0
