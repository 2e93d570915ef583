"""Loops whose chunk does not divide the axis end with an overlapping whole step (``LoopPlan.overlap_tail``).

The last step covers the axis's last ``chunk`` rows, overlapping the step before it, so XLA compiles
the step once instead of a second, shorter copy. Rows the two steps share enter each reduction once,
from the last step, which also writes them last (an online softmax's running maximum and rescaled sums
too). Loops whose steps depend on the ones before otherwise (scans, scatters, ``top_k``,
arg-reductions) keep their short step, and so does every loop that recomputes a product one of those
recomputes (``harmonise_tails``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlopass
from hlopass.passes.split import SplitPass
from tests.passes.split.helpers import assert_close, check, split_jit, split_rewrites


def normal(key, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(key), shape, dtype)


def kernel_stats(x, y, v):
    """Rows of a kernel times ``v`` (written slice by slice) and its column sums (accumulated)."""
    k = jnp.exp(-jnp.square(x @ y.T))
    return k @ v, jnp.sum(k, axis=0), jnp.max(k * v, axis=0)


def the_split(report):
    done = split_rewrites(report)
    assert len(done) == 1, report
    return done[0]


def dots_in(lowered) -> int:
    return lowered.as_text().count("stablehlo.dot_general")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("n", [211, 1009])
def test_an_odd_axis_ends_with_an_overlapping_step_and_matches_jax_jit(dtype, n):
    with jax.enable_x64(dtype == jnp.float64):
        x, y, v = normal(0, (n, 3), dtype), normal(1, (307, 3), dtype), normal(2, (307,), dtype)
        done = check(kernel_stats, x, y, v, threshold=60_000, grad_argnums=(0, 1, 2))
        split = the_split(split_jit(kernel_stats, 60_000).trace(x, y, v).report)
    assert split.details["size"] % split.details["chunk"] != 0, split.summary
    assert split.details["overlapping_last"], split.summary
    shared = split.details["chunk"] - split.details["size"] % split.details["chunk"]
    assert f"the last overlapping the one before by {shared}" in split.summary
    assert done


def test_the_step_is_compiled_once():
    """The lowered program holds the loop's products once (in the loop body); with the setting off, a
    second, shorter copy of the step follows the loop."""
    x, y, v = normal(0, (1009, 3)), normal(1, (307, 3)), normal(2, (307,))
    lowered = split_jit(kernel_stats, 60_000).lower(x, y, v)
    assert the_split(lowered.report).details["overlapping_last"]
    assert dots_in(lowered) == 2, lowered.as_text()   # x @ y.T and k @ v, once each
    short = hlopass.jit(kernel_stats, threshold=60_000, split_size=60_000,
                        passes=[SplitPass(overlap_last_step=False)]).lower(x, y, v)
    split = the_split(short.report)
    assert not split.details["overlapping_last"]
    assert f"(last {split.details['size'] % split.details['chunk']})" in split.summary
    assert dots_in(short) == 4, short.as_text()
    assert_close(short.compile()(x, y, v), lowered.compile()(x, y, v), 1e-5, 1e-5)


def assert_same_specials(got, want):
    """NaN and infinities in the same places, the finite values close."""
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    assert finite.any()
    assert_close(got[finite], want[finite], 2e-4, 2e-4)


@pytest.mark.parametrize("reduce", [jnp.sum, jnp.prod, jnp.max, jnp.min])
def test_rows_in_both_last_steps_count_once_in_every_monoid(reduce):
    """Values that a second count would change (a sum, a product), and infinities (and, for a sum or a
    product, a NaN) in the rows the last two steps share: they come through as in ``jax.jit``. (XLA:CPU's
    maximum drops a NaN that hlopass's keeps: the README's NaN rule.)"""
    n = 1009
    fn = lambda x: reduce(jnp.exp(x), axis=0)   # noqa: E731
    x = np.array(normal(0, (n, 7))) * 0.1
    check(fn, jnp.asarray(x), threshold=4_000, bound=2.0)
    split = the_split(split_jit(fn, 4_000).trace(x).report)
    assert split.details["overlapping_last"], split.summary
    first_shared = n - split.details["chunk"]
    if reduce in (jnp.sum, jnp.prod):
        x[first_shared, 1] = np.nan
    x[first_shared + 1, 2] = np.inf
    x[first_shared + 1, 3] = -np.inf
    assert_same_specials(split_jit(fn, 4_000)(x), jax.jit(fn)(x))


def test_a_product_contracted_over_the_axis_with_infinities_in_the_shared_rows():
    """``a.T @ b`` contracts the split axis: both operands' shared rows are left out of all but the last
    step, so an infinity there stays an infinity (one left-out operand times the other's infinity would
    be NaN)."""
    n = 1009
    a, b = np.array(normal(0, (n, 40))), np.array(normal(1, (n, 40)))
    fn = lambda a, b: jnp.tanh(a).T @ jnp.exp(b)   # noqa: E731
    check(fn, jnp.asarray(a), jnp.asarray(b), threshold=20_000, grad_argnums=(0, 1))
    split = the_split(split_jit(fn, 20_000).trace(a, b).report)
    assert split.details["overlapping_last"], split.summary
    b[n - split.details["chunk"], 5] = np.inf
    assert_same_specials(split_jit(fn, 20_000)(a, b), jax.jit(fn)(a, b))


def test_integer_and_boolean_reductions():
    i, j = jnp.arange(613, dtype=jnp.int32), jnp.arange(409, dtype=jnp.int32)
    fn = lambda i, j: (jnp.sum((i[:, None] * j[None, :]) % 7, axis=0),    # noqa: E731
                       jnp.any((i[:, None] + j[None, :]) % 97 == 0, axis=0),
                       jnp.all((i[:, None] * j[None, :]) % 5 != 1, axis=0))
    f = split_jit(fn, 100_000)
    done = split_rewrites(f.trace(i, j).report)
    assert done and all(r.details["overlapping_last"] for r in done), done
    for got, want in zip(f(i, j), jax.jit(fn)(i, j)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_an_online_softmax_overlaps_its_last_step(dtype):
    """A log-sum-exp and a softmax-weighted sum down the rows (a running maximum, sums rescaled by it):
    the largest logit sits in a row the last two steps share, so a second count of it would add one
    to a sum of terms at most one."""
    n = 1009

    def fn(x, y, v):
        logits = x @ y.T
        return jax.nn.logsumexp(logits, axis=0), jax.nn.softmax(logits, axis=0).T @ v

    with jax.enable_x64(dtype == jnp.float64):
        x, y, v = np.array(normal(0, (n, 3), dtype)), normal(1, (5, 3), dtype), normal(2, (n,), dtype)
        split = the_split(split_jit(fn, 4_000).trace(x, y, v).report)
        assert split.details["overlapping_last"] and "running maximum" in split.summary, split.summary
        x[n - split.details["chunk"]] = 4 * np.sign(np.asarray(y)[0])   # the largest logit of column 0
        check(fn, jnp.asarray(x), y, v, threshold=4_000, grad_argnums=(0, 1, 2))


@pytest.mark.parametrize("fn", [
    pytest.param(lambda x, y: jax.lax.top_k((x @ y.T).T, 3), id="top_k"),
    pytest.param(lambda x, y: jnp.argmax(x @ y.T, axis=0), id="argmax"),
    pytest.param(lambda x, y: jnp.cumsum(jnp.tanh(x @ y.T), axis=0), id="cumsum"),
])
def test_a_loop_whose_steps_depend_on_the_ones_before_keeps_its_short_step(fn):
    """Along the axis a ``top_k``, an argmax or a cumulative sum runs over (five columns of 4 kB each)."""
    x, y = normal(0, (1009, 3)), normal(1, (5, 3))
    f = split_jit(fn, 4_000)
    done = split_rewrites(f.trace(x, y).report)
    short = [r for r in done if r.details["size"] % r.details["chunk"]]
    assert short and len(short) == len(done), done
    for split in short:
        assert not split.details["overlapping_last"], split.summary
        assert f"(last {split.details['size'] % split.details['chunk']})" in split.summary
    for got, want in zip(jax.tree.leaves(f(x, y)), jax.tree.leaves(jax.jit(fn)(x, y))):
        assert_close(got, want, 1e-5, 1e-5)


def test_loops_sharing_a_product_end_alike(monkeypatch):
    """A loop that could overlap but recomputes a product that a loop ending short recomputes too (this
    round or, as recorded, an earlier one) ends short as well: the two would round its last rows
    differently. Checked on the plans of a real split, copied."""
    from hlopass.passes.split import driver
    from hlopass.passes.split.plan import harmonise_tails
    seen = []
    real = driver.harmonise_tails
    monkeypatch.setattr(driver, "harmonise_tails", lambda jaxpr, plans, *rest: (
        seen.append((jaxpr, [dataclasses.replace(p) for p in plans])), real(jaxpr, plans, *rest))[1])
    x, y, v = normal(0, (1009, 3)), normal(1, (307, 3)), normal(2, (307,))
    fresh = lambda x, y, v: kernel_stats(x, y, v)   # noqa: E731 - planned anew, not taken from the cache
    split_jit(fresh, 60_000).trace(x, y, v).report  # noqa: B018 - the report runs the passes
    jaxpr, (plan,) = seen[0]

    def tails(*plans, recorded=None):
        plans = [dataclasses.replace(p) for p in plans]
        harmonise_tails(jaxpr, plans, {} if recorded is None else recorded)
        return [p.overlap_tail for p in plans]

    assert tails(plan) == [True]
    assert tails(plan, dataclasses.replace(plan, unroll=True)) == [False, False]
    recorded: dict = {}
    assert tails(plan, recorded=recorded) == [True] and recorded and all(recorded.values())
    assert tails(plan, recorded={k: False for k in recorded}) == [False]
    harmonise_tails(jaxpr, [copy := dataclasses.replace(plan)], {}, allowed=False)
    assert not copy.overlap_tail


def test_without_the_short_step_a_gradient_needs_about_half_the_memory():
    """XLA kept the short last step's buffers beside the loop's: the kernel mat-vec's gradient at 2,003
    rows (chunk 201, last step 194 rows) took 1.91 MB of temporaries with it and 1.00 MB without
    (``compile().memory_analysis()``); the sharded memory-limit case of ``tests/core`` 1.05 -> 0.6 MB."""
    from fixtures.kernels import kernel_matvec
    grad = jax.grad(lambda x, y, v: jnp.sum(kernel_matvec(x, y, v) ** 2))
    args = normal(0, (2003, 3)), normal(1, (301, 3)), normal(2, (301,))

    def temp(overlap: bool) -> int:
        lowered = hlopass.jit(grad, threshold=800_000, passes=[SplitPass(overlap_last_step=overlap)]).lower(*args)
        (split,) = split_rewrites(lowered.report)
        assert split.details["overlapping_last"] == overlap and split.details["size"] % split.details["chunk"]
        return lowered.compile().memory_analysis().temp_size_in_bytes

    assert temp(True) < 0.75 * temp(False)
    assert_close(hlopass.jit(grad, threshold=800_000)(*args), jax.jit(grad)(*args), 2e-4, 2e-4)
