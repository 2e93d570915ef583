"""Minimal programs for the defects the differential fuzzer and JAX's own tests found.

Each test states the behaviour ``jax.jit`` has and is marked ``xfail(strict=True)`` while the defect
is open, naming its owner (split, algebraic, matrix_chain, hvp, engine): it passes CI now and fails
the day the defect is fixed, when the fixer removes the marker (and the exclusion in
``tests/fuzz/exclusions.py`` that points at it, if any).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hlopass
from tests.fuzz.runner import compare

rng = np.random.default_rng(12)


def normal(*shape, dtype=np.float32):
    return rng.normal(size=shape).astype(dtype)


def same_as_jax_jit(fn, *args, dtype="float32", rewrites=True, **settings):
    """``hlopass.jit(fn, **settings)`` gives ``jax.jit(fn)``'s values (and a rewrite fired)."""
    want = jax.device_get(jax.jit(fn)(*args))
    ours = hlopass.jit(fn, **settings)
    got = jax.device_get(ours(*args))
    if rewrites:
        assert ours.trace(*args).report.rewrites, "the program no longer exercises the pass"
    problem = compare(got, want, "output", dtype)
    assert problem is None, problem


# ---------------------------------------------------------------------------------------------- split
def test_a_product_recomputed_along_another_axis_rounds_as_the_first():
    """Fresh seed s865508411843, program 0 (float32 gradient of ``logsumexp(z, 0)``, ``z`` the square of
    ``cumsum(v) @ y.T`` through 8 layers of ``z + tanh(s_k z)``, batched): 0.2 % of the gradient's scale
    from the float64 run, where ``jax.jit`` is 1e-6 of it. The forward loop computes the product over
    3 columns of ``y`` at a time (the sum runs over rows, whole), the backward loop over 2 rows of ``x``:
    XLA:CPU's dot rounds differently for different shapes (97 and 402 of the 54k entries differ in the
    last bit from the whole product), the chain grows ``z`` to 2e4, and ``exp(z - lse)`` with ``lse``
    from the other copy is off by 0.2 % where they differ. ``harmonise_chunks`` only aligned loops cut
    along the same axis; ``plan_round`` now cuts a product's copies along one axis where it can (the
    forward loop then runs an online logsumexp over 2 rows at a time, as the backward one)."""
    k = jax.random.split(jax.random.key(0), 3)
    v = jax.random.normal(k[0], (3, 269, 4))
    y = jax.random.normal(k[1], (3, 67, 4))
    s = jax.random.uniform(k[2], (3, 8), minval=-1.0, maxval=1.0)

    def f(v, y, s):
        z = (jnp.cumsum(v, 0) @ y.T) ** 2
        for j in range(8):
            z = z + jnp.tanh(s[j] * z)
        return jax.nn.logsumexp(z, axis=0)
    loss = jax.grad(lambda v, y, s: jnp.sum(jnp.sin(jnp.arange(67.0)) * jax.vmap(f)(v, y, s)), (0, 1))
    same_as_jax_jit(loss, v, y, s, threshold=24000, split_size=24000)


def test_strided_slice_after_a_split_region():
    x = normal(43, 7)
    same_as_jax_jit(lambda x: jnp.sum(jnp.tanh(x[:, None, :] + x[None, :, :]), -1)[::2], x,
                    threshold="8kB", split_size="4000")


def test_strided_slice_inside_a_split_region_before_max():
    x, y = normal(43, 7), normal(40, 7)
    same_as_jax_jit(lambda x, y: jnp.max((x[:, None, :] + y[None])[:, ::3], axis=2), x, y, threshold="8kB")


def test_strided_slice_inside_a_split_region_before_sum():
    x, y = normal(43, 7), normal(40, 7)
    same_as_jax_jit(lambda x, y: jnp.sum((x[:, None, :] * y[None])[::2], axis=0), x, y, threshold="8kB")


def test_strided_slice_inside_a_split_region_raises():
    # fuzzer seed 0, program 9 (minimised)
    x, y = normal(83, 7), normal(167, 7)

    def fn(x, y):
        v = jnp.swapaxes(x[:, None, :] + y[None], 0, 1)[:, ::3]
        return jnp.max(v, axis=2)
    same_as_jax_jit(fn, x, y, threshold="32kB")


def test_strided_slice_of_an_input_of_a_split_region():
    # fuzzer seed 204, program 3 (minimised)
    x, y, w = normal(42, 5), normal(89, 5), normal(5)
    idx = rng.integers(0, 42, size=3).astype(np.int32)
    same_as_jax_jit(lambda x, y, w, idx: (jnp.exp(-jnp.einsum("nd,md->nmd", x, y[2::3]) ** 2) @ w)[idx],
                    x, y, w, idx, threshold=4000, split_size=1000)


@pytest.mark.parametrize("reduce", [jnp.max, jnp.min])
def test_split_max_and_min_propagate_nan(reduce):
    """A documented deviation (README, the split pass, NaN): a split max/min propagates NaN as JAX and
    NumPy document, where XLA:CPU's fused large reductions under plain ``jax.jit`` skip it."""
    x, y = normal(43, 7), normal(40, 7)
    x[3, 2] = np.nan
    fn = lambda x, y: reduce(x[:, None, :] - y[None], axis=0)  # noqa: E731
    ours = hlopass.jit(fn, threshold="8kB")
    assert ours.trace(x, y).report.rewrites
    want = np.max if reduce is jnp.max else np.min
    np.testing.assert_array_equal(np.asarray(ours(x, y)), want(x[:, None, :] - y[None], axis=0))


def test_split_top_k_and_clip_follow_jax_nan_semantics():
    """The same documented deviation for ``top_k`` (NaN ranked first) and ``clip`` (NaN kept), with the NaN
    made inside the program from Inf·0, as the fuzzer draws it (seeds 128, 145): the split follows JAX's
    documented semantics (NumPy's, below), whatever XLA:CPU's fused kernels do under plain ``jax.jit``."""
    x, y = rng.integers(-3, 4, size=(95, 3)).astype(np.float32), rng.integers(-3, 4, size=(191, 3)).astype(np.float32)
    x[7, 1], y[:, 1] = np.inf, 0.0
    fn = lambda x, y: lax.top_k(jnp.clip(x @ y.T, -1, 2), 2)[0]  # noqa: E731
    ours = hlopass.jit(fn, threshold="12kB")
    assert ours.trace(x, y).report.rewrites
    with np.errstate(invalid="ignore"):
        scores = np.clip(x.astype(np.float64) @ y.T.astype(np.float64), -1, 2)
    nans = np.isnan(scores).sum(axis=1, keepdims=True)
    want = -np.sort(-np.where(np.isnan(scores), np.inf, scores), axis=1)[:, :2]   # NaN above every number
    want[np.arange(2)[None, :] < nans] = np.nan
    np.testing.assert_array_equal(np.asarray(ours(x, y)), want.astype(np.float32))



def test_relu_of_nan_follows_the_fusion_xla_cpu_puts_it_in():
    """The same documented deviation for an elementwise ``maximum(v, 0)`` (fresh seeds r394279222309,
    r967046302204): XLA:CPU's maximum drops a NaN when it is fused into a large reduction's kernel and
    keeps it elsewhere, so which of plain ``jax.jit`` and hlopass gives NaN depends on where each puts it.
    The seed's program: ``jax.jit`` gives a number, hlopass NaN, the IEEE answer (NumPy's)."""
    from tests.fuzz import runner
    x = np.ones((310, 311), np.float32)
    x[3, 4] = np.nan
    fused = jax.jit(lambda x: jnp.sum(jnp.exp(-jnp.maximum(x, 0.0) ** 2 / 2)))(x)
    assert np.isfinite(float(fused)) and np.isnan(float(jnp.maximum(jnp.float32(np.nan), 0.0)))

    batch = runner.draw_batch("r394279222309", size=8, only=5, exclusions=False)
    program = batch.programs[0]
    inputs = program.make_inputs()
    ours = hlopass.jit(program.fn, threshold=batch.threshold, split_size=batch.split_size)
    got, want = np.asarray(ours(*inputs)[0]), np.asarray(jax.jit(program.fn)(*inputs)[0])
    assert np.isfinite(want).all() and np.isnan(got).any()


def test_split_float16_dot_accumulates_like_xla():
    xs, ys = normal(4, 60000, dtype=np.float16), normal(60000, dtype=np.float16)
    fn = lambda x, y: jnp.sin(x) @ y  # noqa: E731
    exact = np.sin(xs.astype(np.float64)) @ ys.astype(np.float64)
    ours = hlopass.jit(fn, threshold="100kB", passes="split")
    assert ours.trace(xs, ys).report.rewrites
    err_ours = np.mean(np.abs(np.asarray(ours(xs, ys), np.float64) - exact))
    err_jax = np.mean(np.abs(np.asarray(jax.jit(fn)(xs, ys), np.float64) - exact))
    assert err_ours <= 1.25 * err_jax, (err_ours, err_jax)


# ------------------------------------------------------------------------------------------ algebraic
def test_where_guard_keeps_a_nan_out_of_a_sum():
    x, y = normal(43, 7), normal(40, 7)
    x[3, 2] = np.nan

    def fn(x, y):  # the difference written twice, as jnp.nansum's expansion does with its input
        return jnp.sum(jnp.where(jnp.isnan(x[:, None, :] - y[None]), 0.0, x[:, None, :] - y[None]))
    same_as_jax_jit(fn, x, y, threshold="8kB", passes="algebraic", rewrites=False)
    skips = hlopass.jit(fn, threshold="8kB", passes="algebraic").trace(x, y).report
    assert "guards the values it drops" in str(skips)


def test_expanded_distance_keeps_infinity():
    x, y = normal(43, 7), normal(40, 7)
    x[3, 2] = np.inf
    same_as_jax_jit(lambda x, y: jnp.sum((x[:, None, :] - y[None]) ** 2, -1) @ jnp.ones(40), x, y,
                    threshold="8kB")


@pytest.mark.parametrize("offset", [0.0, 1000.0])
def test_expanded_distance_keeps_grid_ties(offset):
    """Fuzzer seed r1002380688597, programs 3 and 6: points on an integer grid have exactly tied
    distances; the centred expansion must keep them tied, so top_k picks the indices jax.jit picks."""
    grid = np.random.default_rng(3)
    x = grid.integers(-3, 4, size=(110, 7)).astype(np.float32) + offset
    y = grid.integers(-3, 4, size=(109, 7)).astype(np.float32) + offset
    fn = lambda x, y: lax.top_k(jnp.sin(jnp.sum((x[:, None, :] - y[None]) ** 2, -1)), 3)  # noqa: E731
    ours = hlopass.jit(fn, threshold="8kB")
    assert any(r.kind == "squared_distance" for r in ours.trace(x, y).report.rewrites)
    got, want = ours(x, y), jax.jit(fn)(x, y)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


def test_split_tanh_argmax_follows_xla_tanh():
    """Fuzzer seed 23: on grid points the argmax of a tanh of distances differed from jax.jit's. The cause is
    XLA:CPU's tanh, not the split: a hand-written fori_loop over the same 6-row slices gives the split's
    answer bit for bit, and differs from jax.jit of the whole program in the same rows (documented
    deviation: README, the split pass, transcendental rounding)."""
    grid = np.random.default_rng(23)
    x = grid.integers(-3, 4, size=(877, 3)).astype(np.float32)
    y = grid.integers(-3, 4, size=(439, 3)).astype(np.float32)

    def fn(x, y):
        return jnp.argmax(jnp.tanh(jnp.sum((x[:, None, :] - y[None]) ** 2, -1)), axis=1)

    def hand_loop(x, y, rows=6):
        def body(i, out):
            xr = lax.dynamic_slice_in_dim(x, i * rows, rows)
            v = jnp.tanh(sum((xr[:, None, j] - y[None, :, j]) ** 2 for j in range(x.shape[1])))
            return lax.dynamic_update_slice_in_dim(out, jnp.argmax(v, 1).astype(jnp.int32), i * rows, 0)
        return lax.fori_loop(0, x.shape[0] // rows, body, jnp.zeros(x.shape[0], jnp.int32))

    ours = hlopass.jit(fn, threshold=256000, split_size=32000, passes="split")
    [split] = [r for r in ours.trace(x, y).report.rewrites if r.kind == "split"]
    assert split.details["chunk"] == 6
    got, hand, whole = (np.asarray(a)[:876] for a in (ours(x, y), jax.jit(hand_loop)(x, y), jax.jit(fn)(x, y)))
    np.testing.assert_array_equal(got, hand)
    assert np.array_equal(np.nonzero(hand != whole)[0], np.nonzero(got != whole)[0])
    rounded = np.tanh(np.float64(8.0)).astype(np.float32)  # 0.99999976, correctly rounded
    assert float(jax.jit(jnp.tanh)(np.float32(8.0))) == 1.0 != float(rounded)  # XLA's tanh alone: 2 ulp off



def test_split_softmax_of_a_cube_follows_xla_fma_contraction():
    """Fuzzer seed r507440854637, program 3 (float32, a softmax of cubed squared distances, value and
    gradient): one softmax weight came out 1.0038 where jax.jit gives 1. The cause is XLA:CPU, not the
    split: inside one fusion it contracts ``v*v*v - max`` into a fused multiply-add, so the difference
    is taken from the unrounded cube while the max was taken from the rounded one, and at logits near
    87,000 (float32 step 0.0078) that is a factor exp(0.0038) on the weight. The split's loop body
    put the cube and the subtraction in one fusion (documented deviation: README, the split pass,
    Fused multiply-add)."""
    from tests.fuzz import runner
    v = np.float32(44.363678)
    rounded = np.float32(v * v * v)                    # the cube rounded to float32, as a max would hold it
    contracted = float(jax.jit(lambda v, c: v * v * v - c)(np.full(64, v), np.full(64, rounded))[0])
    fused = float(np.float64(np.float32(v * v)) * np.float64(v) - np.float64(rounded))  # (v*v)*v - c, one rounding
    assert contracted == pytest.approx(fused, abs=1e-6) and contracted != 0.0           # XLA:CPU contracts

    x, y, w = runner.draw_batch("r507440854637", only=3, exclusions=False).programs[0].make_inputs()

    def fn(x, y, w):
        s = jax.nn.softmax(jnp.sum((x[1::2][:, None] - y[None]) ** 2, -1) ** 3, -1)
        return jnp.sum((s @ w) * jnp.arange(48.0)), s

    grad = jax.value_and_grad(fn, argnums=(0, 1, 2), has_aux=True)
    ours = hlopass.jit(grad, threshold=24000, split_size=24000, passes=["algebraic", "split"])
    (_, got), _ = ours(x, y, w)
    (_, want), _ = jax.jit(grad)(x, y, w)
    assert np.asarray(want)[8].max() == 1.0
    xs = np.float64(x[1::2][8])
    v68 = np.float32(sum(np.float32((np.float32(xs[j]) - y[68, j]) ** 2) for j in range(5)))
    cube = np.float64(np.float32(v68 * v68)) * np.float64(v68)
    factor = np.exp(cube - np.float32(cube))        # exp(the contracted cube - the max, the rounded cube)
    weight = float(np.asarray(got)[8, 68])
    # the loop body that subtracts the maximum rounds the cube first (1) or contracts it (the factor),
    # as the fusion falls; the seed's program, at the commit that found it, did the latter
    assert 1e-3 < abs(factor - 1.0) and (weight == 1.0 or abs(weight - factor) < 1e-3), weight


@pytest.mark.xfail(strict=True, reason="split (open): a softmax of a cube of a cube on the grid gets NaN rows "
                   "(round 20's soak, docs/testing.md)")
def test_split_softmax_of_a_cubed_cube_keeps_jax_jits_finite_rows():
    """Fresh seed s732710748375, program 5 (round 20's soak): ``softmax(v, -1) @ w - v[:, 0]`` of
    ``((x @ y.T) ** 3) ** 3`` on the grid (logits to 2e11, no overflow), a row maximum before it.
    ``jax.jit`` is finite; the split's second loop (``exp(v - max)`` of each recomputed column, times
    ``w``) gives NaN in 14 rows when XLA runs it as one scan, not when its body runs step by step: a
    column rounded above the maximum the first loop took (one float32 step is 16,384 there, and
    XLA:CPU contracts products with the subtraction, as in the test above) overflows ``exp``, and
    ``inf * 0`` is NaN."""
    from tests.fuzz import runner
    batch = runner.draw_batch("s732710748375", size=8, only=5, exclusions=False)
    got, want, *_ = runner.execute(batch)
    got, want = np.asarray(got[0]), np.asarray(want[0])
    assert np.isfinite(want).all()
    assert not (np.isnan(got) & ~np.isnan(want)).any()


def test_split_logsumexp_of_a_cube_rounds_as_chunked_by_hand():
    """Fresh seed r310525650708, program 1 (float32 ``logsumexp((sum(x,1)[:,None] * sum(y,1)[None]) ** 3,
    axis=0)``, value and gradient of a linear functional, 64 kB threshold): the gradient is 1.5 % of its
    scale from the float64 run where jax.jit is 1e-7. The logits reach 417,000 (float32 step 0.03): the
    split recomputes the cube in column chunks in a second loop, and exp(cube - lse) there rounds as the
    same two loops written by hand in plain JAX round (documented deviation: README, the split pass,
    Fused multiply-add). The difference follows the logits' step: at half the inputs (logits / 64) it is
    60 times smaller."""
    from jax import lax
    from tests.fuzz import runner
    batch = runner.draw_batch("r310525650708", only=1, exclusions=False)
    program = batch.programs[0]
    x, y, *rest = program.make_inputs()
    n, m, chunk = x.shape[0], y.shape[0], 48
    g = np.cos(np.arange(2 * m, dtype=np.float32))
    g = g[:m] - g[m:]

    def whole(x, y):
        f = lambda x, y: jnp.sum(g * jax.nn.logsumexp((x.sum(1)[:, None] * y.sum(1)[None]) ** 3, 0))  # noqa: E731
        return jax.grad(f, (0, 1))(x, y)

    def by_hand(x, y):  # the split's two loops over chunks of 48 columns, written in plain JAX
        sx, sy = x.sum(1), y.sum(1)
        pad = (-m) % chunk
        syp, gp, steps = jnp.pad(sy, (0, pad)), jnp.pad(g, (0, pad)), (m + pad) // chunk

        def forward(k, acc):
            c = lax.dynamic_slice_in_dim(syp, k * chunk, chunk)
            logits = (sx[:, None] * c[None]) ** 3
            top = jnp.max(logits, 0)
            return lax.dynamic_update_slice_in_dim(acc, jnp.log(jnp.sum(jnp.exp(logits - top), 0)) + top,
                                                   k * chunk, 0)
        lse = lax.fori_loop(0, steps, forward, jnp.zeros(m + pad, x.dtype))

        def backward(k, acc):
            dsx, dsy = acc
            c, gc, lc = (lax.dynamic_slice_in_dim(v, k * chunk, chunk) for v in (syp, gp, lse))
            a = sx[:, None] * c[None]
            da = 3 * a * a * jnp.exp(a ** 3 - lc[None]) * gc[None]
            return dsx + jnp.sum(da * c[None], 1), lax.dynamic_update_slice_in_dim(dsy, jnp.sum(da * sx[:, None], 0),
                                                                                   k * chunk, 0)
        dsx, dsy = lax.fori_loop(0, steps, backward, (jnp.zeros(n, x.dtype), jnp.zeros(m + pad, x.dtype)))
        return jnp.broadcast_to(dsx[:, None], x.shape), jnp.broadcast_to(dsy[:m, None], y.shape)

    def errors(x, y):
        with jax.enable_x64(True):
            exact = [np.asarray(e) for e in jax.jit(whole)(x.astype(np.float64), y.astype(np.float64))]
        hand, plain = jax.jit(by_hand)(x, y), jax.jit(whole)(x, y)
        ours = hlopass.jit(program.fn, threshold=batch.threshold, split_size=batch.split_size)(x, y, *rest)
        ours = jax.tree.leaves(ours)[1:3]
        rel = lambda got, e: float(np.max(np.abs(np.asarray(got, np.float64) - e)) / np.max(np.abs(e)))  # noqa: E731
        return ([rel(a, e) for a, e in zip(ours, exact)], [rel(a, e) for a, e in zip(hand, exact)],
                [rel(a, e) for a, e in zip(plain, exact)])

    ours, hand, plain = errors(x, y)
    assert max(plain) < 1e-5
    for o, h in zip(ours, hand):
        assert 5e-3 < o < 5e-2 and 5e-3 < h < 5e-2 and 1 / 4 < o / h < 4, (ours, hand)
    half, _, _ = errors(x / 2, y / 2)
    assert max(half) < max(ours) / 20, (half, ours)


def _squared_softmax_case():
    """Fresh seed r73655148886, program 6: float32 ``softmax((cumsum(x) @ y.T) ** 2) @ w`` (logits up to
    35,000, float32 step 0.004), its gradient through a loss that masks non-finite outputs."""
    from tests.fuzz import runner
    x, y, w = runner.draw_batch("r73655148886", only=6, exclusions=False).programs[0].make_inputs()
    c = np.cos(np.arange(311)).astype(np.float32)

    def rows_loss(d, y, w, c):
        v = d @ y.T
        out = jax.nn.softmax(v * v, -1) @ w
        return jnp.sum(jnp.where(jnp.isfinite(out), out, 0) * c)

    def grad(x, y, w):
        return jax.grad(lambda x, y, w: rows_loss(jnp.cumsum(x, 0), y, w, c), (0, 1, 2))(x, y, w)
    with jax.enable_x64(True):
        truth = jax.jit(grad)(*[a.astype(np.float64) for a in (x, y, w)])

    def off(result):
        return [float(np.abs(np.asarray(r, np.float64) - np.asarray(t)).max() / np.abs(np.asarray(t)).max())
                for r, t in zip(result, truth)]
    return (x, y, w), c, rows_loss, grad, off


def test_loops_recomputing_one_product_use_one_chunk():
    """Fresh seed r73655148886 at a 4 kB split size: five loops recompute the logits, the online one
    (the softmax's maximum and sum) one column per step, the others three. XLA:CPU's dot rounds a
    one-column product otherwise than a three-column one, so the probabilities, normalised in one
    loop and exponentiated in another, no longer summed to one: gradients 25 and 130 times their scale
    off. Two fixes: loops that recompute one ``dot_general`` use one chunk (``harmonise_chunks``), and
    a cumulative op is computed once, never copied into a loop per stage (``recompute._cone``)."""
    args, _, _, grad, off = _squared_softmax_case()
    ours = hlopass.jit(grad, threshold=128000, split_size=4000)
    report = ours.trace(*args).report
    steps = {int(r.summary.split(" iterations of ")[1].split(",")[0].split(" ")[0])
             for r in report.rewrites if r.kind == "split" and "of f32[311,311]" in r.summary}
    assert len(steps) == 1, report
    assert max(off(ours(*args))) < 5e-3
    assert max(off(jax.jit(grad)(*args))) < 1e-3


def test_split_softmax_of_squared_logits_rounds_as_chunked_by_hand():
    """The same program at a 16 kB split size: one loop of four rows per step, whose gradient is 2.3e-3
    of its scale from the float64 run where jax.jit's is 3.5e-4. The same rows, four at a time, by hand
    in plain JAX give the same: XLA:CPU rounds the four-row product and its fusions otherwise than the
    whole, and logits in the tens of thousands amplify it (documented deviation: README, the split
    pass, Fused multiply-add; the fuzzer redraws a square feeding a softmax off the grid)."""
    args, c, rows_loss, grad, off = _squared_softmax_case()

    def by_hand(x, y, w, width=4):
        d = jnp.cumsum(x, 0)
        parts, gy, gw = [], jnp.zeros_like(y), jnp.zeros_like(w)
        for s in range(0, 311, width):
            a, b, cw = jax.grad(rows_loss, (0, 1, 2))(d[s:s + width], y, w, c[s:s + width])
            parts, gy, gw = parts + [a], gy + b, gw + cw
        return jnp.cumsum(jnp.concatenate(parts)[::-1], 0)[::-1], gy, gw

    ours = off(hlopass.jit(grad, threshold=128000, split_size=16000)(*args))
    hand = off(jax.jit(by_hand)(*args))
    plain = off(jax.jit(grad)(*args))
    assert max(hand) > 3 * max(plain)                      # the chunking, not hlopass, rounds so
    for mine, theirs in zip(ours, hand):
        assert mine <= 1.5 * theirs + 1e-6


def test_clamped_distance_keeps_a_nan_through_a_fused_sum():
    """Fresh seed r1093874309472, program 7: the sum of cubed squared distances of points with a NaN
    coordinate was a number under hlopass, NaN under jax.jit. The expanded distance was clamped at zero
    with a maximum, and XLA:CPU's fused maximum before a large sum drops NaN (``jax.jit`` of
    ``sum(maximum(x, 0) ** 3)`` gives a number for an ``x`` holding a NaN); the clamp is now t + max(-t, 0)."""
    x, y = normal(89, 3), normal(90, 3)
    x[31, 1] = np.nan
    fn = lambda x, y: jnp.sum(jnp.sum((x[::-1][:, None] - y[None]) ** 2, -1) ** 3)  # noqa: E731
    ours = hlopass.jit(fn, threshold=64000, split_size=16000)
    assert [r.kind for r in ours.trace(x, y).report.rewrites] == ["squared_distance"]
    assert np.isnan(float(jax.jit(fn)(x, y))) and np.isnan(float(ours(x, y)))
    finite = np.nan_to_num(x)
    np.testing.assert_allclose(float(ours(finite, y)), float(jax.jit(fn)(finite, y)), rtol=1e-4)


@pytest.mark.parametrize("rows", [60, 226])
def test_softmax_returned_along_its_only_splittable_axis(rows):
    """Fresh seed r523754279801, program 1: ``softmax(((x[:, None] - y[None]) @ w)[::3], -1)`` came out
    one-hot (1.0 where jax.jit gives 0.015). The strided rows left only the softmax axis to split, the
    online softmax carried a running maximum, and ``exp(x - m)`` of each slice, shifted by the maximum
    *so far*, was written out as the program's result: a program output was not counted as leaving
    the loop. Such a region is not online now: the running maximum and sum get a loop of their own,
    and the probabilities are computed from their final values."""
    x, y, w = normal(rows, 2), normal(223, 2), normal(2)
    fn = lambda x, y, w: jax.nn.softmax(((x[:, None] - y[None]) @ w)[::3], -1)  # noqa: E731
    ours = hlopass.jit(fn, threshold=32000, split_size=4000, passes="split")
    splits = [r for r in ours.trace(x, y, w).report.rewrites if r.kind == "split"]
    assert splits and all(r.details["axis"] == 1 for r in splits)
    np.testing.assert_allclose(np.asarray(ours(x, y, w)), np.asarray(jax.jit(fn)(x, y, w)), rtol=1e-5, atol=1e-7)


def test_split_bfloat16_cumsum_carries_its_running_total_in_float32():
    """Fresh seed r198898401976, program 6 (bfloat16, ``cumsum`` of a softmax-weighted sum, under
    ``jax.vmap``): split one row per step, the running total was carried in bfloat16, and once it
    reached 32 (step 0.25) the small terms were lost: 16.6 where the float32 run gives 42 and jax.jit
    42.0. The total is now carried in float32, as XLA accumulates one ``cumsum``."""
    from tests.fuzz import runner
    batch = runner.draw_batch("r198898401976", size=8, only=6, exclusions=False)
    assert batch.programs[0].has("post:cumsum") or "cumsum" in batch.programs[0].description
    result = runner.check_batch(batch)
    assert result["rewrites"]["split:split"] >= 1
    assert not result["failures"], result["failures"]

def test_split_bfloat16_cumsum_runs_in_float32_within_each_slice():
    """Fresh seed r660789466657, program 4 (bfloat16 grid products, ``cumsum`` along rows to 1,344, then
    ``argmin`` down the columns): split 27 columns per step, each slice's own ``cumsum`` ran in bfloat16
    before the float32 running total was added, and 5 of 188 indices differed from the float32 run,
    where jax.jit's differ in none. The slice's cumulative sum now runs in float32 too."""
    rng = np.random.default_rng(0)
    a = rng.integers(-3, 4, (191, 7)).astype(jnp.bfloat16)
    b = rng.integers(-3, 4, (188, 7)).astype(jnp.bfloat16)
    fn = lambda a, b: jnp.argmin(jnp.cumsum(jnp.sum(a, 1)[:, None] * jnp.sum(b, 1)[None], -1), 0)  # noqa: E731
    ours = hlopass.jit(fn, threshold=24000, split_size=24000)
    assert ours.trace(a, b).report.rewrites
    wide = np.asarray(jax.jit(fn)(a.astype(np.float32), b.astype(np.float32)))
    assert np.sum(np.asarray(ours(a, b)) != wide) <= np.sum(np.asarray(jax.jit(fn)(a, b)) != wide)
    from tests.fuzz import runner
    result = runner.check_batch(runner.draw_batch("r660789466657", size=8, only=4))
    assert result["rewrites"]["split:split"] >= 1 and not result["failures"], result["failures"]


def test_split_bfloat16_cumlogsumexp_carries_its_running_total_in_float32():
    """Soak seed s330764461165, program 7 (bfloat16, ``cumlogsumexp`` down the rows of
    ``sin(x[:, None] - y[None])``, then summed along the rows, under ``jax.vmap``): split one row per
    step, the running log-sum-exp was carried in bfloat16; past a few dozen rows each row adds less
    than half its ulp, so it stopped growing: 125 from the float32 run where jax.jit is 6.7. It is
    carried (and each slice's own ``cumlogsumexp`` runs) in float32 now, as for a ``cumsum``."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=219) * 2, jnp.bfloat16)
    y = jnp.asarray(rng.normal(size=220) * 2, jnp.bfloat16)

    def fn(x, y):
        return jnp.sum(lax.cumlogsumexp(jnp.sin(x[:, None] - y[None]), axis=0), axis=1)

    ours = hlopass.jit(fn, threshold=8000, split_size=2000)
    assert any(r.kind == "split" for r in ours.trace(x, y).report.rewrites)
    wide = np.asarray(jax.jit(fn)(x.astype(np.float32), y.astype(np.float32)))
    ours_error = np.max(np.abs(np.asarray(ours(x, y), np.float32) - wide))
    jit_error = np.max(np.abs(np.asarray(jax.jit(fn)(x, y), np.float32) - wide))
    assert ours_error <= 2 * jit_error + 1.0, (ours_error, jit_error)


def test_expanded_distance_with_inf_and_nan_then_products():
    """Fuzzer seed 9, program 6: the expanded distance's non-finite entries, then products, were NaN
    where plain gives ±Inf; the finite guard reruns the written program for them."""
    x, y = normal(223, 4), normal(863, 4)
    w, big_w = normal(863), normal(863, 3)
    x[5, 1], x[17, 2], x[40, 0] = np.inf, -np.inf, np.nan
    fn = lambda x, y, w, big_w: (jnp.sum((x[:, None, :] - y[None]) ** 2, -1) * w[None, :]) @ big_w  # noqa: E731
    ours = hlopass.jit(fn, threshold=64000, split_size=32000)
    assert ours.trace(x, y, w, big_w).report.rewrites
    got, want = np.asarray(ours(x, y, w, big_w)), np.asarray(jax.jit(fn)(x, y, w, big_w))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))


# --------------------------------------------------------------------------------------- matrix_chain
def test_chain_with_an_infinity_keeps_nan_where_plain_has_it():
    """Fuzzer seeds 9 and 40: inf - inf in one order, ±inf in the other; the finite guard reruns the
    chain as written when the reordered result is not finite."""
    x, y, w = normal(30, 5), normal(40, 5), normal(40, 3)
    x[0, 0] = np.inf
    # the written x @ y.T (4.8 kB) is over the threshold, so split bounds it in the guard's branch
    ours = hlopass.jit(lambda x, y, w: (x @ y.T) @ w, threshold="2kB")
    assert [r.details["finite_guard"] for r in ours.trace(x, y, w).report.rewrites
            if r.pass_name == "matrix_chain"] == [True]
    got, want = np.asarray(ours(x, y, w)), np.asarray(jax.jit(lambda x, y, w: (x @ y.T) @ w)(x, y, w))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))


def test_iota_equality_mask_on_a_non_square_tensor():
    # fuzzer seed 2, program 24 (minimised)
    x, y = normal(50, 1), normal(30, 1)

    def fn(x, y):
        v = x * y[:, 0][None]
        eye = lax.broadcasted_iota(jnp.int32, v.shape, 0) == lax.broadcasted_iota(jnp.int32, v.shape, 1)
        return jnp.sum(jnp.where(eye, 0.0, v), 1)
    same_as_jax_jit(fn, x, y, threshold="1kB")


# --------------------------------------------------------------------------------------- matrix_chain
def test_chain_with_a_widening_cast_under_strict_promotion():
    a, b, v = normal(30, 30), normal(30, 30, dtype=np.float16), normal(30)
    with jax.numpy_dtype_promotion("strict"):
        same_as_jax_jit(lambda a, b, v: (a @ b.astype(jnp.float32)) @ v, a, b, v, threshold="8",
                        passes="matrix_chain")


# ---------------------------------------------------------------------------------------------- remat
@pytest.mark.parametrize("op", [lax.cummax, lax.cummin, lax.cumprod, lax.cumlogsumexp])
def test_remat_before_linearize_of_a_cumulative_op(op):
    """Fresh seed s999306329950, program 5, found by the soak (grad_out under a memory limit of the
    arguments and results plus 0.75 of jax.jit's temporaries), minimised to ``top_k(cummax(x[:, None] -
    y[None], 0), 1)[0][::2]`` and by hand to this: ``jax.grad`` of a hlopass function holding a cumulative
    max, min, product or logsumexp, over its memory limit. The ``remat`` pass's ``before_linearize`` raises
    ``TypeError: unhashable type: 'Literal'`` (with ``HLOPASS_RAISE_PASS_ERRORS`` unset it is skipped and
    the gradient is right): a residual of those linearisations is a constant, a ``Literal``, which
    ``_residuals`` put in a set. Fixed; the pass runs and the gradient equals ``jax.jit``'s.
    CI's fresh seeds found the same error on other programs of ``grad_out`` batches under a memory limit:
    s589597145269 program 6 (``x @ y.T``, ``swapaxes``, ``@ w`` inside the fuzzer's ``custom_jvp``) and
    s534661316967 program 4 (``cumsum`` along rows, ``sin``, ``sum`` under a ``fori_loop``). ``grad_out``
    batches still draw no memory limit (``runner.MEMORY_LIMIT_MODES``) until the fixed frontier seeds are
    run again with one."""
    x = (np.arange(32, dtype=np.float32)[:, None] % 7) - 3
    y = (np.arange(125, dtype=np.float32)[:, None] % 5) - 2
    fn = lambda x, y: op(x - y.T, axis=0)  # noqa: E731

    def grad(f):
        return jax.jit(jax.grad(lambda x, y: jnp.sum(jnp.sin(f(x, y))), (0, 1)))
    got = grad(hlopass.jit(fn, memory_limit=1000, passes="remat"))(x, y)
    want = grad(fn)(x, y)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------- engine
@pytest.mark.parametrize("passes", ["split", "matrix_chain", "algebraic"])
def test_linalg_solve_passes_through(passes):
    a, b = normal(6, 6) + 6 * np.eye(6, dtype=np.float32), normal(6, 3)
    same_as_jax_jit(lambda a, b: jnp.linalg.solve(a, b) @ b.T @ b, a, b, threshold="8", passes=passes,
                    rewrites=False)


def test_token_argument_passes_through():
    x = normal(6, 3)
    fn = lambda t, x: (t, jnp.sum(x[:, None] * x[None]))  # noqa: E731
    ours = hlopass.jit(fn, threshold="8")
    assert ours.trace(lax.create_token(), x).report.rewrites  # the passes ran on it (a token is no shape)
    out = ours(lax.create_token(), x)
    np.testing.assert_allclose(out[1], jax.jit(fn)(lax.create_token(), x)[1], rtol=1e-6)


def test_call_under_disable_jit():
    f = hlopass.jit(lambda x: jnp.sum(jnp.sin(x)))
    with jax.disable_jit():
        assert np.isclose(f(jnp.ones(5)), 5 * np.sin(1.0))


def test_grad_of_a_hlopass_function_traces_once():
    f = hlopass.jit(lambda x: jnp.sum(jnp.sin(x)))
    grad = jax.grad(f)
    for _ in range(3):
        grad(jnp.ones(5))
    assert f.trace_count == 1


def test_calls_inside_an_outer_jit_trace_once():
    f = hlopass.jit(lambda x: jnp.sum(jnp.sin(x)))
    jax.jit(lambda x: sum(f(x * i) for i in range(5)))(jnp.ones(5))
    assert f.trace_count == 1


def test_bad_static_argnums_are_rejected_at_decoration():
    with pytest.raises(ValueError):
        jax.jit(lambda x: x, static_argnums=(5,))
    with pytest.raises(ValueError):
        hlopass.jit(lambda x: x, static_argnums=(5,))


def test_threshold_zero_error_names_the_setting_and_value():
    with pytest.raises(hlopass.ConfigError) as err:
        hlopass.jit(lambda x: x, threshold=0)
    assert "object object" not in str(err.value)


def test_nested_split_of_a_sliced_loop_input_terminates():
    """Fuzzer seed r884065875121, program 4: at a 2 kB split size no single axis of the f32[79,76,7]
    differences fits, so each step was split again inside, and each nested step again, cycling through
    the axes (each level re-slicing the whole loop input) until Python's recursion limit. Nesting now
    stops at ``MAX_NESTING`` levels; the numbers equal jax.jit's."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(79, 7)).astype(np.float32)
    y = rng.normal(size=(76, 7)).astype(np.float32)
    w = rng.normal(size=(79,)).astype(np.float32)

    def fn(x, y, w):
        out = jnp.tensordot(w, jnp.sum(jnp.abs(x[:, None] - y[None]), -1), axes=(0, 0))
        return lax.top_k(out, 2)[0]

    ours = hlopass.jit(fn, threshold="16000", split_size="2000", passes="matrix_chain,split")
    assert any(r.details.get("nested") for r in ours.trace(x, y, w).report.rewrites if r.kind == "split")
    np.testing.assert_allclose(ours(x, y, w), jax.jit(fn)(x, y, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reverse", [True, False])
def test_a_slice_of_a_cumulative_op_is_not_narrowed_along_its_axis(reverse):
    """Fresh seed s526135303789, program 4 (vmap_in): the split pass's narrowing computed row 0 of
    ``top_k(cumsum(..., axis=1, reverse=True))`` from row 0 of the cumsum's operand alone, though
    that row of a reversed cumulative sum adds every row after it (hlopass 0.84 where jax.jit gave
    48.2). A cumulative op's scanned axis now stops the narrowing; the numbers equal jax.jit's."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 63)).astype(np.float32)
    y = rng.normal(size=(2, 254)).astype(np.float32)

    def fn(x, y):
        z = jnp.swapaxes(jnp.sin(x[:, :, None] - y[:, None, :]), 1, 2)   # [2, 254, 63]
        c = lax.cumsum(z, axis=1, reverse=reverse)
        return c.at[:, 2].set(c[:, 0])

    ours = hlopass.jit(fn, threshold="64000", split_size="16000", passes="split")
    report = ours.trace(x, y).report
    assert not any(r.kind == "narrowed" for r in report.rewrites), report
    np.testing.assert_allclose(ours(x, y), jax.jit(fn)(x, y), rtol=1e-4, atol=1e-4)


def test_hvp_hoists_an_integer_index_batched_by_an_outer_vmap():
    """Soak seed s213490826529, program 0 (``sharded_grad``): a gradient taken inside a hlopass
    function, of a loss indexing with an integer array batched by an outer ``vmap``, raised
    UnexpectedTracerError: ``jax.closure_convert`` hoists only values that may carry a tangent, so the
    index stayed in the hvp pass's custom rule and was read after its trace ended. Every traced value
    the loss closes over is hoisted now; values and gradients equal jax.jit's."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(3, 17)).astype(np.float32)
    idx = rng.integers(0, 17, size=(3, 4)).astype(np.int32)

    def fn(x, idx):
        value, g = jax.value_and_grad(lambda x: jnp.sum(jnp.sin(x[idx]) ** 2))(x)
        return value + jnp.sum(g * x)

    def total(program):
        return lambda x, idx: jnp.sum(jax.vmap(program)(x, idx))

    ours = hlopass.jit(jax.value_and_grad(total(fn)))
    want = jax.jit(jax.value_and_grad(total(fn)))
    assert any(r.kind == "fwdrev_hvp" for r in ours.trace(x, idx).report.rewrites)
    got_value, got_grad = ours(x, idx)
    want_value, want_grad = want(x, idx)
    np.testing.assert_allclose(got_value, want_value, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_grad, want_grad, rtol=1e-5, atol=1e-5)


def test_split_leaves_a_bfloat16_short_reduction_whole():
    """Soak seed s311035862363, program 7 (bfloat16 ``softmax(softplus(3 * sum((x[:, None] - y[None])
    ** 2, -1)) @ w)``, ``x`` a cumulative sum): inside each split step the sum over 3 coordinates was
    unrolled into 3 rounded terms, where XLA:CPU evaluates the fused ``jnp.sum`` region in float32 and
    rounds once; a logit came out 1.5 ulp off (70144 where the float32 run gives 70906 and jax.jit
    70656) and the softmax flipped (0.5 against 1). Writing the three terms out by hand in plain JAX
    gives the same 70144; regions holding 16-bit floats are no longer unrolled. Each step now gives,
    bit for bit, what ``jax.jit`` gives on the same rows by hand (XLA's bfloat16 rounding depends on
    the shape; the last step is a whole chunk ending at the last row, overlapping the one before, by hand
    too: a 7-row step was further from the float32 run than the whole)."""
    rng = np.random.default_rng(5)
    x = jnp.cumsum(jnp.asarray(rng.normal(size=(439, 3)), jnp.bfloat16), axis=0, dtype=jnp.bfloat16)
    y = jnp.asarray(rng.normal(size=(219, 3)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=219), jnp.bfloat16)

    def logits(x, y, w):
        return jax.nn.softplus(3 * jnp.sum((x[:, None, :] - y[None]) ** 2, -1)) @ w

    ours = hlopass.jit(logits, threshold=64000, split_size=64000)
    rewrites = ours.trace(x, y, w).report.rewrites
    assert "unrolled" not in [r.kind for r in rewrites]
    (split,) = [r for r in rewrites if r.kind == "split"]
    rows = split.details["chunk"]
    assert 439 % rows and split.details["overlapping_last"], split.summary
    last = 439 - rows
    steps = [jax.jit(logits)(x[i:i + rows], y, w) for i in range(0, last, rows)]
    by_hand = jnp.concatenate([*steps, jax.jit(logits)(x[last:], y, w)[len(steps) * rows - last:]])
    np.testing.assert_array_equal(np.asarray(ours(x, y, w)), np.asarray(by_hand))


def test_split_float32_running_sum_rounds_as_the_same_chunks_by_hand():
    """Soak seed s1069745172457, program 3 (float32 ``(x[:, None] - v[0::3][None]) @ w``, ``d = 1``,
    gradient under ``jax.grad`` of the hlopass function): the transposed program sums 128,334 terms of
    magnitudes adding to about 9e4 into ``dw`` = -0.0518; the split adds 34 chunks of 13 rows into a
    running float32 total, 8.9e-5 from the float64 run where ``jax.jit``'s single reduction is 7.8e-6
    from it. A documented deviation: the same chunks summed by hand in plain JAX (a ``fori_loop`` over
    13-row slices, the last one ending at the last row with the rows it shares with the one before
    left out of the one before) give the same value bit for bit."""
    from . import runner
    batch = runner.draw_batch("s1069745172457", size=8, only=3)
    (program,) = batch.programs
    args = program.make_inputs(())
    settings = dict(threshold=batch.threshold, split_size=batch.split_size)
    ours = jax.jit(runner._value_and_grad(hlopass.jit(program.fn, **settings), [0, 1, 2]))
    dw = float(ours(*args)[1][2][0])
    with jax.enable_x64(True):
        exact = float(jax.jit(runner._value_and_grad(program.fn, [0, 1, 2]))(
            *[a.astype(np.float64) for a in args])[1][2][0])

    x, v, _ = args
    d = x[:, None, 0] - v[None, 0::3, 0]                                   # (438, 293)
    ct = jnp.cos(jnp.arange(d.size, dtype=jnp.float32)).reshape(d.shape)   # the fuzzer's linear loss
    (rows,) = {r.details["chunk"] for report in hlopass.reports(ours, *args) for p in report.passes
               for r in p.rewrites if r.kind == "split"}

    def by_hand(d, ct):
        last = d.shape[0] - rows

        def body(k, total):
            start = jnp.minimum(k * rows, last)
            keep = ((start + jnp.arange(rows) < last) | (start == last))[:, None]
            return total + jnp.tensordot(jnp.where(keep, lax.dynamic_slice_in_dim(ct, start, rows), 0),
                                         jnp.where(keep, lax.dynamic_slice_in_dim(d, start, rows), 0), 2)
        assert d.shape[0] % rows
        return lax.fori_loop(0, -(-d.shape[0] // rows), body, jnp.zeros((), jnp.float32))

    assert dw == float(jax.jit(by_hand)(d, ct))
    assert abs(dw - exact) > 5e-5 > abs(float(jax.jit(lambda d, ct: jnp.tensordot(ct, d, 2))(d, ct)) - exact)


def test_float16_softmax_of_squared_logits_overflows_in_xla_fusions():
    """Fresh seed s169357533700, program 1 (float16 ``softmax(D*D, -1) @ w - (D*D)[:, 0]`` of squared
    distances of a prefix sum; on 4 devices, and on one as here): NaN in rows where ``jax.jit`` has
    numbers and numbers where it has NaN, on the machine of round 12. The cause is XLA:CPU: in the
    fusion that computes ``exp(D*D - max)`` it kept the float16 product unrounded while the row maximum
    held it rounded (float16's step is 32 at 34,816), so where the maximum rounded down by more than 11,
    ``exp`` overflowed float16 and the row turned NaN: ``jax.jit`` did so by itself (its row 21, finite
    op by op). The algebraic pass computes the distances by the expansion in float32 and rounds once, so
    they differ from ``jax.jit``'s in the last bit and other rows crossed the line (row 22). How XLA:CPU
    fuses depends on the machine (on round 14's, ``jax.jit`` and hlopass have NaN in the same rows), so
    what is checked holds on any: the program hlopass emits, evaluated op by op, overflows exactly where
    the program as written does, and every row where hlopass's compiled result and ``jax.jit``'s differ
    in NaN is one where a compiled program differs from its own op-by-op evaluation (documented
    deviation: docs, the algebraic pass, float16)."""
    from tests.fuzz import runner
    from hlopass import internals as jx
    batch = runner.draw_batch("s169357533700", only=1, devices=4, exclusions=False)
    fn, _ = runner._combined(batch.programs)
    v, w, x = batch.programs[0].make_inputs(())

    ours = hlopass.jit(fn, threshold=batch.threshold, split_size=batch.split_size, passes="algebraic")
    traced = ours.trace(v, w, x)
    assert [r.kind for r in traced.report.rewrites] == ["squared_distance"]
    rewritten = traced.rewritten_jaxpr
    emitted = np.asarray(jx.eval_jaxpr(rewritten.jaxpr, rewritten.consts, v, w, x)[0], np.float32)
    got = np.asarray(jax.tree.leaves(ours(v, w, x))[0], np.float32)
    plain = np.asarray(jax.tree.leaves(jax.jit(fn)(v, w, x))[0], np.float32)
    with jax.disable_jit():
        written = np.asarray(jax.tree.leaves(fn(v, w, x))[0], np.float32)
    # op by op, the emitted program overflows where the program as written does (the later rows, where
    # the prefix sums grow past float16's range) and agrees with it elsewhere
    assert np.isnan(written).any()
    np.testing.assert_array_equal(np.isnan(emitted), np.isnan(written))
    finite = np.isfinite(written)
    np.testing.assert_allclose(emitted[finite], written[finite], rtol=4e-3, atol=4e-3 * np.abs(written[finite]).max())
    # compiled, they differ only where XLA's fusion differs from the op-by-op evaluation
    disagree = np.isnan(got) != np.isnan(plain)
    by_fusion = (np.isnan(plain) != np.isnan(written)) | (np.isnan(got) != np.isnan(emitted))
    assert not np.any(disagree & ~by_fusion)


def test_a_sum_recomputed_for_a_later_stage_rounds_as_its_first_copy():
    """Fresh seed s1040642467927, program 2 (float32 gradient of ``softmax(sum((x[:,None] + y[None])**4,
    0), -1)``, split size 1.5 kB): hlopass's gradient was 0.4 % of its scale from the float64 run where
    jax.jit's is 6e-6. The row sums ``k`` (1.8 kB, over the split size) are read by the softmax's max
    and, a stage later, by ``k - max``; the split recomputed ``k`` for the second stage in a loop
    accumulating over the summed axis, while the first loop summed it whole, so ``exp(k - max k)`` at
    the maximum was ``exp(±1 step of 8,000)`` instead of 1. A value is now recomputed only where every
    copy's reductions are taken the same way (``plan._copies_round_alike``)."""
    x, y = normal(41, 3), normal(149, 3)

    def fn(x, y):
        k = jnp.sum(((x[:, None] + y[None]) ** 2) ** 2, 0)
        return jnp.exp(k - lax.stop_gradient(jnp.max(k, -1, keepdims=True)))

    loss = lambda x, y: jnp.sum(fn(x, y) * jnp.cos(jnp.arange(447.0)).reshape(149, 3))  # noqa: E731
    grad = jax.grad(loss, (0, 1))
    want = jax.jit(grad)(x, y)
    got = hlopass.jit(grad, threshold=12000, split_size=1500)(x, y)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5 * np.abs(np.asarray(w)).max())


@pytest.mark.parametrize("negated", [False, True], ids=["matrix_chain", "algebraic"])
def test_a_nan_times_an_empty_sum_stays_nan(negated):
    """Soak seed s589969938373, program 6: ``tensordot(w, x @ y.T, 0)`` with ``x``, ``y`` of 0 columns and
    a NaN in ``w``. As written, ``x @ y.T`` is zeros and ``NaN * 0`` spreads the NaN to every entry;
    summed in the other order, ``w @ x`` is empty and the NaN is gone (hlopass gave zeros). The
    matrix-chain pass reordered the plain chain; the algebraic pass contracted the one written through
    negations. Chains and expansions with an empty axis are now left as written
    (``hlopass.finite.has_empty_axis``)."""
    w = normal(311)
    w[17] = np.nan
    x, y = normal(311, 0), normal(309, 0)
    sign = -1.0 if negated else 1.0
    fn = lambda w, x, y: jnp.tensordot(sign * w, (sign * x) @ (sign * y).T, axes=(0, 0))  # noqa: E731
    want = np.asarray(jax.jit(fn)(w, x, y))
    assert np.isnan(want).all()
    f = hlopass.jit(fn, threshold=64_000, split_size=16_000)
    np.testing.assert_array_equal(np.asarray(f(w, x, y)), want)
    skipped = " ".join(str(s) for s in f.trace(w, x, y).report.skipped)
    assert "empty axis" in skipped, skipped


def test_an_expanded_gradient_through_a_tie_rounds_where_the_written_one_is_zero():
    """Fresh seed s664863178853, program 2 (float32, points on the integer grid; the gradient of a
    linear functional of ``zeros(8, m).at[idx].min(D)``, ``D`` the squared distances): ``jax.jit``'s
    gradients are exactly zero, hlopass's are ±4.8e-7. The cotangent reaches ``D`` only where the
    minimum ties with the zero it starts from, ``D == 0``, so where ``x_i == y_j``: as written,
    ``Σ_j c_ij·2(x_i − y_j)`` sums exact zeros; the algebraic pass's expanded gradient
    ``2(x_i·Σ_j c_ij − Σ_j c_ij·y_j)`` sums the same products in another order and rounds, by about
    eps·|x|·Σ|c|. Plain JAX written that way by hand does the same (documented deviation: floating-point
    reordering; the pass's page, *The rules for the expanded distance*). Round 16's soak met it again
    (s758966966329 program 6, the same minimum followed by ``v @ w``); the fuzzer no longer draws it."""
    from tests.fuzz import runner
    batch = runner.draw_batch("s664863178853", only=2, exclusions=False)
    fn, _ = runner._combined(batch.programs)
    x, y, idx = batch.programs[0].make_inputs(())
    d = jnp.sum((x[:, None] - y[None]) ** 2, -1)
    weights = jnp.cos(jnp.arange(8 * y.shape[0], dtype=jnp.float32)).reshape(8, -1)[idx]
    c = jnp.where(d == 0, weights, 0.0)                       # nonzero only at the ties
    assert int(jnp.sum(c != 0)) > 0
    written = jnp.einsum("ij,ijk->ik", c, 2 * (x[:, None] - y[None]))
    by_hand = jax.jit(lambda x, y, c: 2 * (x * jnp.sum(c, 1)[:, None] - c @ y))(x, y, c)
    sums = max(float(jnp.max(jnp.sum(jnp.abs(c), axis))) for axis in (0, 1))   # rows for x's, columns for y's
    bound = 8 * np.finfo(np.float32).eps * float(jnp.max(jnp.abs(x))) * sums
    assert float(jnp.max(jnp.abs(written))) == 0.0
    assert 0.0 < float(jnp.max(jnp.abs(by_hand))) <= bound

    plain = jax.tree.leaves(jax.jit(fn)(x, y, idx))
    ours = hlopass.jit(fn, threshold=batch.threshold, split_size=batch.split_size)
    got = jax.tree.leaves(ours(x, y, idx))
    assert "expanded_product" in [r.kind for r in ours.trace(x, y, idx).report.rewrites]
    for p, g in zip(plain[1:], got[1:]):                     # the gradients of x and y
        assert float(jnp.max(jnp.abs(p))) == 0.0
        assert float(jnp.max(jnp.abs(g))) <= bound


def _prefix_rounded_once(fn, name: str = "cumsum"):
    """``fn`` with its ``lax.cumsum`` s (or ``lax.cumprod`` s) computed in float32 and rounded once to
    their type: the program as written, by hand, with the prefix results the split's carried total
    gives (patched only while traced: wrap it in ``jax.jit``)."""
    from unittest import mock
    original = getattr(lax, name)

    def rounded_once(x, axis=0, reverse=False):
        return original(x.astype(jnp.float32), axis=axis, reverse=reverse).astype(x.dtype)

    def traced(*args):
        with mock.patch.object(lax, name, rounded_once):
            return fn(*args)
    return traced


def test_a_16_bit_prefix_product_rounded_once_moves_a_near_tie_as_plain_jax_does():
    """Fresh seed s856116162691 (program 0, round 19's soak), ``jax.jit(jax.vmap(hlopass.jit(F)))``:
    bfloat16 L1 distances, ``cumprod(1 + 0.01 tanh(v))`` over 110 rows, prefix sums over 27 columns,
    their sums, a softmax over the 110. The split carries the 16-bit product in float32 and rounds each
    result once (docs/passes/split.md, *Carried state*); ``jax.jit``'s bfloat16 ``cumprod`` rounds as it
    goes and lands about a quarter lower, where its two largest sums are 8 apart. Rounded once, the
    two largest sums are equal in bfloat16: the softmax gives 0.5 and 0.5 where ``jax.jit`` gives 1.
    Plain JAX with the products computed in float32 and rounded once gives hlopass's result bit for
    bit (documented deviation: a near-tie, Testing, *The soak round by round*)."""
    from tests.fuzz import runner
    batch = runner.draw_batch("s856116162691", only=0, exclusions=False)
    assert batch.mode == "vmap_out"
    fn, _ = runner._combined(batch.programs)
    args = batch.programs[0].make_inputs(runner.lead_axes(batch.mode))
    by_hand = _prefix_rounded_once(fn, "cumprod")
    plain = np.asarray(jax.tree.leaves(jax.jit(jax.vmap(fn))(*args))[0], np.float32)
    hand = np.asarray(jax.tree.leaves(jax.jit(jax.vmap(by_hand))(*args))[0], np.float32)
    ours = hlopass.jit(fn, threshold=batch.threshold, split_size=batch.split_size)
    got = np.asarray(jax.tree.leaves(jax.jit(jax.vmap(ours))(*args))[0], np.float32)
    assert ours.trace(*[a[0] for a in args]).report.rewrites
    assert np.max(np.abs(hand - plain)) > 0.4      # the near-tie: 0.5 and 0.5 against 1
    np.testing.assert_array_equal(got, hand)


@pytest.mark.parametrize("seed,index,near", [
    # cumsum over 269 rows of squares, a bfloat16 matvec, 3 gathered entries, softmax: the split's prefix
    # sums are exact (integers) and rounded once, jax.jit's reduce_window is off by up to 571; entries 0
    # and 1 are exactly 253 apart at 2.7e4 (bfloat16 spacing 128), so the matvec's rounding orders them
    ("s616536329601", 0, "argmax"),
    # tanh of squared grid distances summed over 268 rows (values past 256, bfloat16 spacing 2), then a
    # softmax over columns: a prefix sum one step apart weighs exp(2) more (inside a scan of 2)
    ("s172236491516", 7, "values"),
    # float16 (round 16): 2(x+y)^3-2 on the grid summed over 179 columns (sums past 2048, float16 spacing
    # 2 and more), then argmin over 3 entries, in a scan of 2: one index of 16,110 differs, as by hand.
    # The soak drew it as the program's second attempt (its first is now excluded)
    ("s732137007931/1", 5, "values"),
])
def test_a_16_bit_prefix_sum_rounded_once_moves_a_near_tie_as_plain_jax_does(seed, index, near):
    """Fresh seeds s616536329601 (program 0) and s172236491516 (program 7), bfloat16 on the integer
    grid (and a float16 one, below): a cumulative sum carried by the split is the exact sum rounded once, where ``jax.jit``'s
    ``reduce_window`` rounds as it goes; a softmax downstream turns a last-bit difference of bfloat16
    values (spacing 128 and 2 there) into another weight. Plain JAX written with the prefix sums rounded
    once differs from ``jax.jit`` wherever hlopass does, and gives hlopass's result bit for bit (the first)
    or at 534 of 536 entries (the second, whose split also chunks the softmax's sums inside a row)
    (documented deviation: a near-tie, Testing, *The soak round by round*). Round 16's soak met it in
    float16 (s732137007931 program 5: an argmin after the prefix sums; hlopass equals the hand-written
    program bit for bit). ``seed/attempt`` names the draw of the program that the soak ran."""
    import dataclasses
    from tests.fuzz import runner
    seed, _, attempt = seed.partition("/")
    batch = runner.draw_batch(seed, only=index, exclusions=False)
    if attempt:
        program = runner.draw_program(runner.RandomDraw(f"{seed}/{index}/{attempt}"), batch.threshold,
                                      label=f"{seed}/{index}", x64=batch.x64, frontier=True)
        batch = dataclasses.replace(batch, programs=[program])
    fn, _ = runner._combined(batch.programs)
    args = batch.programs[0].make_inputs(runner.lead_axes(batch.mode))
    assert batch.mode == "value"
    plain = np.asarray(jax.tree.leaves(jax.jit(fn)(*args))[0], np.float32)
    hand = np.asarray(jax.tree.leaves(jax.jit(_prefix_rounded_once(fn))(*args))[0], np.float32)
    ours = hlopass.jit(fn, threshold=batch.threshold, split_size=batch.split_size)
    got = np.asarray(jax.tree.leaves(ours(*args))[0], np.float32)
    assert ours.trace(*args).report.rewrites
    if near == "argmax":
        assert np.argmax(plain) != np.argmax(hand)
        np.testing.assert_array_equal(got, hand)
    else:   # where hlopass differs from jax.jit, the prefix sums rounded once do too
        ours_off, hand_off = got != plain, hand != plain
        assert ours_off.any() and not (ours_off & ~hand_off).any()
        assert np.mean(got == hand) > 0.99    # the rest: the softmax's own sums, chunked inside a row


def test_top_k_after_a_split_cumulative_logsumexp_differs_only_at_exact_ties():
    """Fresh seed s676920774220, program 2 (float64 on the integer grid, under ``jax.vmap``:
    ``top_k(cumlogsumexp(clip(x @ y.T, -1, 2), 0), 2)``): 12 of the 1,752 indices differ from
    ``jax.jit``'s. The split runs the cumulative logsumexp 17 rows at a time with a carried total.
    Clipped grid products repeat, so columns holding the same values in another order tie exactly;
    each rounding order puts one or the other ahead (``jax.jit``'s ranks column 81 above 71 at row 17
    by one ulp, where ``top_k`` breaks the exact tie towards 71). Every differing index is such an exact
    tie, and the same loop written by hand in plain JAX also ranks tied columns otherwise than
    ``jax.jit`` (documented deviation: the split pass's page, *Ties*)."""
    from jax import lax
    from tests.fuzz import runner
    batch = runner.draw_batch("s676920774220", only=2, exclusions=False)
    x, y = (a[0] for a in batch.programs[0].make_inputs(runner.lead_axes(batch.mode)))
    fn = lambda x, y: lax.top_k(lax.cumlogsumexp(jnp.clip(x @ y.T, -1, 2), axis=0), 2)[1]  # noqa: E731

    def by_hand(x, y, chunk=17):   # the split's loop, written in plain JAX
        e = jnp.clip(x @ y.T, -1, 2)
        rows, total = [], jnp.full(e.shape[1], -jnp.inf, e.dtype)
        for start in range(0, e.shape[0], chunk):
            part = jnp.logaddexp(lax.cumlogsumexp(e[start:start + chunk], axis=0), total)
            rows.append(part)
            total = part[-1]
        return lax.top_k(jnp.concatenate(rows), 2)[1]

    with jax.enable_x64(True):
        x, y = jnp.asarray(x, jnp.float64), jnp.asarray(y, jnp.float64)
        ours = hlopass.jit(fn, threshold=batch.threshold, split_size=batch.split_size)
        got, plain = np.asarray(ours(x, y)), np.asarray(jax.jit(fn)(x, y))
        hand = np.asarray(jax.jit(by_hand)(x, y))
        assert ours.trace(x, y).report.rewrites
        values = np.clip(np.asarray(x) @ np.asarray(y).T, -1, 2)

    def tie(row, a, b):   # the same values in another order: equal cumulative logsumexps
        return np.array_equal(np.sort(values[:row + 1, a]), np.sort(values[:row + 1, b]))
    for name, other in (("hlopass", got), ("by hand", hand)):
        differ = np.argwhere(other != plain)
        assert len(differ) > 0, name
        for row, slot in differ:
            assert tie(row, other[row, slot], plain[row, slot]), (name, row, slot)


def test_a_bfloat16_product_summed_in_float32_is_rounded_as_written_where_xla_fuses_it_unrounded():
    """Fresh seed s804230096662, program 4 (bfloat16, round 17's soak): the sum of the outer product of two
    row sums, ``sum(x, 1)[:, None] * sum(y, 1)[None]``, summed in float32. The product is bfloat16 as
    written; XLA:CPU fuses it into jax.jit's float32 sum and multiplies in float32 without rounding, so
    jax.jit gives -1.89 where every product rounded to bfloat16 gives -2.30 (6,437 terms of magnitude up to
    27 cancelling to 2). hlopass's split loop reads the product from memory, in bfloat16. Plain JAX written
    by hand shows both: the product computed on its own and then summed gives hlopass's value bit for bit,
    the product fused into the sum gives jax.jit's (documented deviation: Testing, *The soak round by round*;
    the fuzzer judges such differences against the program evaluated operation by operation in its types,
    ``runner._judged_as_written``)."""
    from tests.fuzz import runner
    batch = runner.draw_batch("s804230096662", only=4)
    fn, _ = runner._combined(batch.programs)
    args = batch.programs[0].make_inputs(runner.lead_axes(batch.mode))
    ours = hlopass.jit(fn, threshold=batch.threshold, split_size=batch.split_size)
    got = float(jax.tree.leaves(ours(*args))[0][0])
    plain = float(jax.tree.leaves(jax.jit(fn)(*args))[0][0])
    assert ours.trace(*args).report.rewrites

    def row_sums(v):
        return jnp.sum(v[0].astype(jnp.float32), 1).astype(jnp.bfloat16)

    a, b = jax.jit(row_sums)(args[0]), jax.jit(row_sums)(args[1])
    product = jax.jit(lambda a, b: a[:, None] * b[None])(a, b)            # bfloat16 in memory
    rounded = float(jnp.sum(product.astype(jnp.float32)).astype(jnp.bfloat16))
    fused = float(jax.jit(lambda a, b: jnp.sum((a[:, None] * b[None]).astype(jnp.float32)).astype(jnp.bfloat16))(a, b))
    assert got == rounded and plain == fused
    assert abs(rounded - fused) > 0.3


def test_a_bfloat16_product_accumulated_by_a_split_runs_on_xla_cpu():
    """Fresh seed s937818910445, program 0 (round 17's soak; bfloat16, ``jax.vmap`` of ``hlopass.jit``): a
    split loop accumulating ``v @ W`` over slices of the contraction binds a bfloat16 ``dot_general`` into
    float32; XLA:CPU cannot run that dot for the layout the vmapped gather gives its operand ("UNIMPLEMENTED:
    Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32"). On CPU the split now converts the
    16-bit operands to float32 first (the same products and sums)."""
    from tests.fuzz import runner
    batch = runner.draw_batch("s937818910445", only=0)
    assert batch.mode == "vmap_out" and batch.programs[0].dtype == "bfloat16"
    result = runner.check_batch(batch)
    assert result["rewrites"]["split:split"] and not result["failures"], result["failures"]


def test_an_expanded_product_through_top_k_keeps_the_sign_of_its_zeros():
    """Fresh seed s802314916978, program 5 (round 17's soak; float32 grid, the gradient of
    ``top_k(top_k(g @ ((x[:,None] − y[None]) * f), 2))`` under a memory limit): the gradient of ``f`` was
    66.7 off at a scale of 74. Where ``f[b] == 0`` the row is all zeros: as written each is a sum of 67
    signed zeros, so ``+0``; the expansion ``f·(g @ x) − f·y·Σg`` gives ``-0`` where its first term is
    ``-0``. XLA's ``top_k`` ranks ``-0`` below ``+0`` (JAX's sort and argmax do not), so it picked other
    tied columns and the gradient followed them. The pass now makes the zeros of a sum of several
    terms ``+0`` (``match.positive_zero``)."""
    from tests.fuzz import runner
    batch = runner.draw_batch("s802314916978", only=5)
    assert batch.mode == "grad_in" and batch.memory_fraction is not None
    result = runner.check_batch(batch)
    assert result["rewrites"]["algebraic:expanded_product"] and not result["failures"], result["failures"]

    x, y, f, g = batch.programs[0].make_inputs(())
    assert int(jnp.sum(f == 0)) > 0

    def fn(x, y, f, g):
        return jax.lax.top_k(jnp.einsum("a,abc->bc", g, (x[:, None] - y[None]) * f[None, :, None]), 2)

    by_hand = jax.jit(lambda x, y, f, g: jnp.einsum("a,ac,b->bc", g, x, f) - jnp.einsum("a,bc,b->bc", g, y, f))
    expanded = by_hand(x, y, f, g)
    assert bool(jnp.any(jnp.signbit(expanded) & (expanded == 0)))   # the expansion's -0 ...
    plain_values, plain_idx = jax.jit(fn)(x, y, f, g)
    assert not np.array_equal(jax.lax.top_k(expanded, 2)[1], plain_idx)   # ... moves top_k's choice
    ours = hlopass.jit(fn, threshold=1000, split_size="off")
    values, idx = ours(x, y, f, g)
    assert "expanded_product" in [r.kind for r in ours.trace(x, y, f, g).report.rewrites]
    np.testing.assert_array_equal(idx, plain_idx)
    np.testing.assert_allclose(values, plain_values, rtol=1e-5, atol=1e-4)


def test_xla_cpus_ynn_fusion_of_a_bfloat16_exp_sum_is_checked_without_it():
    """CI's fresh seed s323714153567, program 0 (bfloat16, ``sum(exp(-sqdist / 2), 1)`` then tanh layers):
    hlopass gives infinities at some rows, a different count each call. jaxlib 0.10.2's XLA:CPU fuses
    ``exp(c * x)`` summed along a row into one YNNPACK kernel, and for bfloat16 ``x`` that kernel gives
    infinities where every value is small: plain JAX written by hand shows it on the split's loop result
    alone (``jnp.sum(jnp.exp(-0.5 * n), 1)``, ``n`` a bfloat16 input), where the program as written
    computes ``exp`` inside the distances' own fusion and does not reach it. With the YNN fusions off
    (``runner.NO_YNN_FLAG``) hlopass equals ``jax.jit``; the fuzzer lists such programs apart
    (``ynn_only``, not failures) and this test shows the defect is still there (when a jaxlib fixes it,
    the test asks for the program to pass as it is)."""
    import subprocess
    import sys
    from tests import ROOT
    from tests.fuzz import runner
    rng = np.random.default_rng(0)
    n = jnp.asarray(np.abs(rng.standard_normal((110, 104))) * 10, jnp.bfloat16)

    def by_hand(n):
        return jnp.sum(jnp.exp(jnp.bfloat16(-0.5) * n).astype(jnp.float32), 1)

    with jax.disable_jit():
        assert np.isfinite(np.asarray(by_hand(n))).all()
    fused = np.asarray(jax.jit(by_hand)(n))
    batch = runner.draw_batch("s323714153567", only=0)
    if np.isfinite(fused).all():       # fixed in this jaxlib: hlopass must match as it is
        assert not runner.check_batch(batch)["failures"]
        return
    code = ("import sys, jax; from tests.fuzz import runner; b = runner.draw_batch('s323714153567', only=0); "
            "r = runner.check_batch(b); print(r['rewrites']['split:split'], len(r['failures'])); "
            "sys.exit(1 if r['failures'] else 0)")
    env = dict(os.environ, XLA_FLAGS=runner.NO_YNN_FLAG, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert int(done.stdout.split()[-2]) > 0    # the split rewrote it


@pytest.mark.xfail(strict=True, reason="engine (open): a gradient taken through hlopass.jit of a split program is "
                   "about 100 times less accurate than jax.jit's here (found by hypothesis in round 31)")
def test_gradient_through_a_split_call_is_as_accurate_as_jax_jits():
    """``tests/passes/split/test_split_properties.py``'s example n=199, m=210, d=4, ``sq_dist``, ``where``
    then ``square`` then ``softplus``, ``solve_left_t``, ``sum0``, in a ``cond``, seed 581 (threshold
    123.73 kB): ``jax.grad`` of a linear functional of ``hlopass.jit(program, passes="split")`` is 1.5e-4
    of its scale from the float64 run (median entry 3.7e-3 off), ``jax.jit``'s 3e-7 (2.2e-5), so the
    property test's float32 tolerance fails on 2 of 796 entries. ``hlopass.jit`` of the gradient itself
    is as accurate as ``jax.jit`` (3e-7): what differs is the path through the call's linearisation
    (under ``jax.checkpoint``, its transposed program split again). Fails the same at 61dcbfe."""
    from tests.passes.split.test_split_properties import build
    n, m, d, seed = 199, 210, 4, 581
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    x, y = jax.random.normal(keys[0], (n, d)), jax.random.normal(keys[1], (m, d))
    u, v = jax.random.normal(keys[2], (n,)), jax.random.normal(keys[3], (m,))
    program = build("sq_dist", ["where", "square", "softplus"], "sum0", "solve_left_t", "cond")
    f = hlopass.jit(program, passes="split", threshold=max(4_096, int(n * m * d * 4 * 0.18504751332499958)))
    assert f.trace(x, y, u, v).report.rewrites

    def gradient(fn, *args):
        def scalar(x, y):
            out = fn(x, y, args[2], args[3])
            return jnp.sum(out * jnp.cos(jnp.arange(out.size, dtype=out.dtype).reshape(out.shape)))
        return np.asarray(jax.jit(jax.grad(scalar))(args[0], args[1]), np.float64)

    got, want = gradient(f, x, y, u, v), gradient(jax.jit(program), x, y, u, v)
    with jax.enable_x64(True):
        truth = gradient(program, *(jnp.asarray(np.asarray(a), jnp.float64) for a in (x, y, u, v)))
    scale = np.max(np.abs(truth))
    assert np.max(np.abs(want - truth)) / scale < 1e-6
    assert np.max(np.abs(got - truth)) / scale < 1e-5
