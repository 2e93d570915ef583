"""The splitting pass: eXLA's splitter tests ported (with numbers), reducers, remainders, dtypes, batches.

Every test compares with ``jax.jit`` of the unrewritten function, checks that
the pass reported a split, and (where the whole program is in one loop) that
no tensor outside loop bodies in the lowered StableHLO exceeds the split size.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hlopass
from fixtures.kernels import kernel_matvec
from fixtures.knn import knn_l1, knn_l2
from hlopass import stablehlo

SPLIT = 256_000  # bytes: the threshold and split size of most tests


def max_tensor_bytes(module) -> int:
    """Largest op result outside loop bodies, not counting the loops' own results: those are the
    loop-carried state, whose constants are the inputs themselves passed through (no new memory)."""
    return stablehlo.max_tensor_bytes(module, loop_results=False)


def split_jit(fn, threshold=SPLIT, split_size=None):
    return hlopass.jit(fn, passes="split", threshold=threshold, split_size=split_size or threshold)


def rewrites(fn, *args, **kw):
    return [r for r in split_jit(fn, **kw).trace(*args).report.rewrites if r.pass_name == "split" and r.kind == "split"]


def check(fn, *args, threshold=SPLIT, split_size=None, rtol=1e-5, atol=1e-5, bounded=True, splits=1):
    """Assert the split fired ``splits`` times, kept tensors within the split size, and matches jax.jit."""
    split_size = split_size or threshold
    f = split_jit(fn, threshold, split_size)
    traced = f.trace(*args)
    done = [r for r in traced.report.rewrites if r.pass_name == "split" and r.kind == "split"]
    assert (len(done) >= 1 if splits is None else len(done) == splits), traced.report
    for entry in done:
        assert entry.details["chunk_bytes"] <= split_size or entry.details["nested"]
        assert entry.details["largest_before"] > threshold
        assert entry.location != "<unknown>"
    lowered = f.lower(*args)
    if bounded:  # an input larger than the split size may still be copied whole (e.g. given a unit axis)
        largest_input = max(np.asarray(a).nbytes for a in jax.tree_util.tree_leaves(args))
        assert max_tensor_bytes(lowered.compiler_ir("stablehlo")) <= max(split_size, largest_input)
    got, want = lowered.compile()(*args), jax.jit(fn)(*args)
    jax.tree_util.tree_map(lambda g, w: np.testing.assert_allclose(g, w, rtol=rtol, atol=atol), got, want)
    return done


def normal(key, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(key), shape, dtype)


# -- eXLA's splitter tests, ported -------------------------------------------------------------

def test_exp_abt_times_v_on_the_right():
    a, b, v = normal(0, (509, 5)), normal(1, (307, 5)), normal(2, (307,))
    check(lambda a, b, v: jnp.exp(-jnp.abs(a @ b.T)) @ v, a, b, v)


def test_exp_abt_times_v_on_the_left():
    a, b, v = normal(0, (509, 5)), normal(1, (307, 5)), normal(2, (509,))
    check(lambda a, b, v: v @ jnp.exp(-jnp.abs(a @ b.T)), a, b, v)


def test_self_dot_contracts_the_split_axis():
    x, w = normal(0, (4001,)), normal(1, (31,))
    done = check(lambda x, w: (lambda m: m.T @ m)(jnp.sin(x[:, None] * w[None, :])), x, w, rtol=1e-4, atol=1e-3)
    assert done[0].details["reducers"] == ["dot_general"]


def test_dot_split_on_its_right_operand():
    x, y, v = normal(0, (211, 3)), normal(1, (401, 3)), normal(2, (211,))
    check(lambda x, y, v: jnp.einsum("n,nm->m", v, jnp.tanh(x @ y.T)), x, y, v)


def test_broadcast_of_a_scalar_source():
    x, y, s = normal(0, (523, 3)), normal(1, (521, 3)), jnp.float32(0.3)
    check(lambda x, y, s: jnp.sum(jnp.full((523, 521), s) * jnp.cos(x @ y.T), axis=1), x, y, s)


def test_broadcast_split_on_the_operand_dimension():
    x, y = normal(0, (613,)), normal(1, (409,))
    check(lambda x, y: jnp.sum(jnp.exp(-(x[:, None] - y[None, :]) ** 2), axis=1), x, y)


@pytest.mark.parametrize("dimension", [0, 1])
def test_iota_along_and_across_its_dimension(dimension):
    a = normal(0, (1009,))
    fn = lambda a: jnp.sum(lax.broadcasted_iota(jnp.float32, (1009, 997), dimension) * a[:, None], axis=1 - dimension)
    check(fn, a, rtol=1e-5, atol=1e-2)


def test_single_operand_reduce_max():
    a, b = normal(0, (301, 7)), normal(1, (503, 7))
    check(lambda a, b: jnp.max(jnp.exp(a @ b.T), axis=0), a, b)


def test_variadic_argmax_over_a_broadcast():
    x, y = normal(0, (97, 7)), normal(1, (101, 7))
    check(lambda x, y: jnp.argmax(x[:, None, :] * y[None, :, :], axis=1), x, y)


def test_naive_distance_exp_dot_chain():
    x, y, v = normal(0, (1009, 3)), normal(1, (997, 3)), normal(2, (997,))
    done = check(kernel_matvec, x, y, v, rtol=1e-4, atol=1e-4)
    assert done[0].details["equations"] >= 6  # broadcast distance, square, sum, scale, exp and the dot in one loop


# -- reducers and monoids ----------------------------------------------------------------------

@pytest.mark.parametrize("reduce", [jnp.sum, jnp.max, jnp.min, jnp.prod, jnp.any, jnp.all])
def test_reductions_along_every_axis(reduce):
    a, b = normal(0, (211, 5)), normal(1, (307, 5))

    def fn(a, b):
        if reduce in (jnp.any, jnp.all):
            big = lambda: jnp.sin(a @ b.T) > -0.99  # noqa: E731 - a bool reduced from a large float
        elif reduce is jnp.prod:
            big = lambda: 1.0 + 1e-3 * jnp.sin(a @ b.T)  # noqa: E731
        else:
            big = lambda: jnp.sin(a @ b.T)  # noqa: E731
        return [reduce(big(), axis=axis) for axis in (0, 1, None)]
    assert len(check(fn, a, b, threshold=100_000, rtol=1e-4, atol=1e-4, splits=None)) == 3


def test_argmax_argmin_take_the_first_index_on_ties():
    a, b = normal(0, (211, 5)), normal(1, (307, 5))

    def fn(a, b):  # few distinct values: many ties
        return [arg(jnp.round(2 * jnp.tanh(a @ b.T)), axis=axis) for arg in (jnp.argmax, jnp.argmin) for axis in (0, 1)]
    assert len(check(fn, a, b, threshold=100_000, splits=None)) == 4


def test_argmax_with_nan_matches_jax():
    a, b = normal(0, (211, 5)), normal(1, (307, 5))
    a = a.at[3, 0].set(jnp.nan).at[100, 1].set(jnp.nan)
    check(lambda a, b: [jnp.argmax(a @ b.T, axis=axis) for axis in (0, 1)], a, b, threshold=100_000, splits=2)


def test_top_k_along_a_surviving_axis():
    a, b = normal(0, (211, 5)), normal(1, (307, 5))
    check(lambda a, b: [lax.top_k(jnp.round(4 * jnp.sin(a @ b.T)).T, 7), lax.top_k(jnp.round(4 * jnp.sin(a @ b.T)), 7)],
          a, b, threshold=100_000, splits=2)


def test_top_k_split_along_its_own_axis_with_ties():
    a, b = normal(0, (3, 5)), normal(1, (40_009, 5))
    fn = lambda a, b: lax.top_k(jnp.round(3 * jnp.sin(a @ b.T)), 5)  # only the points axis is long
    done = check(fn, a, b, threshold=100_000)
    assert done[0].details["reducers"] == ["top_k"]


def test_top_k_values_only_along_its_own_axis():
    a, b = normal(0, (3, 5)), normal(1, (20_011, 5))
    check(lambda a, b: lax.top_k(jnp.sin(a @ b.T), 4)[0], a, b, threshold=100_000)


def test_cumsum_along_another_axis_is_split_through():
    a, b = normal(0, (211, 5)), normal(1, (307, 5))
    fn = lambda a, b: jnp.sum(jnp.cumsum(jnp.sin(a @ b.T), axis=1) ** 2, axis=1)
    done = check(fn, a, b, threshold=100_000, rtol=1e-4, atol=1e-3)
    assert done[0].details["equations"] >= 4  # dot, sin, cumsum, square and sum in one loop over rows


def test_knn_l2_and_l1_same_neighbours():
    q, p = normal(0, (301, 7)), normal(1, (503, 7))
    for knn in (knn_l2, knn_l1):
        check(lambda q, p: knn(q, p, 5), q, p, rtol=1e-5, atol=1e-4)


def test_softmax_attention_is_one_loop():
    q, k, v = normal(0, (1, 4, 131, 16)), normal(1, (1, 4, 257, 16)), normal(2, (1, 4, 257, 16))

    def attention(q, k, v):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / 4
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, -1), v)
    done = check(attention, q, k, v)
    assert set(done[0].details["reducers"]) == set()  # split along an axis that survives: no accumulation


def test_transpose_and_axis_keeping_reshape_inside_a_region():
    a, b, w = normal(0, (211, 5)), normal(1, (307, 5)), normal(2, (307,))

    def fn(a, b, w):
        big = jnp.exp(-jnp.abs(a @ b.T)).reshape(211, 1, 307, 1)
        return jnp.sum(jnp.transpose(big, (2, 1, 3, 0))[:, 0, 0, :] * w[:, None], axis=0)
    done = check(fn, a, b, w, threshold=100_000)
    assert done[0].details["equations"] >= 5


def test_jax_nn_custom_jvp_functions_are_split_through():
    a, b = normal(0, (211, 5)), normal(1, (307, 5))
    check(lambda a, b: jnp.sum(jax.nn.relu(a @ b.T) + jax.nn.softplus(a @ b.T), axis=1), a, b, threshold=100_000)


def test_several_outputs_and_a_kernel_statistic():
    k = normal(0, (10_007, 30))

    def stats(x, y):
        kk = jnp.sin(x)
        return kk.T @ kk, kk.T @ y
    done = check(stats, k, normal(1, (10_007,)), threshold=500_000, rtol=1e-4, atol=1e-3, bounded=False)
    assert done[0].details["outputs"] == 2  # one loop for both statistics


# -- sizes, dtypes, batches --------------------------------------------------------------------

@pytest.mark.parametrize("n,m", [(2, 100_003), (101, 1009), (997, 211)])
def test_prime_sizes_remainder_step(n, m):
    x, y, v = normal(0, (n, 3)), normal(1, (m, 3)), normal(2, (m,))
    done = check(kernel_matvec, x, y, v, threshold=200_000, rtol=1e-4, atol=1e-4)
    assert done[0].details["size"] % done[0].details["chunk"] != 0


def test_float64():
    with jax.enable_x64(True):
        x, y, v = normal(0, (211, 3), jnp.float64), normal(1, (307, 3), jnp.float64), normal(2, (307,), jnp.float64)
        check(kernel_matvec, x, y, v, rtol=1e-12, atol=1e-12)
        check(lambda x, y: jnp.argmax(x @ y.T, axis=1), x, y)


def test_bfloat16_and_int32():
    a, b = normal(0, (211, 5), jnp.bfloat16), normal(1, (307, 5), jnp.bfloat16)
    check(lambda a, b: jnp.max(a @ b.T, axis=1), a, b, threshold=50_000)
    check(lambda a, b: jnp.sum(jnp.tanh(a @ b.T)), a, b, threshold=50_000, rtol=1e-2)  # accumulated in f32
    i, j = jnp.arange(613, dtype=jnp.int32), jnp.arange(409, dtype=jnp.int32)
    check(lambda i, j: jnp.sum((i[:, None] * j[None, :]) % 7, axis=0), i, j)


def test_vmap_of_a_split_function():
    x, y, v = normal(0, (3, 211, 3)), normal(1, (3, 307, 3)), normal(2, (3, 307))
    f = split_jit(kernel_matvec, threshold=200_000)
    got = jax.vmap(f)(x, y, v)
    np.testing.assert_allclose(got, jax.vmap(kernel_matvec)(x, y, v), rtol=1e-4, atol=1e-4)


def test_gradient_inside_the_function():
    x, y, v = normal(0, (211, 3)), normal(1, (307, 3)), normal(2, (307,))
    fn = jax.grad(lambda x, y, v: jnp.sum(jnp.sin(kernel_matvec(x, y, v))), argnums=(0, 1, 2))
    check(fn, x, y, v, threshold=200_000, rtol=1e-4, atol=1e-4, splits=None)


def hlopass_programs(fn, *args):
    """``(name, pipeline report)`` of every ``hlopass_call`` in the program of ``fn`` (forward,
    backward...), as the lowering rule will rewrite them."""
    return [(report.label, report) for report in hlopass.reports(fn, *args)]


def test_gradient_through_a_split_function_splits_the_backward_program():
    x, y, v = normal(0, (211, 3)), normal(1, (307, 3)), normal(2, (307,))
    f = split_jit(kernel_matvec, threshold=200_000)
    grad = jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2))
    want = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(kernel_matvec(*a))), argnums=(0, 1, 2)))(x, y, v)
    jax.tree_util.tree_map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4),
                           jax.jit(grad)(x, y, v), want)
    backward = [result for name, result in hlopass_programs(grad, x, y, v) if name.startswith("transpose(")]
    assert backward and all(result.rewrites for result in backward)
    # the backward program recomputes the forward distances and splits them with the cotangent work
    assert any(w.details["equations"] > 6 for result in backward for w in result.rewrites)


def test_attention_backward_is_one_loop_for_dq_dk_dv():
    from fixtures.attention import attention_loss
    q, k, v = normal(0, (1, 2, 256, 16)), normal(1, (1, 2, 384, 16)), normal(2, (1, 2, 384, 16))
    f = hlopass.jit(attention_loss, passes="split", threshold="300kB")  # a head's scores (393 kB) do not fit
    grad = jax.grad(f, argnums=(0, 1, 2))
    want = jax.jit(jax.grad(attention_loss, argnums=(0, 1, 2)))(q, k, v)
    jax.tree_util.tree_map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5),
                           jax.jit(grad)(q, k, v), want)
    backward = [result for name, result in hlopass_programs(grad, q, k, v) if name.startswith("transpose(")]
    splits = [w for result in backward for w in result.rewrites]
    assert len(splits) == 1, splits  # the probabilities are recomputed once per slice for all three
    assert splits[0].details["outputs"] >= 3 and "dot_general" in splits[0].details["reducers"]


def test_nested_split_when_one_axis_is_not_enough():
    q, p = normal(0, (700, 2)), normal(1, (1601, 2))
    done = check(lambda q, p: knn_l2(q, p, 4), q, p, threshold=5_000, splits=None)
    assert done[0].details["nested"] and done[0].details["chunk"] == 1  # one query per outer step
    assert done[1].details["reducers"] == ["top_k"]  # the points of one query, merged


def test_split_inside_a_scan_body_through_a_nested_jit():
    def fn(xs, y, v):
        def step(total, x):
            return total + jax.jit(kernel_matvec)(x, y, v).sum(), None
        return lax.scan(step, 0.0, xs)[0]
    xs, y, v = normal(0, (3, 401, 3)), normal(1, (499, 3)), normal(2, (499,))
    check(fn, xs, y, v, threshold=500_000, rtol=1e-4, bounded=False)


# -- what is left alone ------------------------------------------------------------------------

def test_small_programs_are_untouched():
    a, b = normal(0, (11, 5)), normal(1, (13, 5))
    fn = lambda a, b: jnp.sum(jnp.exp(a @ b.T), axis=1)
    traced = split_jit(fn).trace(a, b)
    assert traced.rewritten_jaxpr.jaxpr.eqns == traced.original_jaxpr.jaxpr.eqns or not traced.report.rewrites
    assert not traced.report.rewrites


def test_cumsum_along_the_only_long_axis_is_reported():
    x = normal(0, (100_003,))
    fn = lambda x: jnp.sum(jnp.cumsum(jnp.exp(x)[:, None] * jnp.ones((1, 3)), axis=0) ** 2)
    traced = split_jit(fn, threshold=200_000).trace(x)
    skipped = [s for s in traced.report.skipped if s.pass_name == "split"]
    assert any("cumsum" in s.primitive or "cumsum" in s.reason for s in skipped), traced.report
    np.testing.assert_allclose(split_jit(fn, threshold=200_000)(x), jax.jit(fn)(x), rtol=1e-5)


def test_random_numbers_stop_a_region_with_its_source_line():
    x = normal(0, (613,))

    def fn(x, key):
        noise = jax.random.normal(key, (613, 409))
        return jnp.sum(jnp.exp(x[:, None] * noise), axis=1)
    key = jax.random.PRNGKey(3)
    traced = split_jit(fn).trace(x, key)
    skipped = [s for s in traced.report.skipped if s.pass_name == "split"]
    assert skipped and all("test_split.py" in s.location for s in skipped), traced.report
    np.testing.assert_allclose(split_jit(fn)(x, key), jax.jit(fn)(x, key), rtol=1e-5)


def test_large_program_result_is_not_split():
    a, b = normal(0, (301, 5)), normal(1, (307, 5))
    fn = lambda a, b: (jnp.exp(a @ b.T), jnp.sum(jnp.exp(a @ b.T), axis=1))
    traced = split_jit(fn).trace(a, b)
    got, want = split_jit(fn)(a, b), jax.jit(fn)(a, b)
    jax.tree_util.tree_map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5), got, want)
    assert traced.report is not None


# -- the closed loop with the memory limit -------------------------------------------------------

def test_memory_limit_shrinks_the_split_until_xla_fits():
    from fixtures.attention import attention
    q, k, v = normal(0, (1, 2, 384, 16)), normal(1, (1, 2, 384, 16)), normal(2, (1, 2, 384, 16))
    f = hlopass.jit(attention, passes="split", threshold="1MB", memory_limit="350kB")
    report = f.trace(q, k, v).report
    retries = [r for r in report.rewrites if r.kind == "retry"]
    assert retries and retries[-1].details["split_size"] < 1_000_000, report
    assert any(r.kind == "memory_check" for r in report.rewrites), report
    np.testing.assert_allclose(f(q, k, v), jax.jit(attention)(q, k, v), rtol=1e-5, atol=1e-6)
    assert f.memory_checks()[0].footprint <= 350_000


def test_memory_limit_out_of_reach_is_reported():
    from fixtures.attention import attention
    q, k, v = normal(0, (1, 2, 384, 16)), normal(1, (1, 2, 384, 16)), normal(2, (1, 2, 384, 16))
    f = hlopass.jit(attention, passes="split", threshold="1MB", memory_limit="50kB")  # below the inputs
    report = f.trace(q, k, v).report
    assert len([r for r in report.rewrites if r.kind == "retry"]) == 4
    assert any("still over the limit" in s.reason for s in report.skipped), report
    np.testing.assert_allclose(f(q, k, v), jax.jit(attention)(q, k, v), rtol=1e-5, atol=1e-6)


def test_steps_are_capped_for_the_cache_when_splitting_anyway():
    """On CPU a region that is split anyway gets steps whose live set stays within ``step_cache_bytes``
    (16 MiB) even when the split size allows more (faster: README, chunk shapes); ``step_cache_bytes=0``
    keeps the largest chunk; both give jax.jit's numbers and gradients."""
    from hlopass.passes.split import SplitPass

    rng = np.random.default_rng(3)
    x = rng.normal(size=(4001, 3)).astype(np.float32)
    v = rng.normal(size=(4001,)).astype(np.float32)
    want = jax.jit(kernel_matvec)(x, x, v)
    chunks = {}
    for cache in (None, 0):
        split = SplitPass() if cache is None else SplitPass(step_cache_bytes=cache)
        fn = hlopass.jit(kernel_matvec, threshold="60MB", passes=["algebraic", split])
        [entry] = [r for r in fn.trace(x, x, v).report.rewrites if r.kind == "split"]
        chunks[cache] = entry.details["chunk_bytes"]
        np.testing.assert_allclose(fn(x, x, v), want, rtol=2e-5, atol=2e-4)
        grad = jax.grad(lambda x, v: fn(x, x, v).sum(), argnums=(0, 1))(x, v)
        want_grad = jax.grad(lambda x, v: kernel_matvec(x, x, v).sum(), argnums=(0, 1))(x, v)
        for got, ref in zip(grad, want_grad):
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-3)
    assert chunks[None] <= 16 * 2**20 < chunks[0] <= 60e6
