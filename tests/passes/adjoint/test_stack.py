"""Stacked layers chunked along time: the adjoint pass runs a recurrence and the row-wise equations
around it (and the other layers' recurrences) K rows at a time, gradients equal jax.grad."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlopass
from hlopass.families import CALLS
from hlopass.interpreter import inline_calls
from hlopass.passes.adjoint import AdjointPass
from hlopass.passes.adjoint.recurrence import classify
from hlopass.passes.adjoint.stack import balanced_chunk, find_region, kept_states, near_divisor, nested_groups

from . import models

VOCAB = 11


def _entries(report):
    return [r for p in report.passes if p.name == "adjoint" for r in p.rewrites]


def _lm(T, dtype, layers=3, width=6, state=3, seed=0):
    params, emb = models.lm_params(jax.random.key(seed), layers, width, state, VOCAB, dtype)
    tokens = jax.random.randint(jax.random.key(seed + 1), (T + 1,), 0, VOCAB)
    return params, emb, tokens


def _close(got, want, dtype):
    tol = dict(rtol=3e-4, atol=3e-6) if dtype == "float32" else dict(rtol=1e-10, atol=1e-13)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **tol)


@pytest.mark.parametrize("dtype,T", [("float64", 97), ("float32", 128)])
def test_language_model_stack_equals_jax_grad(dtype, T):
    with jax.enable_x64(dtype == "float64") if dtype == "float64" else contextlib.nullcontext():
        args = _lm(T, dtype)
        grad = jax.grad(models.lm_stack, (0, 1))
        f = hlopass.jit(grad, passes="adjoint")
        _close(f(*args), jax.jit(grad)(*args), dtype)
        entries = _entries(f.trace(*args).report)
        assert entries and all(e.details["stacked"] == 3 for e in entries)
        assert "together with 2 other recurrences" in entries[0].summary
        k = entries[0].details["chunk"]
        assert 1 < k < T and (T % k == 0 or T == 97)   # a divisor where there is one near the balance


def test_the_whole_stack_chunked_keeps_less_than_plain():
    args = _lm(2048, "float32", layers=2, width=32, state=8)
    grad = jax.grad(models.lm_stack, (0, 1))
    plain = jax.jit(grad).lower(*args).compile().memory_analysis().temp_size_in_bytes
    ours = hlopass.jit(grad, passes="adjoint").lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert ours * 10 < plain, (ours, plain)


def test_region_of_the_language_model():
    params, emb, tokens = _lm(40, "float32")
    closed = inline_calls(jax.make_jaxpr(models.lm_stack)(params, emb, tokens), CALLS)
    scans = {i: classify(e) for i, e in enumerate(closed.jaxpr.eqns) if e.primitive.name == "scan"}
    region = find_region(closed.jaxpr, 40, scans)
    names = [closed.jaxpr.eqns[i].primitive.name for i in region.eqns]
    assert names.count("scan") == 3 and "gather" in names and "tanh" in names and "dot_general" in names
    assert [region.kinds[i] for i in region.eqns if region.kinds[i] == "acc"] == ["acc"]   # the loss's sum
    assert not region.rows_out and [str(v.aval) for v in region.finals] == ["float32[]"]
    assert all(v.aval.shape == (40,) for v in region.sources)   # the token slices, not the embeddings


def test_rows_mixed_between_layers_split_the_region():
    k = jax.random.split(jax.random.key(5), 4)
    params = tuple(0.5 * jax.random.normal(k[i], (3, 4)) for i in range(3))
    h0, xs = jnp.zeros((4, 3)), jax.random.normal(k[3], (31, 3))
    grad = jax.grad(models.shifted_layers, (0, 1, 2))
    f = hlopass.jit(grad, passes="adjoint")
    _close(f(params, h0, xs), jax.jit(grad)(params, h0, xs), "float32")
    entries = _entries(f.trace(params, h0, xs).report)
    assert entries and all("stacked" not in e.details for e in entries)   # each scan on its own


def test_nan_and_inf_in_the_stack_as_jit():
    params, emb, tokens = _lm(23, "float32")
    emb = emb.at[int(tokens[3]), 1].set(jnp.nan).at[int(tokens[9]), 0].set(jnp.inf)
    grad = jax.grad(models.lm_stack, (0, 1))
    got = hlopass.jit(grad, passes="adjoint")(params, emb, tokens)
    want = jax.jit(grad)(params, emb, tokens)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_array_equal(np.isinf(g), np.isinf(w))


def test_chunk_option_and_balance():
    args = _lm(60, "float32")
    grad = jax.grad(models.lm_stack, (0, 1))
    f = hlopass.jit(grad, passes=[AdjointPass(chunk=7)])        # 8 chunks of 7 and one of 4
    _close(f(*args), jax.jit(grad)(*args), "float32")
    assert {e.details["chunk"] for e in _entries(f.trace(*args).report)} == {7}
    assert near_divisor(1024, 45) == 32 and near_divisor(1009, 30) == 30 and near_divisor(10, 40) == 10
    # K balances T/K boundary states against K steps' bytes: sqrt(T * carry / per-step)
    assert balanced_chunk(4096, 100, 400, None) == 32 and balanced_chunk(4096, 100, 400, 8 * 400 * 5) == 4


@pytest.mark.parametrize("T", [31, 64])
def test_rows_read_after_the_region(T):
    """A cumulative sum over time reads the region's rows after it: they are stacked from the chunks
    (and a last partial chunk at a prime length)."""
    def loss(params, h0, xs):
        _, ys = models.diagonal(params, h0, xs)
        z = jnp.tanh(ys) * 2.0
        return jnp.sum(jnp.cumsum(z, 0) ** 2) + jnp.sum(z)
    k = jax.random.split(jax.random.key(5), 4)
    params = tuple(0.5 * jax.random.normal(k[i], (3, 4)) for i in range(3))
    h0, xs = jnp.zeros((4, 3)), jax.random.normal(k[3], (T, 3))
    grad = jax.grad(loss, (0, 1, 2))
    f = hlopass.jit(grad, passes="adjoint")
    _close(f(params, h0, xs), jax.jit(grad)(params, h0, xs), "float32")
    assert [e.details["stacked"] for e in _entries(f.trace(params, h0, xs).report)] == [1]


@pytest.mark.parametrize("T", [37, 64])
def test_a_recurrence_with_no_inputs_per_step(T):
    """A region whose recurrence reads nothing per step (``lax.scan(f, h, None, length=T)``) has no
    sources: its chunks are counted from T, not from the sources' blocks."""
    with jax.enable_x64(True):
        loss, args = models.free_running(T)
        grad = jax.grad(loss, (0, 1, 2, 3))
        f = hlopass.jit(grad, passes=[AdjointPass(chunk=8)])
        _close(f(*args), jax.jit(grad)(*args), "float64")
        assert [e.details["row_equations"] for e in _entries(f.trace(*args).report)] == [4]   # a time region


@pytest.mark.parametrize("dtype,T,chunk", [("float64", 97, 7), ("float32", 128, 4), ("float64", 211, None)])
def test_two_levels_of_checkpointing_equal_jax_grad(dtype, T, chunk):
    """``levels=2``: the chunks run in groups, each group's scan under ``jax.checkpoint`` too. At 97
    steps in chunks of 7: 13 chunks (4 groups of 3, one chunk left over) and a last partial chunk."""
    with jax.enable_x64(dtype == "float64") if dtype == "float64" else contextlib.nullcontext():
        args = _lm(T, dtype)
        grad = jax.grad(models.lm_stack, (0, 1))
        f = hlopass.jit(grad, passes=[AdjointPass(chunk=chunk, levels=2)])
        _close(f(*args), jax.jit(grad)(*args), dtype)
        entries = _entries(f.trace(*args).report)
        k = entries[0].details["chunk"]
        assert all(e.details["levels"] == 2 and e.details["groups"] == nested_groups(T // k, 2) > 1
                   for e in entries), entries
        assert "two levels of checkpointing" in entries[0].summary


def test_nested_groups():
    assert nested_groups(512, 2) in (16, 32) and nested_groups(100, 2) == 10 and nested_groups(512, 1) == 1
    assert nested_groups(13, 2) == 4 and kept_states(13, 4) == 4 + 3 + 1   # 4 groups of 3, one left over
    assert nested_groups(3, 2) == 1 and kept_states(3, 1) == 3             # too few chunks to group


def test_two_levels_keep_fewer_states():
    """Short chunks (many boundary states): a second level keeps a fraction of them (XLA's temp)."""
    args = _lm(4096, "float32", layers=2, width=32, state=8)
    grad = jax.grad(models.lm_stack, (0, 1))
    temps = {levels: hlopass.jit(grad, passes=[AdjointPass(chunk=8, levels=levels)]).lower(*args).compile()
             .memory_analysis().temp_size_in_bytes for levels in (1, 2)}
    assert temps[2] * 2 < temps[1], temps


def test_levels_follow_the_memory_limit():
    """By default a second level is used where one level would keep more than a quarter of the
    memory limit; gradients equal jax.grad's either way."""
    args = _lm(512, "float32", layers=2, width=16, state=8)
    grad = jax.grad(models.lm_stack, (0, 1))
    want = jax.jit(grad)(*args)
    levels = {}
    for limit in ("64kB", None):
        f = hlopass.jit(grad, passes="adjoint", memory_limit=limit)
        _close(f(*args), want, "float32")
        levels[limit] = {e.details["levels"] for e in _entries(f.trace(*args).report)}
    assert levels == {"64kB": {2}, None: {1}}, levels


@pytest.mark.parametrize("bad", [0, 3, True, "2", 1.5])
def test_bad_levels_is_config_error(bad):
    with pytest.raises(hlopass.ConfigError, match="levels="):
        AdjointPass(levels=bad)


def test_levels_on_a_scan_outside_any_region_is_a_report_line():
    k = jax.random.split(jax.random.key(5), 4)
    params = tuple(0.5 * jax.random.normal(k[i], (3, 4)) for i in range(3))
    h0, xs = jnp.zeros((4, 3)), jax.random.normal(k[3], (31, 3))
    grad = jax.grad(models.shifted_layers, (0, 1, 2))
    f = hlopass.jit(grad, passes=[AdjointPass(levels=2)])
    _close(f(params, h0, xs), jax.jit(grad)(params, h0, xs), "float32")
    entries = _entries(f.trace(params, h0, xs).report)
    assert entries and all("levels=2 has no effect here" in e.summary for e in entries), entries
