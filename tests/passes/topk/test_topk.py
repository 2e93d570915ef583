"""The topk pass: a long ``top_k`` as a two-level selection, bit-identical to ``jax.jit``'s.

Values are compared bit for bit (NaN signs and payloads, signed zeros) and indices exactly, over
random shapes (primes, lengths not divisible by the group), dtypes, special values and ties.
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
from hlopass.passes.topk import TopKPass, grouped_top_k, order_keys

NEG_NAN = np.frombuffer(np.uint32(0xFFC00000).tobytes(), np.float32)[0]
SPECIALS = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, NEG_NAN, 2.5], np.float32)
DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.float64, np.int32, np.int8, np.uint8]


def small(**fields):
    """The pass at test sizes (it leaves axes under 2,048 elements alone by default)."""
    return TopKPass(min_length=fields.pop("min_length", 16), **fields)


def assert_same_bits(got, want):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        g, w = np.atleast_1d(np.asarray(g)), np.atleast_1d(np.asarray(w))
        assert g.dtype == w.dtype and g.shape == w.shape
        assert np.array_equal(g.view(np.uint8), w.view(np.uint8)), (g, w)


def draw(rng, shape, dtype):
    if np.issubdtype(np.dtype(dtype), np.integer):
        return rng.integers(0, 6, size=shape).astype(dtype)  # many ties
    return rng.choice(SPECIALS, size=shape).astype(dtype)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(16, 400), k=st.integers(1, 4), batch=st.sampled_from([(), (3,), (2, 2)]),
       dtype=st.sampled_from(DTYPES), axis_first=st.booleans(), group=st.sampled_from([0, 3, 7, 16]))
def test_random_top_k_bit_identical(seed, n, k, batch, dtype, axis_first, group):
    rng = np.random.default_rng(seed)
    x = draw(rng, (*batch, n), dtype)
    axis = 0 if axis_first else -1
    if axis_first:
        x = np.moveaxis(x, -1, 0)
    fn = lambda x: lax.top_k(x, k, axis=axis)  # noqa: E731
    with jax.enable_x64(np.dtype(dtype) == np.float64):
        ours = hlopass.jit(fn, passes=[small(group_size=group, min_groups_per_k=1)])
        report = ours.trace(x).report
        if -(-n // (group or max(8, round((n / k) ** 0.5)))) >= k:
            assert [r.kind for r in report.rewrites] == ["grouped_top_k"]
        assert_same_bits(ours(x), jax.jit(fn)(x))


@pytest.mark.parametrize("n", [17, 97, 1000])
def test_grouped_top_k_ties_and_specials_every_group_size(n):
    rng = np.random.default_rng(n)
    x = draw(rng, (4, n), np.float32)
    want = jax.jit(lambda x: lax.top_k(x, 3))(x)
    for g in (1, 2, 5, n // 3):
        assert_same_bits(jax.jit(lambda x, g=g: grouped_top_k(x, 3, g))(x), want)


def test_order_keys_follow_total_order():
    x = np.array([NEG_NAN, -np.inf, -1.0, -0.0, 0.0, 1e-30, 1.0, np.inf, np.nan], np.float32)
    keys = np.asarray(order_keys(x))
    assert np.all(np.diff(keys) > 0), keys


def test_gradient_through_top_k_values():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(5, 301)).astype(np.float32)
    loss = lambda x: jnp.sum(jnp.sin(lax.top_k(x, 4)[0]))  # noqa: E731
    ours = hlopass.jit(jax.value_and_grad(loss), passes=[small()])
    assert any(r.kind == "grouped_top_k" for r in ours.trace(x).report.rewrites)
    assert_same_bits(ours(x), jax.jit(jax.value_and_grad(loss))(x))
    assert_same_bits(jax.grad(hlopass.jit(loss, passes=[small()]))(x), jax.grad(loss)(x))


def test_vmap_outside():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(3, 2, 211)).astype(np.float32)
    fn = lambda x: lax.top_k(x, 5)  # noqa: E731
    assert_same_bits(jax.vmap(hlopass.jit(fn, passes=[small()]))(x), jax.vmap(fn)(x))


def test_leaves_alone_short_axes_and_k_near_n():
    x = np.arange(40, dtype=np.float32)
    short = hlopass.jit(lambda x: lax.top_k(x, 3))  # the default minimum length: 2,048
    assert not short.trace(x).report.rewrites
    near = hlopass.jit(lambda x: lax.top_k(x, 30), passes=[small()])
    report = near.trace(x).report
    assert not report.rewrites and any("too close" in s.reason for s in report.skipped)
    assert_same_bits(near(x), jax.jit(lambda x: lax.top_k(x, 30))(x))


@pytest.mark.parametrize("knn", [knn_l2, knn_l1])
def test_split_knn_selections_are_grouped(knn):
    """Default pipeline on a kNN above the threshold: split's per-slice top_k (inside the loop) and
    the merges are grouped where long enough; neighbours identical to jax.jit's."""
    rng = np.random.default_rng(3)
    q, p = rng.normal(size=(37, 3)).astype(np.float32), rng.normal(size=(5003, 3)).astype(np.float32)
    ours = hlopass.jit(knn, static_argnums=2, threshold="400kB", split_size="300kB")
    kinds = [r.kind for r in ours.trace(q, p, 7).report.rewrites]
    assert "grouped_top_k" in kinds and any(k.startswith("split") or "loop" in k for k in kinds), kinds
    got, want = ours(q, p, 7), jax.jit(knn, static_argnums=2)(q, p, 7)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    want_d = np.asarray(want[0])  # L2 is expanded by the algebraic pass: float32 cancellation, not exact
    np.testing.assert_allclose(np.asarray(got[0]), want_d, atol=2e-4 * np.abs(want_d).max(), rtol=0)
