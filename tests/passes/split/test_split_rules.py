"""The split rules of issue 13: triangular solves, gathers, scatters, dynamic slices, sorts.

Each program builds a kernel matrix larger than the threshold from small inputs (odd and prime
sizes) and feeds it to the primitive under test; values and gradients are compared with
``jax.jit`` of the original in float32 and float64, and no tensor of the lowered program may
exceed 1.5 times the split size (arguments and results aside).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from tests.passes.split.helpers import backward_rewrites, check

M, N = 13, 2003          # small side, long (prime) side
THRESHOLD = "32kB"       # a float32 (13, 2003) kernel is 104 kB


def points(dtype, n=N, m=M, key=0):
    rng = np.random.default_rng(key)
    return rng.uniform(-2, 2, m).astype(dtype), rng.uniform(-2, 2, n).astype(dtype)


def kernel(x, z):
    return jnp.exp(-0.5 * (x[:, None] - z[None, :]) ** 2)


def factor(dtype, lower, m=M, batch=()):
    rng = np.random.default_rng(7)
    a = rng.uniform(-0.3, 0.3, batch + (m, m)) + 2.0 * np.eye(m)
    a = np.tril(a) if lower else np.triu(a)
    return a.astype(dtype)


DTYPES = [np.float32, np.float64]


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


# -- triangular_solve ----------------------------------------------------------------------------

COMBINATIONS = list(itertools.product([True, False], repeat=3))  # lower, transpose_a, unit_diagonal


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("left_side", [True, False])
def test_triangular_solve_every_variant_values_and_gradients(left_side, dtype):
    """All sixteen combinations of left_side/lower/transpose_a/unit_diagonal (eight per program)."""
    check_solve(dtype, left_side, COMBINATIONS)


def check_solve(dtype, left_side, combinations, batch=()):
    factors = {lower: factor(dtype, lower, batch=batch) for lower in (True, False)}
    x, z = points(dtype)
    if batch:
        x = np.stack([x * (1 + 0.1 * k) for k in range(batch[0])])

    def fn(lower_factor, upper_factor, x, z):
        k = kernel(x, z) if not batch else jax.vmap(kernel, (0, None))(x, z)  # (..., m, n)
        b = k if left_side else jnp.swapaxes(k, -1, -2)                    # (..., n, m) on the right
        long_axis = -1 if left_side else -2
        outs = []
        for lower, transpose_a, unit_diagonal in combinations:
            v = lax.linalg.triangular_solve(lower_factor if lower else upper_factor, b, left_side=left_side,
                                            lower=lower, transpose_a=transpose_a, unit_diagonal=unit_diagonal)
            outs += [jnp.sum(v * v, axis=long_axis), jnp.sum(jnp.sin(v), axis=-1 - (long_axis == -1))]
        return outs
    check(fn, factors[True], factors[False], x, z, threshold=THRESHOLD, grad_argnums=(0, 1, 2, 3))


def test_triangular_solve_with_batch_dimensions():
    check_solve(np.float64, True, [(True, False, False), (False, True, True)], batch=(3,))
    check_solve(np.float32, False, [(False, True, False)], batch=(2,))


def test_triangular_solve_gradient_solves_are_split_in_the_backward_program():
    a = factor(np.float64, True)
    x, z = points(np.float64)

    def fn(a, x, z):
        v = lax.linalg.triangular_solve(a, kernel(x, z), left_side=True, lower=True)
        return jnp.sum(v * v)
    backward = backward_rewrites(fn, THRESHOLD, a, x, z, argnums=(0, 1, 2))
    assert backward, "the backward program was not split"


def test_factorisation_of_a_small_matrix_feeds_a_split_region():
    x, z = points(np.float64)

    def fn(x, z):
        kxx = kernel(x, x) + 0.1 * jnp.eye(M)
        lower = jnp.linalg.cholesky(kxx)
        q, _ = jnp.linalg.qr(kxx)
        w, _ = jnp.linalg.eigh(kxx)
        lu = jax.scipy.linalg.lu_factor(kxx)[0]
        v = jax.scipy.linalg.solve_triangular(lower, kernel(x, z), lower=True)
        return 1.0 - jnp.sum(v * v, 0) + jnp.sum(q @ kernel(x, z), 0) * w[0] + jnp.sum(lu @ kernel(x, z), 0)
    check(fn, x, z, threshold=THRESHOLD, grad_argnums=(0, 1))


# -- gather --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_take_along_axis_split_along_the_rows_the_indices_run_over(dtype):
    x, z = points(dtype, n=3001, m=509)
    idx = np.random.default_rng(1).integers(0, 3001, (509, 7)).astype(np.int32)
    idx[:, 0] = idx[:, 1]  # duplicate indices
    done = check(lambda x, z, i: jnp.take_along_axis(kernel(x, z), i, axis=1), x, z, idx,
                 threshold="512kB", grad_argnums=(0, 1))
    assert "gather" in done[0].summary


@pytest.mark.parametrize("mode", ["clip", "fill", "promise_in_bounds"])
def test_gather_out_of_range_indices_follow_the_index_mode(mode):
    x, z = points(np.float32, n=3001, m=509)
    idx = np.random.default_rng(2).integers(-4000, 4000, (509, 5)).astype(np.int32)
    if mode == "promise_in_bounds":
        idx = np.clip(idx, -3001, 3000)  # negative indices wrap, as in NumPy
    check(lambda x, z, i: jnp.take_along_axis(kernel(x, z), i, axis=1, mode=mode), x, z, idx,
          threshold="512kB")


def test_gather_columns_split_along_an_axis_the_indexing_does_not_touch():
    x, z = points(np.float64, n=3001, m=509)
    idx = np.array([5, 3000, 5, 17, 0, 2999, 1234], np.int32)  # duplicates too
    check(lambda x, z, i: jnp.sum(jnp.tanh(kernel(x, z)[:, i]), axis=1) + kernel(x, z)[:, 7],
          x, z, idx, threshold="512kB", grad_argnums=(0, 1))


def test_gather_rows_of_a_small_table_by_long_indices():
    rng = np.random.default_rng(3)
    table = rng.normal(size=(97, 16)).astype(np.float32)
    idx = rng.integers(0, 97, 20_011).astype(np.int32)
    w = rng.normal(size=16).astype(np.float32)
    done = check(lambda t, i, w: jnp.sum(jax.nn.logsumexp(t[i] * w, axis=1)), table, idx, w,  # whole rows
                 threshold="256kB", grad_argnums=(0, 2))
    assert done[0].details["size"] == 20_011


# -- scatter -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_segment_sum_split_along_the_segments_axis_carries_the_result(dtype):
    x, z = points(dtype, n=3001, m=509)
    labels = np.random.default_rng(4).integers(-2, 12, 509).astype(np.int32)  # out of range: dropped

    def fn(x, z, labels):  # the softmax needs whole rows: the split runs along the rows the labels index
        return jax.ops.segment_sum(jax.nn.softmax(kernel(x, z), axis=1), labels, num_segments=10)
    done = check(fn, x, z, labels, threshold="512kB", grad_argnums=(0, 1))
    assert "scatter-add over axis 0" in done[0].summary and "accumulated" in done[0].summary


@pytest.mark.parametrize("op", ["add", "max", "min", "set", "mul"])
def test_scatter_into_a_running_result_with_duplicate_indices(op):
    x, z = points(np.float64, n=3001, m=509)
    rng = np.random.default_rng(5)
    idx = rng.integers(0, 20, 509).astype(np.int32)  # for set, XLA:CPU's last update wins, also when split

    def fn(x, z, idx):  # the softmax needs whole rows: the split runs along the rows idx indexes
        k = jax.nn.softmax(kernel(x, z), axis=1)
        k = 0.5 + k if op == "mul" else k
        return getattr(jnp.ones((20, z.shape[0]), k.dtype).at[idx], op)(k)
    done = check(fn, x, z, idx, threshold="512kB", grad_argnums=(0, 1) if op == "add" else ())  # JAX: no scatter-mul gradient with duplicates
    assert "over axis 0" in done[0].summary and "accumulated" in done[0].summary


def test_scatter_set_of_unique_rows_then_reduced():
    x, z = points(np.float64, n=3001, m=509)
    idx = np.random.default_rng(8).permutation(600)[:509].astype(np.int32)
    check(lambda x, z, i: jnp.sum(jnp.zeros((600, 3001)).at[i].set(kernel(x, z)) ** 2, axis=0), x, z, idx,
          threshold="512kB", grad_argnums=(0, 1))


def test_scatter_split_along_its_window_axis():
    x, z = points(np.float32, n=3001, m=509)
    labels = np.random.default_rng(6).integers(0, 10, 3001).astype(np.int32)
    done = check(lambda x, z, l: jax.ops.segment_sum(kernel(x, z).T, l, num_segments=10).T, x, z, labels,
                 threshold="512kB", grad_argnums=(0, 1))
    assert "scatter-add" in done[0].summary


# -- dynamic slices and sort -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_dynamic_slice_and_update_slice_along_a_whole_axis(dtype):
    x, z = points(dtype, n=3001, m=509)

    def fn(x, z, start):
        k = kernel(x, z)
        window = lax.dynamic_slice_in_dim(k, start, 100, axis=1)
        patched = lax.dynamic_update_slice_in_dim(k, jnp.sqrt(window[:, :50] + 1.0), start + 7, axis=1)
        return jnp.sum(window, axis=1) + jnp.max(patched, axis=1)
    check(fn, x, z, np.int32(2950), threshold="512kB", grad_argnums=(0, 1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sort_along_an_axis_other_than_the_split_axis(dtype):
    x, z = points(dtype, n=3001, m=509)
    check(lambda x, z: jnp.sum(jnp.sort(kernel(x, z), axis=1)[:, -5:], axis=1) + jnp.argsort(kernel(x, z), axis=1)[:, 0],
          x, z, threshold="512kB", grad_argnums=(0, 1))
