"""The algebraic pass: the squared-distance rewrite in every spelling, and what it must not touch.

Helpers at the top are shared with the other ``test_algebraic_*`` files.
Sizes are primes (n=13, m=11, d=7) so no axis is confused with another; the
threshold (2 kB) sits between the n x m output and the n x m x d tensor.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import hlopass
from hlopass.stablehlo import max_tensor_bytes
from fixtures import kernels, knn

#: Tolerances (relative to the largest magnitude involved) of the expanded forms against the naive ones.
TOLERANCE = {np.dtype("float32"): 2e-5, np.dtype("float64"): 1e-12}


def precision(dtype_name: str):
    """Context in which ``dtype_name`` ('float32' or 'float64') arrays can be made."""
    return jax.enable_x64(True) if dtype_name == "float64" else contextlib.nullcontext()


def normal(seed: int, shape, dtype) -> jax.Array:
    """Standard normal test data (numpy's generator: no XLA compile per shape)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def algebraic(fun, threshold="2kB"):
    """``hlopass.jit`` with only the algebraic pass."""
    return hlopass.jit(fun, passes="algebraic", threshold=threshold)


def rewrites(compiled, *args):
    return compiled.trace(*args).report.rewrites


def kinds(compiled, *args) -> list[str]:
    return [r.kind for r in rewrites(compiled, *args)]


def stablehlo_max_bytes(jitted, *args) -> int:
    """Largest tensor outside loops in the StableHLO of ``jitted`` (a jax.jit or hlopass.jit function)."""
    return max_tensor_bytes(jitted.lower(*args).compiler_ir("stablehlo"))


def assert_close(actual, expected, dtype=None):
    actual, expected = np.asarray(actual), np.asarray(expected)
    tol = TOLERANCE[np.dtype(dtype or expected.dtype)]
    scale = max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale)


def scalar_loss(fun, weights):
    """A loss linear in ``fun`` 's output, so gradients see every output entry."""
    return lambda *args: jnp.vdot(weights, fun(*args))


def check_values_and_grads(fun, args, threshold="2kB", big_bytes=None):
    """``algebraic(fun)`` matches ``jax.jit(fun)`` in value and gradient; returns the compiled function.

    With ``big_bytes``, also asserts that neither the forward nor the
    gradient program holds a tensor that large.
    """
    compiled = algebraic(fun, threshold)
    expected = jax.jit(fun)(*args)
    assert_close(compiled(*args), expected)
    weights = normal(99, expected.shape, expected.dtype)
    argnums = tuple(range(len(args)))
    grad_new = jax.jit(jax.grad(scalar_loss(compiled, weights), argnums))
    grad_old = jax.jit(jax.grad(scalar_loss(fun, weights), argnums))
    for got, want in zip(grad_new(*args), grad_old(*args)):
        assert_close(got, want)
    if big_bytes is not None:
        assert stablehlo_max_bytes(compiled, *args) < big_bytes
        assert stablehlo_max_bytes(grad_new, *args) < big_bytes
        assert stablehlo_max_bytes(jax.jit(fun), *args) >= big_bytes  # the check can fail
    return compiled


N, M, D = 13, 11, 7
DTYPES = ["float32", "float64"]


def points(dtype, n=N, m=M, d=D):
    return normal(0, (n, d), dtype), normal(1, (m, d), dtype)


def big(dtype, *shape):
    return int(np.prod(shape)) * np.dtype(dtype).itemsize


# -- the squared distance in all its spellings ------------------------------------------------

@jax.custom_jvp
def _custom_sq_diff(a, b):
    return (a - b) ** 2


_custom_sq_diff.defjvp(lambda p, t: (_custom_sq_diff(*p), 2 * (p[0] - p[1]) * (t[0] - t[1])))


@jax.jit
def _jitted_diff(a, b):
    return a[:, None] - b[None]


SQ_DISTANCE_SPELLINGS = {
    "pow_sum_last": lambda x, y: jnp.sum((x[:, None] - y[None]) ** 2, -1),
    "square_swapped_method": lambda x, y: jnp.square(y[None] - x[:, None]).sum(-1),
    "self_product_axis2": lambda x, y: (lambda e: (e * e).sum(2))(x[:, None, :] - y[None, :, :]),
    "pow_float_2": lambda x, y: jnp.sum(jnp.power(x[:, None] - y[None], 2.0), axis=-1),
    "feature_axis_first": lambda x, y: jnp.sum((x.T[:, :, None] - y.T[:, None, :]) ** 2, axis=0),
    "negated_sum": lambda x, y: jnp.sum((-y[None] + x[:, None]) ** 2, -1),
    "expand_dims": lambda x, y: jnp.sum((jnp.expand_dims(x, 1) - jnp.expand_dims(y, 0)) ** 2, -1),
    "scaled_and_shifted": lambda x, y: 0.5 * jnp.sum(((x[:, None] - y[None]) * 3.0) ** 2, -1) + 1.0,
    "custom_jvp_wrapper": lambda x, y: _custom_sq_diff(x[:, None], y[None]).sum(-1),
    "pjit_wrapper": lambda x, y: jnp.square(_jitted_diff(x, y)).sum(-1),
    "ard_lengthscales": lambda x, y: jnp.sum(jnp.square((x[:, None] - y[None]) / jnp.linspace(0.5, 2.0, D, dtype=x.dtype)), -1),
}


#: Every spelling in float32; a representative few in float64 too (each case compiles four programs).
FLOAT64_SPELLINGS = ("pow_sum_last", "feature_axis_first", "ard_lengthscales", "custom_jvp_wrapper")


@pytest.mark.parametrize("spelling,dtype", [(s, "float32") for s in sorted(SQ_DISTANCE_SPELLINGS)] +
                         [(s, "float64") for s in FLOAT64_SPELLINGS])
def test_squared_distance_spellings(spelling, dtype):
    fun = SQ_DISTANCE_SPELLINGS[spelling]
    with precision(dtype):
        x, y = points(dtype)
        compiled = check_values_and_grads(fun, (x, y), big_bytes=big(dtype, N, M, D))
        (entry,) = rewrites(compiled, x, y)
        assert entry.kind == "squared_distance" and entry.details["clamped"]
        assert entry.location.startswith("test_algebraic.py:")  # the user's line, not JAX's


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_under_sqrt_is_left_as_written(dtype):
    """A square root is sensitive to exact zeros (issue 12): the expanded distance of two close points
    is a rounding error, and sqrt would make it ~sqrt(eps)|x|; the norm keeps its written form."""
    fun = lambda x, y: jnp.linalg.norm(x[:, None] - y[None], axis=-1)  # noqa: E731
    with precision(dtype):
        x, y = points(dtype)
        compiled = algebraic(fun)
        report = compiled.trace(x, y).report
        assert report.rewrites == []
        [skip] = [s for s in report.skipped if "square root" in s.reason]
        assert "(sqrt" in skip.reason and skip.location.startswith("test_algebraic.py:")
        np.testing.assert_array_equal(compiled(x, y), jax.jit(fun)(x, y))


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_dimensions(dtype):
    fun = lambda x, y: jnp.sum((x[:, :, None, :] - y[:, None, :, :]) ** 2, -1)  # noqa: E731
    with precision(dtype):
        x, y = normal(0, (3, N, D), dtype), normal(1, (3, M, D), dtype)
        compiled = check_values_and_grads(fun, (x, y), big_bytes=big(dtype, 3, N, M, D))
        assert kinds(compiled, x, y) == ["squared_distance"]


def test_vmapped_distance_is_rewritten():
    x, y = normal(0, (3, N, D), jnp.float32), normal(1, (3, M, D), jnp.float32)
    compiled = algebraic(SQ_DISTANCE_SPELLINGS["pow_sum_last"])
    batched = jax.jit(jax.vmap(compiled))
    assert_close(batched(x, y), jax.vmap(SQ_DISTANCE_SPELLINGS["pow_sum_last"])(x, y))
    assert stablehlo_max_bytes(batched, x, y) < big("float32", 3, N, M, D)


def test_distance_inside_scan_body():
    def fun(xs, y):
        def step(carry, x):
            return carry + jnp.sum((x[:, None] - y[None]) ** 2, -1), None
        return jax.lax.scan(step, jnp.zeros((N, M), xs.dtype), xs)[0]
    xs, y = normal(0, (4, N, D), jnp.float32), normal(1, (M, D), jnp.float32)
    compiled = algebraic(fun)
    assert_close(compiled(xs, y), jax.jit(fun)(xs, y))
    assert kinds(compiled, xs, y) == ["squared_distance"]


def test_reduced_precision_inputs_see_through_convert():
    fun = lambda x, y: jnp.sum((x.astype(jnp.float32)[:, None] - y.astype(jnp.float32)[None]) ** 2, -1)  # noqa: E731
    x, y = (v.astype(jnp.bfloat16) for v in points("float32"))
    compiled = algebraic(fun)
    assert kinds(compiled, x, y) == ["squared_distance"]
    assert_close(compiled(x, y), jax.jit(fun)(x, y))


@pytest.mark.parametrize("dtype", DTYPES)
def test_self_distance_symmetric_zero_diagonal_nonnegative(dtype):
    """Points far from the origin make the expanded form cancel; the clamp keeps it at >= 0."""
    fun = lambda x: jnp.sum((x[:, None] - x[None]) ** 2, -1)  # noqa: E731
    with precision(dtype):
        x = 100.0 + normal(0, (N, D), dtype)
        dist = np.asarray(algebraic(fun)(x))
        naive = np.asarray(jax.jit(fun)(x))
        tol = TOLERANCE[np.dtype(dtype)] * float(np.max(np.sum(np.asarray(x) ** 2, -1)))
        assert np.all(dist >= 0)
        np.testing.assert_allclose(dist, dist.T, atol=tol)
        np.testing.assert_allclose(np.diag(dist), 0.0, atol=tol)
        np.testing.assert_allclose(dist, naive, atol=tol)
        assert np.all(np.isfinite(np.asarray(algebraic(lambda v: jnp.sqrt(fun(v)))(x))))


def test_fixtures_knn_and_kernels():
    q, p = points("float32", n=17, m=29)
    k = 3
    compiled = hlopass.jit(knn.knn_l2, passes="algebraic", threshold="1kB", static_argnums=2)
    dist, idx = compiled(q, p, k)
    want_dist, want_idx = jax.jit(knn.knn_l2, static_argnums=2)(q, p, k)
    np.testing.assert_array_equal(idx, want_idx)
    assert_close(dist, want_dist)
    assert kinds(compiled, q, p, k) == ["squared_distance"]
    v, ell = normal(3, (29,), jnp.float32), jnp.linspace(0.5, 2.0, D)
    plain = algebraic(kernels.kernel_matvec, threshold="1kB")
    assert_close(plain(q, p, v), jax.jit(kernels.kernel_matvec)(q, p, v))
    assert kinds(plain, q, p, v) == ["squared_distance"]
    ard = check_values_and_grads(kernels.kernel_matvec_ard, (q, p, v, ell), threshold="1kB",
                                 big_bytes=big("float32", 17, 29, D))  # the lengthscale gradient included
    assert kinds(ard, q, p, v, ell) == ["squared_distance"]


# -- look-alikes that must not fire ------------------------------------------------------------

LOOK_ALIKES = {
    "l1_abs": (lambda x, y: jnp.sum(jnp.abs(x[:, None] - y[None]), -1), "abs"),
    "max_instead_of_sum": (lambda x, y: jnp.max((x[:, None] - y[None]) ** 2, -1), None),
    "cube": (lambda x, y: jnp.sum((x[:, None] - y[None]) ** 3, -1), "cube"),
    "product_reduction": (lambda x, y: jnp.prod((x[:, None] - y[None]) ** 2, -1), None),
    "min_reduction": (lambda x, y: jnp.min(jnp.square(x[:, None] - y[None]), -1), None),
    "fourth_power": (lambda x, y: jnp.sum((x[:, None] - y[None]) ** 4, -1), "cancel"),
}


@pytest.mark.parametrize("name", sorted(LOOK_ALIKES))
def test_look_alikes_do_not_fire(name):
    fun, reason = LOOK_ALIKES[name]
    x, y = points("float32")
    compiled = algebraic(fun)
    report = compiled.trace(x, y).report
    assert report.rewrites == []
    np.testing.assert_array_equal(compiled(x, y), jax.jit(fun)(x, y))  # exact numbers kept
    if reason is not None:
        assert any(reason in s.reason for s in report.skipped), [str(s) for s in report.skipped]


def test_difference_of_full_size_tensors_does_not_fire():
    fun = lambda a, b: jnp.sum((a - b) ** 2, -1)  # noqa: E731
    a, b = normal(0, (N, M, D), jnp.float32), normal(1, (N, M, D), jnp.float32)
    compiled = algebraic(fun)
    assert compiled.trace(a, b).report.rewrites == []
    np.testing.assert_array_equal(compiled(a, b), jax.jit(fun)(a, b))


def test_difference_against_a_full_size_tensor_does_not_fire():
    fun = lambda x, z: jnp.sum((x[:, None] - z) ** 2, -1)  # noqa: E731
    x, z = normal(0, (N, D), jnp.float32), normal(1, (N, M, D), jnp.float32)
    assert algebraic(fun).trace(x, z).report.rewrites == []


def test_l1_knn_fixture_untouched():
    q, p = points("float32", n=17, m=29)
    compiled = hlopass.jit(knn.knn_l1, passes="algebraic", threshold="1kB", static_argnums=2)
    assert compiled.trace(q, p, 3).report.rewrites == []
    for got, want in zip(compiled(q, p, 3), jax.jit(knn.knn_l1, static_argnums=2)(q, p, 3)):
        np.testing.assert_array_equal(got, want)


def test_difference_still_needed_elsewhere_is_left_alone():
    """Rewriting the L2 half would save nothing while the L1 half keeps the difference alive."""
    def fun(x, y):
        diff = x[:, None] - y[None]
        return jnp.sum(diff ** 2, -1) + jnp.sum(jnp.abs(diff), -1)
    x, y = points("float32")
    report = algebraic(fun).trace(x, y).report
    assert report.rewrites == []
    assert any("stay alive" in s.reason for s in report.skipped)


def test_below_threshold_is_left_alone():
    x, y = points("float32")
    compiled = algebraic(SQ_DISTANCE_SPELLINGS["pow_sum_last"], threshold="1MB")
    assert compiled.trace(x, y).report.rewrites == []


def test_one_dimensional_points_gain_nothing_and_are_left_alone():
    """With d = 1 the n x m x 1 difference is no larger than the n x m result."""
    x, y = normal(0, (N, 1), jnp.float32), normal(1, (M, 1), jnp.float32)
    assert algebraic(SQ_DISTANCE_SPELLINGS["pow_sum_last"], threshold="100B").trace(x, y).report.rewrites == []


# -- property test -----------------------------------------------------------------------------

@settings(max_examples=8, deadline=None)
@given(n=st.integers(2, 9), m=st.integers(2, 9), d=st.integers(2, 6),
       spelling=st.sampled_from(sorted(SQ_DISTANCE_SPELLINGS)), seed=st.integers(0, 2**16))
def test_property_random_shapes(n, m, d, spelling, seed):
    fun = SQ_DISTANCE_SPELLINGS[spelling]
    if spelling == "ard_lengthscales" and d != D:
        fun = lambda x, y: jnp.sum(jnp.square((x[:, None] - y[None]) / jnp.linspace(0.5, 2.0, d)), -1)  # noqa: E731
    x, y = normal(seed, (n, d), jnp.float32), normal(seed + 1, (m, d), jnp.float32)
    compiled = algebraic(fun, threshold="off")
    assert_close(compiled(x, y), jax.jit(fun)(x, y))
    assert kinds(compiled, x, y) == ["squared_distance"]


# -- extending the matcher -----------------------------------------------------------------------

def test_a_new_identity_is_one_small_rule():
    """A primitive the matcher does not know is a leaf; one registered rule makes it transparent."""
    from hlopass import internals as jx

    from hlopass.passes.algebraic import expansion as patterns

    triple_p = jx.Primitive("test_triple")
    triple_p.def_abstract_eval(lambda x: x)
    triple_p.def_impl(lambda x: 3 * x)
    jx.register_lowering(triple_p, jx.lower_fun(lambda x: 3 * x, multiple_results=False))
    fun = lambda x, y: jnp.sum(triple_p.bind(x[:, None] - y[None]) ** 2, -1)  # noqa: E731
    x, y = points("float32")
    assert algebraic(fun).trace(x, y).report.rewrites == []  # a leaf as large as the difference

    @patterns.rule("test_triple")
    def _triple(expander, eqn, scope, _position, labels):
        return patterns.scale(expander.operand(eqn, scope, 0, labels), 3.0)

    try:
        fun = lambda x, y: jnp.sum(triple_p.bind(x[:, None] - y[None]) ** 2, -1)  # noqa: E731
        compiled = algebraic(fun)  # a new function: the first one's rewritten program is cached
        assert kinds(compiled, x, y) == ["squared_distance"]
        assert_close(compiled(x, y), jax.jit(fun)(x, y))
    finally:
        del patterns.EXPANSION_RULES["test_triple"]


def test_composes_with_split_in_the_default_pipeline():
    """The distance becomes n x m; splitting then bounds that by the threshold; numbers and gradients hold."""
    q, p = points("float32", n=97, m=89)
    v = normal(3, (89,), jnp.float32)
    compiled = hlopass.jit(kernels.kernel_matvec, threshold="8kB")
    done = [r.kind for r in compiled.trace(q, p, v).report.rewrites]
    assert "squared_distance" in done and "split" in done
    assert_close(compiled(q, p, v), jax.jit(kernels.kernel_matvec)(q, p, v))
    assert stablehlo_max_bytes(compiled, q, p, v) <= 8_000
    grad = jax.jit(jax.grad(lambda *a: compiled(*a).sum(), (0, 1, 2)))
    want = jax.jit(jax.grad(lambda *a: kernels.kernel_matvec(*a).sum(), (0, 1, 2)))(q, p, v)
    for got, expected in zip(grad(q, p, v), want):
        assert_close(got, expected)
