"""The algebraic pass keeps the written program's answers (issue 12): each test is named after a
defect, compares with ``jax.jit`` of the unrewritten program (values and gradients, float32 and
float64, odd sizes) and checks the report says what was left alone and why."""

from __future__ import annotations

import jax
from hlopass import internals as jx
import jax.numpy as jnp
import numpy as np
import pytest

import hlopass
from hlopass.passes.algebraic import AlgebraicPass
from hlopass.settings import resolve
from tests.passes.algebraic.test_algebraic import (DTYPES, algebraic, assert_close, big, check_values_and_grads, kinds,
                                                   normal, precision, stablehlo_max_bytes)

# -- a pair potential written as molecular-dynamics libraries write it --------------------------


def safe_distance(R):
    """Displacements, squared distance, the safe square root of jax-md (``safe_mask``)."""
    dR = R[:, None, :] - R[None, :, :]
    dr2 = jnp.sum(dR ** 2, axis=-1)
    return jnp.where(dr2 > 0, jnp.sqrt(jnp.where(dr2 > 0, dr2, 0.0)), 0.0)


def soft_sphere_energy(R):
    """A finite-range soft-sphere energy with a diagonal mask."""
    dr = safe_distance(R)
    mask = 1.0 - jnp.eye(R.shape[0], dtype=R.dtype)
    return 0.5 * jnp.sum(jnp.where(dr < 1.5, (1.0 - dr / 1.5) ** 2, 0.0) * mask)


def positions(n, dtype, offset=0.0):
    box = (n / 0.5) ** (1 / 3)
    return jnp.asarray(np.random.default_rng(0).uniform(0, box, (n, 3)) + offset, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pair_potential_forces_are_not_nan(dtype):
    """Energy and forces of the pair potential under the default passes at a threshold that makes the
    n x n x 3 displacements candidates: forces used to be NaN (thousands of components)."""
    with precision(dtype):
        R = positions(601, dtype)
        value_and_grad = jax.value_and_grad(soft_sphere_energy)
        compiled = hlopass.jit(value_and_grad, threshold="256kB")
        energy, forces = compiled(R)
        want_energy, want_forces = jax.jit(value_and_grad)(R)
        assert not np.any(np.isnan(np.asarray(forces)))
        assert_close(energy, want_energy)
        assert_close(forces, want_forces)
        report = compiled.trace(R).report
        assert "squared_distance" not in [r.kind for r in report.rewrites]
        [skip] = [s for s in report.skipped if s.pass_name == "algebraic" and "squared distance feeds" in s.reason]
        assert "comparison" in skip.reason and skip.location.startswith("test_algebraic_trust.py:")
        # the same through jax.grad of the hlopass function (the backward program is its own)
        outer = jax.jit(jax.grad(hlopass.jit(soft_sphere_energy, threshold="256kB")))(R)
        assert not np.any(np.isnan(np.asarray(outer)))
        assert_close(outer, want_forces)


@pytest.mark.parametrize("offset", [0.0, 1000.0])
def test_pair_forces_far_from_the_origin_keep_plain_accuracy(offset):
    """The gradient form ``Σ_m g·(x − y)`` is expanded (its n x n x 3 tensor is gone) with the point
    set centred: against float64, its float32 error is within 2x that of plain ``jax.jit``."""
    with jax.enable_x64(True):
        R64 = positions(401, jnp.float64, offset)
        truth = np.asarray(jax.jit(jax.grad(soft_sphere_energy))(R64))
    R = jnp.asarray(R64, jnp.float32)
    compiled = hlopass.jit(jax.grad(soft_sphere_energy), passes="algebraic", threshold="64kB")
    done = compiled.trace(R).report.rewrites
    assert [r.kind for r in done] == ["expanded_product", "expanded_product"] and all(r.details["centred"] for r in done)
    plain_error = np.max(np.abs(np.asarray(jax.jit(jax.grad(soft_sphere_energy))(R)) - truth))
    error = np.max(np.abs(np.asarray(compiled(R)) - truth))
    assert error <= 2 * plain_error + 1e-6 * np.max(np.abs(truth))


# -- Inf and NaN ----------------------------------------------------------------------------

def sq_distance(x, y):
    return jnp.sum((x[:, None] - y[None]) ** 2, -1)


def nonfinite_points(seed, n, d, dtype):
    """Points with +Inf, -Inf and NaN coordinates, some pairs infinite in the same coordinate."""
    x = np.random.default_rng(seed).standard_normal((n, d))
    x[1, 0] = np.inf
    x[2, 1] = -np.inf
    x[3, 2] = np.nan
    x[4, :2] = [np.inf, -np.inf]
    x[5, 0] = -np.inf
    return jnp.asarray(x, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [3, 37])  # 37 features: three words of infinite-coordinate bits
def test_expanded_distance_keeps_inf_and_nan(dtype, d):
    """An infinite coordinate gives +Inf as in plain JAX (it gave NaN), Inf - Inf and NaN give NaN."""
    with precision(dtype):
        x, y = nonfinite_points(0, 11, d, dtype), nonfinite_points(1, 13, d, dtype)
        y = y.at[7, 0].set(np.inf)  # meets x[1] (+Inf at 0) in the same coordinate: Inf - Inf
        compiled = algebraic(sq_distance, threshold="100B")
        for a, b in ((x, y), (x, x)):
            assert kinds(compiled, a, b) == ["squared_distance"]
            got, want = np.asarray(compiled(a, b)), np.asarray(jax.jit(sq_distance)(a, b))
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
            np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
            assert not np.any(np.isneginf(got))
            finite = np.isfinite(want)
            assert_close(got[finite], want[finite])
        assert np.sum(np.isposinf(np.asarray(jax.jit(sq_distance)(x, y)))) > 0  # the test can fail


@pytest.mark.parametrize("dtype", DTYPES)
def test_self_distance_has_an_exact_zero_diagonal_far_from_the_origin(dtype):
    fun = lambda x: jnp.exp(-jnp.sum((x[:, None] - x[None]) ** 2, -1)) @ jnp.ones(x.shape[0], x.dtype)  # noqa: E731
    dist = lambda x: jnp.sum((x[:, None] - x[None]) ** 2, -1)  # noqa: E731
    with precision(dtype):
        x = 1e4 + normal(0, (29, 7), dtype)
        d = np.asarray(algebraic(dist)(x))
        assert kinds(algebraic(dist), x) == ["squared_distance"]
        assert np.all(np.diag(d) == 0.0)
        assert algebraic(dist).trace(x).report.rewrites[0].details["exact_diagonal"]
        check_values_and_grads(fun, (x,), big_bytes=big(dtype, 29, 29, 7))


def test_centring_removes_the_cancellation_of_points_far_from_the_origin():
    """Two clouds 1e3 from the origin, float32: the error against float64 stays at plain's level (the
    uncentred expansion is off by ~eps * |x|^2 = 0.1 here)."""
    rng = np.random.default_rng(3)
    x64, y64 = rng.standard_normal((31, 5)) + 1e3, rng.standard_normal((37, 5)) + 1e3
    truth = ((x64[:, None] - y64[None]) ** 2).sum(-1)
    x, y = jnp.asarray(x64, jnp.float32), jnp.asarray(y64, jnp.float32)
    plain = np.abs(np.asarray(jax.jit(sq_distance)(x, y)) - truth).max()
    expanded = np.abs(np.asarray(algebraic(sq_distance, threshold="100B")(x, y)) - truth).max()
    assert expanded <= 4 * plain + 1e-4, (expanded, plain)


def where_sum(x):
    return jnp.sum(jnp.where(jnp.isnan(x), 0, x), dtype=jnp.float32)


@pytest.mark.parametrize("passes", ["algebraic", "default"])
def test_where_that_drops_a_nan_keeps_dropping_it(passes):
    """1,000,000 float16 values with one NaN: the sum of ``where(isnan(x), 0, x)`` was NaN."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal(1_000_000), jnp.float16).at[12_345].set(np.nan)
    x = x.at[777].set(np.inf).at[778].set(-np.inf)
    guarded = lambda x: jnp.sum(jnp.where(jnp.isfinite(x), x, 0), dtype=jnp.float32)  # noqa: E731
    finite_only = x.at[777].set(0).at[778].set(0)
    for fun, data in ((where_sum, x), (guarded, x), (jnp.nansum, finite_only), (jnp.nanmean, finite_only)):
        got, want = hlopass.jit(fun, threshold="1MB", passes=passes)(data), jax.jit(fun)(data)
        assert np.isfinite(want) == (fun is not where_sum)  # where_sum keeps the infinities: Inf - Inf
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=1e-3)
    report = hlopass.jit(guarded, threshold="1MB", passes="algebraic").trace(x).report
    assert report.rewrites == []


@pytest.mark.parametrize("dtype", DTYPES)
def test_where_with_a_data_mask_is_not_expanded(dtype):
    """``sum(where(mask, x*y, 0))`` over a broadcast product: the unselected products may be Inf."""
    def fun(x, y, m):
        return jnp.sum(jnp.where(m, x[:, None, :] * y[None], 0.0), -1)
    with precision(dtype):
        x, y = normal(0, (13, 7), dtype), normal(1, (11, 7), dtype)
        x = x.at[2, 3].set(np.inf)
        mask = jnp.asarray(np.random.default_rng(2).random((13, 11, 7)) > 0.3).at[2, :, 3].set(False)
        compiled = algebraic(fun, threshold="100B")
        assert compiled.trace(x, y, mask).report.rewrites == []
        np.testing.assert_array_equal(compiled(x, y, mask), jax.jit(fun)(x, y, mask))


def test_product_with_an_identity_mask_matches_jax_jit_with_an_inf_off_the_diagonal():
    """``sum(eye * (A @ B))`` is read as a selection; so does XLA under ``jax.jit`` (eager JAX gives
    0 * Inf = NaN): with an Inf off the diagonal of A @ B the rewrite equals ``jax.jit``."""
    for fun in (lambda a, b: jnp.sum(jnp.eye(a.shape[0], dtype=a.dtype) * (a @ b)), lambda a, b: jnp.trace(a @ b),
                lambda a, b: jnp.diagonal(a @ b)):
        a, b = normal(0, (13, 13), jnp.float32), normal(1, (13, 13), jnp.float32)
        a = a.at[3, 4].set(np.inf)
        compiled = algebraic(fun, threshold="100B")
        assert kinds(compiled, a, b) in (["trace_of_product"], ["diagonal_of_product"])
        got, want = np.asarray(compiled(a, b)), np.asarray(jax.jit(fun)(a, b))
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
        assert not np.all(np.isfinite(want))  # the test can fail
        if np.any(np.isfinite(want)):
            assert_close(got[np.isfinite(want)], want[np.isfinite(want)])


# -- where exact zeros matter ----------------------------------------------------------------

def _scan_then_sqrt(d2):
    return jax.lax.scan(lambda c, row: (c + jnp.sqrt(row), None), jnp.zeros(d2.shape[1], d2.dtype), d2)[0]


def _while_carry_compared(d2):
    def body(carry):
        i, acc = carry
        return i + 1, jnp.where(acc > 1.0, acc, acc * 2.0)
    return jax.lax.while_loop(lambda c: c[0] < 3, body, (0, d2))[1]


ZERO_SENSITIVE_USES = {
    "where_tests_it": lambda d2: jnp.where(d2 > 0, d2, 1.0),
    "sqrt": jnp.sqrt,
    "cutoff": lambda d2: jnp.where(d2 < 1.0, 1.0 - d2, 0.0),
    "reciprocal": lambda d2: 1.0 / (d2 + 0.0),
    "log": jnp.log,
    "negative_power": lambda d2: d2 ** -3,
    "fractional_power": lambda d2: d2 ** 0.75,
    "scaled_then_sqrt": lambda d2: jnp.sqrt(0.5 * d2 + 0.0),
    "in_a_scan_body": _scan_then_sqrt,
    "compared_in_a_while_carry": _while_carry_compared,
    "in_a_cond_branch": lambda d2: jax.lax.cond(True, jnp.sqrt, jnp.exp, d2),
}


@pytest.mark.parametrize("use", sorted(ZERO_SENSITIVE_USES))
def test_distance_feeding_a_zero_sensitive_use_is_left_as_written(use):
    fun = lambda x, y: ZERO_SENSITIVE_USES[use](sq_distance(x, y))  # noqa: E731
    x, y = normal(0, (13, 7), jnp.float32), normal(1, (11, 7), jnp.float32)
    x = x.at[3].set(y[4])  # an exact zero distance
    compiled = algebraic(fun, threshold="100B")
    report = compiled.trace(x, y).report
    assert report.rewrites == []
    assert any("is not exactly zero for equal points" in s.reason for s in report.skipped)
    np.testing.assert_array_equal(compiled(x, y), jax.jit(fun)(x, y))


ZERO_INSENSITIVE_USES = {
    "kernel": lambda d2: jnp.exp(-0.5 * d2),
    "nearest_neighbours": lambda d2: jax.lax.top_k(-d2, 3)[1].astype(jnp.float32),
    "scaled": lambda d2: 2.0 * d2 + 1.0,
    "while_counter_compared": lambda d2: jax.lax.fori_loop(0, 3, lambda i, a: a * 0.5, d2),
}


@pytest.mark.parametrize("use", sorted(ZERO_INSENSITIVE_USES))
def test_distance_feeding_smooth_uses_is_rewritten(use):
    fun = lambda x, y: ZERO_INSENSITIVE_USES[use](sq_distance(x, y))  # noqa: E731
    x, y = normal(0, (13, 7), jnp.float32), normal(1, (11, 7), jnp.float32)
    compiled = algebraic(fun, threshold="100B")
    assert kinds(compiled, x, y) == ["squared_distance"]
    got, want = compiled(x, y), jax.jit(fun)(x, y)
    if use == "nearest_neighbours":
        np.testing.assert_array_equal(got, want)
    else:
        assert_close(got, want)


# -- passes that failed and were skipped for the whole function --------------------------------

FOUR_OPERAND_EINSUMS = {
    # a chain whose product is only partly used: a sum of a product
    "chain": (lambda a, b, c, d: jnp.sum(jnp.einsum("ij,jk,kl,lm->im", a, b, c, d), axis=1),
              ((13, 5), (5, 7), (7, 3), (3, 29)), "sum_of_product"),
    # four vectors with no common index: every pairwise step is an outer product larger than any
    # operand, so no order keeps within the cap and the shared order must fall back
    "outer": (lambda a, b, c, d: jnp.sum(jnp.einsum("i,j,k,l->ijkl", a, b, c, d)), ((5,), (7,), (3,), (11,)),
              "sum_of_product"),
}


@pytest.mark.parametrize("name", sorted(FOUR_OPERAND_EINSUMS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_four_operand_einsum(name, dtype):
    fun, shapes, kind = FOUR_OPERAND_EINSUMS[name]
    with precision(dtype):
        args = tuple(normal(i, s, dtype) for i, s in enumerate(shapes))
        compiled = check_values_and_grads(fun, args, threshold="8B")
        assert kinds(compiled, *args) == [kind]


def test_four_operand_einsum_order_falls_back():
    from hlopass.einsum_order import einsum_order
    path = einsum_order("ij,jk,kl,lm->im", [(13, 17), (17, 19), (19, 11), (11, 23)], memory_limit=1)
    assert len(path) == 3 and all(len(step) == 2 for step in path)


def test_programs_that_take_and_return_a_token():
    x, y = normal(0, (13, 7), jnp.float32), normal(1, (11, 7), jnp.float32)
    closed = jax.make_jaxpr(lambda tok, x, y: (tok, jnp.exp(-sq_distance(x, y)), jnp.sum(x[:, None] * y[None], -1)))(
        jax.lax.create_token(), x, y)
    new, report = AlgebraicPass().run(closed, resolve({"threshold": "100B"}))
    assert sorted(r.kind for r in report.rewrites) == ["contraction", "squared_distance"]
    assert new.in_avals == closed.in_avals and new.out_avals == closed.out_avals
    out = jax.jit(jx.jaxpr_as_fun(new))(jax.lax.create_token(), x, y)
    assert_close(out[1], jnp.exp(-sq_distance(x, y)))
    assert_close(out[2], x @ y.T)


@pytest.mark.parametrize("dtype", DTYPES)
def test_custom_linear_solve_jnp_linalg_solve(dtype):
    def fun(x, y, v):
        K = jnp.exp(-sq_distance(x, y))
        return jnp.linalg.solve(K @ K.T + 17 * jnp.eye(x.shape[0], dtype=x.dtype), K @ v)
    with precision(dtype):
        args = normal(0, (17, 5), dtype), normal(1, (19, 5), dtype), normal(2, (19,), dtype)
        compiled = check_values_and_grads(fun, args, threshold="1kB")
        assert "squared_distance" in kinds(compiled, *args)


def test_one_root_that_fails_does_not_cost_the_others(monkeypatch):
    from hlopass.passes import algebraic as pass_module

    original = pass_module.Candidate.build

    def build(self, *values):
        if self.kind == "contraction":
            raise RuntimeError("simulated failure")
        return original(self, *values)

    monkeypatch.setattr(pass_module.Candidate, "build", build)
    fun = lambda x, y: (jnp.exp(-sq_distance(x, y)), jnp.sum(x[:, None] * y[None], -1))  # noqa: E731
    x, y = normal(0, (13, 7), jnp.float32), normal(1, (11, 7), jnp.float32)
    compiled = algebraic(fun, threshold="100B")
    report = compiled.trace(x, y).report
    assert [r.kind for r in report.rewrites] == ["squared_distance"]
    [skip] = [s for s in report.skipped if "simulated failure" in s.reason]
    assert skip.location.startswith("test_algebraic_trust.py:")
    for got, want in zip(compiled(x, y), jax.jit(fun)(x, y)):
        assert_close(got, want)


# -- nothing rewritten: the program as it was ----------------------------------------------------

@jax.custom_jvp
def _softplus(x):
    return jnp.logaddexp(x, 0.0)


_softplus.defjvp(lambda p, t: (_softplus(p[0]), jax.nn.sigmoid(p[0]) * t[0]))

UNTOUCHED = {
    "mean": lambda x: jnp.mean(x * x, 0),
    "nested_jit": lambda x: jax.jit(lambda y: jnp.sum(y * 1.1, 0))(x) * 0.3,
    "custom_jvp": lambda x: jnp.sum(_softplus(x) * x, 0),
    "scan": lambda x: jax.lax.scan(lambda c, r: (c + jnp.sum(r * r), None), jnp.zeros((), x.dtype), x)[0],
    "cond": lambda x: jax.lax.cond(x[0, 0] > 0, lambda v: jnp.sum(v, 0), lambda v: jnp.sum(v * v, 0), x),
    "distance_with_sqrt": lambda x: jnp.sqrt(jnp.sum((x[:, None] - x[None]) ** 2, -1)),
}


@pytest.mark.parametrize("name", sorted(UNTOUCHED))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_nothing_rewritten_returns_the_same_jaxpr_and_the_same_bits(name, dtype):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((29, 31)), dtype)
    closed = jax.make_jaxpr(UNTOUCHED[name])(x)
    new, report = AlgebraicPass().run(closed, resolve({"threshold": "100B"}))
    assert report.rewrites == [] and new is closed
    got = hlopass.jit(UNTOUCHED[name], passes="algebraic", threshold="100B")(x)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(jax.jit(UNTOUCHED[name])(x), np.float32))


def test_rewrites_keep_removing_the_big_tensor_in_both_programs():
    """The guards cost no memory: forward and backward programs of a kernel mat-vec stay free of the
    n x m x d tensor."""
    fun = lambda x, y, v: jnp.exp(-0.5 * sq_distance(x, y)) @ v  # noqa: E731
    args = normal(0, (31, 7), jnp.float32), normal(1, (37, 7), jnp.float32), normal(2, (37,), jnp.float32)
    compiled = check_values_and_grads(fun, args, threshold="2kB", big_bytes=big("float32", 31, 37, 7))
    assert stablehlo_max_bytes(compiled, *args) <= 31 * 37 * 4


def _sgpr_bound(X, y, Z, log_params):
    """Titsias's collapsed SGPR bound, written the textbook way (as in tools/bench_suite.py)."""
    from jax.scipy.linalg import cholesky, solve_triangular
    lengthscale, variance, noise = jnp.exp(log_params)
    n, m = X.shape[0], Z.shape[0]
    kuf = variance * jnp.exp(-0.5 * jnp.sum(((X[:, None] - Z[None]) / lengthscale) ** 2, -1)).T
    kuu = variance * jnp.exp(-0.5 * jnp.sum(((Z[:, None] - Z[None]) / lengthscale) ** 2, -1)) + 1e-5 * jnp.eye(m)
    L = cholesky(kuu, lower=True)
    A = solve_triangular(L, kuf, lower=True) / jnp.sqrt(noise)
    AAT = A @ A.T
    LB = cholesky(jnp.eye(m) + AAT, lower=True)
    c = solve_triangular(LB, A @ y, lower=True) / jnp.sqrt(noise)
    return (-0.5 * n * jnp.log(2 * jnp.pi * noise) - jnp.sum(jnp.log(jnp.diag(LB))) - 0.5 * jnp.dot(y, y) / noise
            + 0.5 * jnp.dot(c, c) - 0.5 * n * variance / noise + 0.5 * jnp.trace(AAT))


def test_no_finite_guard_on_operands_the_program_builds_over_the_threshold():
    """A finite guard's branch takes its operands whole. In an SGPR gradient the expanded products read
    K_uf-sized cotangents (8 MB here) that the split pass otherwise loops over: guarding them built
    them whole, and their triangular solves, on every call (temp 33 MB at a 4 MB threshold; 488 MB and
    1.4x the time at the benchmark's size). They are left unguarded, and the report says why."""
    rng = np.random.default_rng(0)
    X = rng.uniform(-3, 3, (20_000, 3)).astype(np.float32)
    y, Z = np.sin(X).sum(-1).astype(np.float32), X[:100]
    log_params = np.log(np.array([1.0, 1.0, 0.1], np.float32))
    grad = jax.value_and_grad(_sgpr_bound, argnums=(2, 3))
    ours = hlopass.jit(grad, threshold="4MB", split_size="1600kB")
    summaries = [r.summary for r in ours.trace(X, y, Z, log_params).report.rewrites if r.pass_name == "algebraic"]
    assert any("not guarded: its operand f32[100,20000] is over the threshold" in s for s in summaries)
    assert ours.lower(X, y, Z, log_params).compile().memory_analysis().temp_size_in_bytes < 2 * 4_000_000
    (value, grads), (want_value, want_grads) = ours(X, y, Z, log_params), jax.jit(grad)(X, y, Z, log_params)
    np.testing.assert_allclose(value, want_value, rtol=2e-4)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-2, atol=2e-3 * np.abs(w).max())


def test_a_large_argument_keeps_its_finite_guard():
    """The program's own arguments cost the branch nothing: a chain on a 12 kB argument at a 4 kB threshold
    keeps its guard, and an infinity in it gives NaN exactly where jax.jit does."""
    rng = np.random.default_rng(1)
    x, y, w = (rng.normal(size=s).astype(np.float32) for s in ((600, 5), (40, 5), (40, 1)))
    x[0, 0] = np.inf
    fn = lambda x, y, w: (x @ y.T) @ w  # noqa: E731
    ours = hlopass.jit(fn, threshold="4kB")
    assert [r.details["finite_guard"] for r in ours.trace(x, y, w).report.rewrites
            if r.pass_name == "matrix_chain"] == [True]
    got, want = np.asarray(ours(x, y, w)), np.asarray(jax.jit(fn)(x, y, w))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))


def distance_plus_smooth_terms(x, y, s):
    """A squared distance with smooth functions of it added before the mean over features: the mean
    can be negative (fresh seed s779685538234, where such a chain of ``v + tanh(s_k v)`` followed it).
    In a 16-bit type ``jnp.mean`` sums in float32, so the expansion removes the float32 copy while
    reading the 16-bit terms."""
    v = (x[:, None] - y[None]) ** 2
    for k in range(3):
        v = v + jnp.tanh(s[k] * v)
    return jnp.mean(v, axis=-1)


def test_only_the_squares_of_an_expanded_sum_are_clamped_at_zero(dtype="float16"):
    """The expansion keeps the tanh terms as they are and clamps only its squares: the program it
    emits (evaluated as it is, whatever the never-worse check would keep) gives the negative means
    ``jax.jit`` gives, where a clamp of the whole sum gave zero."""
    x, y = (jnp.asarray(normal(i, shape, "float32"), dtype) for i, shape in ((0, (23, 2)), (1, (89, 2))))
    s = jnp.asarray([-0.05, -1.4, 1.2], dtype)
    want = np.asarray(jax.jit(distance_plus_smooth_terms)(x, y, s), np.float32)
    assert want.min() < -0.1          # the case the clamp broke
    traced = algebraic(distance_plus_smooth_terms).trace(x, y, s)
    assert [r.kind for r in traced.report.rewrites] == ["expanded_product"]
    rewritten = traced.rewritten_jaxpr
    (got,) = jx.eval_jaxpr(rewritten.jaxpr, rewritten.consts, x, y, s)
    ulp = float(jnp.finfo(dtype).eps)     # the squares summed in float32 instead of rounded each
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=4 * ulp, atol=4 * ulp * np.abs(want).max())
    # and its gradient (the expansion's own derivative) against jax.grad of the program as written
    loss = lambda x, y, s: jnp.sum(distance_plus_smooth_terms(x, y, s).astype(jnp.float32))   # noqa: E731
    emitted = lambda x, y, s: jnp.sum(jx.eval_jaxpr(rewritten.jaxpr, rewritten.consts, x, y, s)[0]  # noqa: E731
                                      .astype(jnp.float32))
    for g, w in zip(jax.grad(emitted, (0, 1))(x, y, s), jax.grad(loss, (0, 1))(x, y, s)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, rtol=8 * ulp, atol=8 * ulp * np.abs(w).max())
