"""A split step's ``top_k`` over a long row selects in two levels (passes/split/select.py).

The selection must equal ``lax.top_k`` bit for bit: values and indices, ties (earlier index first), NaN of
either sign (ranked above every number), ``-0`` below ``+0``, infinities, every dtype, row lengths that
do not divide into groups; and the split kNN that uses it must equal ``jax.jit``'s, gradients included.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import hlopass
from fixtures.knn import knn_l1, knn_l2
from hlopass.passes.split import SplitPass
from hlopass.passes.split.emit import _positive_nan
from hlopass.passes.split.select import group_size, grouped_top_k

DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int32]
SPECIALS = [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0]


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype != np.int32 else a


@settings(max_examples=60, deadline=None)
@given(n=st.integers(8, 1500), k=st.integers(1, 12), rows=st.integers(1, 3), dtype=st.sampled_from(DTYPES),
       grid=st.booleans(), specials=st.lists(st.sampled_from(range(len(SPECIALS))), max_size=6),
       seed=st.integers(0, 2**31))
def test_grouped_top_k_is_lax_top_k_bit_for_bit(n, k, rows, dtype, grid, specials, seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(-3, 4, size=(rows, n)).astype(np.float64) if grid else rng.normal(size=(rows, n)) * 50
    if dtype != np.int32:
        for s in specials:
            x.flat[rng.integers(x.size)] = SPECIALS[s]
    with jax.enable_x64(dtype == np.float64):
        values = jnp.asarray(x.astype(dtype))
        if dtype != np.int32:
            values = _positive_nan(values)   # as the split step hands it to top_k
        got = jax.jit(lambda v: grouped_top_k(v, k, jnp.int32))(values)
        if group_size(n, k) is None:
            assert got is None
            return
        want = jax.jit(lambda v: lax.top_k(v, k))(values)
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
        np.testing.assert_array_equal(bits(got[0]), bits(want[0]))


def test_short_rows_keep_lax_top_k():
    assert group_size(200, 10) is None          # fewer than 4 groups per selected element at any group size
    assert group_size(400, 10) == 8
    assert group_size(800, 10) == 16
    assert group_size(1280, 10) == 32
    assert group_size(10**6, 1) == 32


def rewritten_text(fn, *args, **settings):
    return str(hlopass.jit(fn, **settings).trace(*args).rewritten_jaxpr)


@pytest.mark.parametrize("knn", [knn_l1, knn_l2])
@pytest.mark.parametrize("points", [4001, 3968])       # a prime, and a whole number of groups
def test_split_knn_selects_in_groups_and_matches_jax_jit(knn, points):
    rng = np.random.default_rng(3)
    q, p = rng.normal(size=(37, 3)).astype(np.float32), rng.normal(size=(points, 3)).astype(np.float32)
    ours = hlopass.jit(knn, static_argnums=2, threshold="200kB")
    assert "bitcast_convert_type" in rewritten_text(knn, q, p, 7, static_argnums=2, threshold="200kB")
    got, want = ours(q, p, 7), jax.jit(knn, static_argnums=2)(q, p, 7)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    # the expanded L2 form rounds relative to the squared norms, not to each distance
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5 * np.abs(want[0]).max())


def test_split_knn_with_ties_nan_and_float64():
    """On a coarse grid every distance is exact and many tie: the earlier point must win, as in lax.top_k;
    a NaN coordinate makes its point's distances NaN, which lax.top_k of the negated distances ranks first."""
    rng = np.random.default_rng(4)
    with jax.enable_x64(True):
        q = rng.integers(-2, 3, size=(23, 3)).astype(np.float64)
        p = rng.integers(-2, 3, size=(2003, 3)).astype(np.float64)
        p[1500, 1] = np.nan
        fn = lambda q, p: lax.top_k(-jnp.sum(jnp.abs(q[:, None] - p[None]), -1), 9)  # noqa: E731
        got, want = hlopass.jit(fn, threshold="200kB")(q, p), jax.jit(fn)(q, p)
        assert "bitcast_convert_type" in rewritten_text(fn, q, p, threshold="200kB")
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        assert (np.asarray(got[1])[:, 0] == 1500).all()


def test_gradient_through_the_grouped_selection():
    rng = np.random.default_rng(6)
    q, p = rng.normal(size=(29, 3)).astype(np.float32), rng.normal(size=(3001, 3)).astype(np.float32)

    def loss(q, p):
        values, _ = lax.top_k(-jnp.sum((q[:, None] - p[None]) ** 2, -1), 5)
        return jnp.sum(jnp.exp(values) * jnp.arange(5.0))

    ours = hlopass.jit(jax.grad(loss, (0, 1)), threshold="200kB")
    assert "bitcast_convert_type" in str(ours.trace(q, p).rewritten_jaxpr)
    for a, b in zip(ours(q, p), jax.jit(jax.grad(loss, (0, 1)))(q, p)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5 * np.abs(b).max())


def test_the_option_turns_the_grouped_selection_off():
    rng = np.random.default_rng(7)
    q, p = rng.normal(size=(31, 3)).astype(np.float32), rng.normal(size=(2003, 3)).astype(np.float32)
    off = hlopass.jit(knn_l1, static_argnums=2, threshold="200kB", passes=[SplitPass(grouped_top_k=False)])
    text = str(off.trace(q, p, 5).rewritten_jaxpr)
    assert "top_k" in text and "bitcast_convert_type" not in text
    np.testing.assert_array_equal(np.asarray(off(q, p, 5)[1]), np.asarray(jax.jit(knn_l1, static_argnums=2)(q, p, 5)[1]))
