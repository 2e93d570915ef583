"""Short last-axis reductions inside split steps are unrolled (passes/split/unroll.py).

Values against ``jax.jit`` for every unrollable reduction, dtypes (float64, 16-bit, integers), NaN,
odd lengths; what is left alone; the report.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import hlopass
from hlopass.passes.split import SplitPass
from fixtures.knn import knn_l1

rng = np.random.default_rng(5)
TOL = {np.float64: 1e-12, np.float32: 2e-6, np.float16: 2e-3, ml_dtypes.bfloat16: 2e-2, np.int32: 0}


def kinds(fn, *args, **settings):
    return [r.kind for r in hlopass.jit(fn, **settings).trace(*args).report.rewrites]


def check(fn, *args, dtype=np.float32, **settings):
    ours = hlopass.jit(fn, **settings)
    got = np.asarray(ours(*args), np.float64)
    want = np.asarray(jax.jit(fn)(*args), np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    scale = max(np.nanmax(np.abs(want)), 1.0)
    np.testing.assert_allclose(got, want, atol=TOL[dtype] * scale, rtol=0, equal_nan=True)


NUMPY = {jnp.sum: np.sum, jnp.max: np.max, jnp.min: np.min, jnp.prod: np.prod}


@pytest.mark.parametrize("reduce", [jnp.sum, jnp.max, jnp.min, jnp.prod])
@pytest.mark.parametrize("d", [2, 3, 7, 16])
def test_reductions_unrolled_equal(reduce, d):
    x, y = rng.normal(size=(41, d)).astype(np.float32), rng.normal(size=(1009, d)).astype(np.float32)
    fn = lambda x, y: jnp.sum(jnp.tanh(reduce(jnp.abs(x[:, None, :] - y[None]) * 0.5, axis=-1)), axis=1)  # noqa: E731
    assert "unrolled" in kinds(fn, x, y, threshold="200kB")
    check(fn, x, y, threshold="200kB")
    # with a NaN: the split's documented rule (README: max/min propagate NaN, as NumPy), float64 reference
    x[3, d - 1] = np.nan
    inner = NUMPY[reduce](np.abs(x[:, None, :].astype(np.float64) - y[None]) * 0.5, axis=-1)
    want = np.sum(np.tanh(inner), axis=1)
    got = np.asarray(hlopass.jit(fn, threshold="200kB")(x, y), np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-4, equal_nan=True)


@pytest.mark.parametrize("dtype", [np.float64, np.float16, ml_dtypes.bfloat16, np.int32])
def test_dtypes(dtype):
    x = (rng.normal(size=(37, 3)) * 4).astype(dtype)
    y = (rng.normal(size=(1013, 3)) * 4).astype(dtype)
    fn = lambda x, y: jnp.max(jnp.sum(jnp.abs(x[:, None, :] - y[None]), axis=-1), axis=1)  # noqa: E731
    with jax.enable_x64(dtype == np.float64):
        # a 16-bit sum is left whole: XLA:CPU sums its fused terms in float32 and rounds once
        narrow = dtype in (np.float16, ml_dtypes.bfloat16)
        assert ("unrolled" in kinds(fn, x, y, threshold="100kB")) is not narrow
        check(fn, x, y, dtype=dtype, threshold="100kB")


def test_bfloat16_max_is_still_unrolled():
    """Rounding is monotonic: a 16-bit maximum of terms is the same however they are rounded."""
    x = (rng.normal(size=(37, 3)) * 4).astype(ml_dtypes.bfloat16)
    y = (rng.normal(size=(1013, 3)) * 4).astype(ml_dtypes.bfloat16)
    fn = lambda x, y: jnp.sum(jnp.max(jnp.abs(x[:, None, :] - y[None]), axis=-1), axis=1)  # noqa: E731
    assert "unrolled" in kinds(fn, x, y, threshold="100kB")
    check(fn, x, y, dtype=ml_dtypes.bfloat16, threshold="100kB")


def test_knn_l1_neighbours_identical_and_gradient():
    q, p = rng.normal(size=(53, 5)).astype(np.float32), rng.normal(size=(3001, 5)).astype(np.float32)
    ours = hlopass.jit(knn_l1, static_argnums=2, threshold="300kB")
    assert "unrolled" in [r.kind for r in ours.trace(q, p, 6).report.rewrites]
    got, want = ours(q, p, 6), jax.jit(knn_l1, static_argnums=2)(q, p, 6)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6)
    loss = lambda q, p: jnp.sum(jnp.exp(-jnp.sum(jnp.abs(q[:, None] - p[None]), -1)))  # noqa: E731
    g_ours = jax.grad(hlopass.jit(loss, threshold="300kB"), (0, 1))(q, p)
    for a, b in zip(g_ours, jax.grad(loss, (0, 1))(q, p)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-4 * np.abs(b).max())


def test_left_alone():
    x, y = rng.normal(size=(41, 40)).astype(np.float32), rng.normal(size=(1009, 40)).astype(np.float32)
    long_axis = lambda x, y: jnp.sum(jnp.sum(jnp.abs(x[:, None, :] - y[None]), -1), 1)  # noqa: E731
    assert "unrolled" not in kinds(long_axis, x, y, threshold="200kB")
    check(long_axis, x, y, threshold="200kB")
    x3, y3 = x[:, :3], y[:, :3]
    middle_axis = lambda x, y: jnp.sum(jnp.sum(jnp.abs(x[:, :, None] - y.T[None]), 1), 1)  # noqa: E731
    assert "unrolled" not in kinds(middle_axis, x3, y3, threshold="20kB")
    check(middle_axis, x3, y3, threshold="20kB")
    off = hlopass.jit(knn_l1, static_argnums=2, threshold="300kB",
                      passes=[SplitPass(unroll_max_length=0)])
    assert "unrolled" not in [r.kind for r in off.trace(x3, y3, 4).report.rewrites]
