"""The adjoint pass: gradients equal jax.grad of the program as written, for every linear form."""

import contextlib
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlopass
from hlopass.passes.adjoint import AdjointPass, truncation_errors

from . import models

ARGNUMS = (0, 1, 2)


def _x64(dtype):
    return jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext()


def _tol(dtype):
    return dict(rtol=2e-4, atol=2e-5) if dtype == "float32" else dict(rtol=1e-10, atol=1e-12)


def _rand(key, shape, dtype, scale=1.0):
    return (scale * jax.random.normal(key, shape)).astype(dtype)


def problem(name, T, dtype, batch=()):
    k = jax.random.split(jax.random.key(T), 6)
    P, N = 3, 4
    if name == "diagonal":
        params = tuple(_rand(k[i], (P, N), dtype, 0.5) for i in range(3))
        return models.diagonal, params, jnp.zeros(batch + (N, P), dtype), _rand(k[4], (T,) + batch + (P,), dtype)
    if name == "dense_per_step":
        params = (_rand(k[0], (P, N, N), dtype), _rand(k[1], (N, P), dtype))
        return models.dense_per_step, params, _rand(k[2], (N,), dtype), _rand(k[4], (T, P), dtype)
    if name == "dense_shared":
        a = _rand(k[0], (N, N), dtype, 0.3)
        return (models.dense_shared, (a, _rand(k[1], (N, P), dtype)), _rand(k[2], batch + (N,), dtype),
                _rand(k[4], (T,) + batch + (P,), dtype))
    if name == "complex":
        cdt = jnp.complex128 if dtype == "float64" else jnp.complex64
        params = (_rand(k[0], (N,), dtype, 0.5) - 2.0, _rand(k[1], (N,), dtype), _rand(k[2], (P, N), dtype),
                  _rand(k[3], (N,), dtype))
        return models.complex_diagonal, params, _rand(k[5], (N,), dtype).astype(cdt), _rand(k[4], (T, P), dtype)
    if name == "nonlinear":
        return models.nonlinear, (_rand(k[0], (N, N), dtype, 0.5),), jnp.zeros(N, dtype), _rand(k[4], (T, N), dtype)
    if name == "gated":
        return models.gated, (_rand(k[0], (P, N), dtype),), jnp.ones(N, dtype), _rand(k[4], (T, P), dtype)
    raise KeyError(name)


def _compare(got, want, dtype):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **_tol(dtype))


def _kinds(report):
    return [r.details.get("form") for p in report.passes if p.name == "adjoint" for r in p.rewrites]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name,T", [("diagonal", 97), ("dense_per_step", 31), ("dense_shared", 97),
                                    ("complex", 97)])
def test_gradient_equals_jax_grad(name, T, dtype):
    with _x64(dtype):
        layer, params, h0, xs = problem(name, T, dtype)
        loss = models.loss_of(layer)
        want = jax.jit(jax.grad(loss, ARGNUMS))(params, h0, xs)
        inside = hlopass.jit(jax.grad(loss, ARGNUMS), passes="adjoint")     # jax.grad inside
        _compare(inside(params, h0, xs), want, dtype)
        if dtype == "float32":  # the other way in once per form (time: 2 shared cores)
            outside = jax.jit(jax.grad(hlopass.jit(loss, passes="adjoint"), ARGNUMS))   # jax.grad of it
            _compare(outside(params, h0, xs), want, dtype)
        expected = {"diagonal": "diagonal", "complex": "complex"}.get(name, "dense")
        assert _kinds(inside.trace(params, h0, xs).report) == [expected]


def test_long_prime_length_with_batch_and_default_pipeline():
    layer, params, h0, xs = problem("diagonal", 1009, "float32", batch=(2,))
    loss = models.loss_of(layer)
    want = jax.jit(jax.grad(loss, ARGNUMS))(params, h0, xs)
    f = hlopass.jit(jax.grad(loss, ARGNUMS))                 # the default pipeline holds the pass
    _compare(f(params, h0, xs), want, "float32")
    (entry,) = [r for p in f.trace(params, h0, xs).report.passes if p.name == "adjoint" for r in p.rewrites]
    # K balances the states kept at chunk boundaries against a chunk's per-step bytes (both measured)
    assert 1 < entry.details["chunk"] < 1009 and entry.details["length"] == 1009
    assert entry.details["saved_bytes"] > 0 and entry.details["stacked"] == 1
    assert "models.py" in entry.location and "saves" in entry.summary


@pytest.mark.parametrize("dtype", ["float64"])
def test_stacked_layers_exact_across_layers(dtype):
    with _x64(dtype):
        k = jax.random.split(jax.random.key(3), 4)
        params = [tuple(_rand(jax.random.fold_in(k[i], j), (3, 4), dtype, 0.5) for j in range(3)) for i in range(3)]
        h0s = [_rand(k[3], (4, 3), dtype, 0.1)] * 3
        xs = _rand(k[3], (53, 3), dtype)
        want = jax.jit(jax.grad(models.stacked_loss, ARGNUMS))(params, h0s, xs)
        got = hlopass.jit(jax.grad(models.stacked_loss, ARGNUMS), passes="adjoint")(params, h0s, xs)
        _compare(got, want, dtype)


def test_nan_and_inf_inputs_as_jit():
    layer, params, h0, xs = problem("diagonal", 29, "float32")
    xs = xs.at[5, 1].set(jnp.nan).at[20, 0].set(jnp.inf)
    loss = models.loss_of(layer)
    want = jax.jit(jax.grad(loss, ARGNUMS))(params, h0, xs)
    got = hlopass.jit(jax.grad(loss, ARGNUMS), passes="adjoint")(params, h0, xs)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_array_equal(np.isinf(g), np.isinf(w))


@pytest.mark.parametrize("T", [0, 1])
def test_no_steps_or_one(T):
    """A recurrence over no steps (an empty sequence: fresh seed s1037644189817 divided by it) is left
    alone and named; over one step it is rewritten. Gradients equal jax.grad's either way."""
    layer, params, h0, xs = problem("diagonal", T, "float32")
    loss = models.loss_of(layer)
    f = hlopass.jit(jax.grad(loss, ARGNUMS), passes="adjoint")
    _compare(f(params, h0, xs), jax.jit(jax.grad(loss, ARGNUMS))(params, h0, xs), "float32")
    report = f.trace(params, h0, xs).report
    if T == 0:
        (skip,) = report.skipped
        assert _kinds(report) == [] and "no steps" in skip.reason and "models.py" in skip.location
    else:
        assert not report.skipped


@pytest.mark.parametrize("name,reason", [("nonlinear", "non-linear in the state (through tanh)"),
                                         ("gated", "feeds a comparison")])
def test_nonlinear_left_alone_and_named(name, reason):
    layer, params, h0, xs = problem(name, 17, "float32")
    loss = models.loss_of(layer)
    f = hlopass.jit(jax.grad(loss, ARGNUMS), passes="adjoint")
    _compare(f(params, h0, xs), jax.jit(jax.grad(loss, ARGNUMS))(params, h0, xs), "float32")
    report = f.trace(params, h0, xs).report
    assert _kinds(report) == []
    (skip,) = report.skipped
    assert skip.primitive == "scan" and reason in skip.reason and "models.py" in skip.location


def test_truncated_is_approximate_and_reported(monkeypatch, caplog):
    layer, params, h0, xs = problem("diagonal", 64, "float32")
    loss = models.loss_of(layer)
    want = jax.jit(jax.grad(loss, ARGNUMS))(params, h0, xs)
    f = hlopass.jit(jax.grad(loss, ARGNUMS), passes=[AdjointPass(truncate=8)])
    truncation_errors.clear()
    with caplog.at_level(logging.INFO, logger="hlopass"):
        got = jax.block_until_ready(f(params, h0, xs))
    (entry,) = [r for p in f.trace(params, h0, xs).report.passes for r in p.rewrites]
    assert "TRUNCATED to 8 steps" in entry.summary and "approximate" in entry.summary
    (measured,) = truncation_errors.values()
    flat_g = np.concatenate([np.ravel(g) for g in jax.tree_util.tree_leaves(got)])
    flat_w = np.concatenate([np.ravel(w) for w in jax.tree_util.tree_leaves(want)])
    rel = np.linalg.norm(flat_g - flat_w) / np.linalg.norm(flat_w)
    assert 0 < rel and abs(measured - rel) < 1e-3 + 0.05 * rel
    assert "truncated gradient differs" in caplog.text


@pytest.mark.parametrize("bad", [0, -3, 2.5, "8", True])
def test_bad_truncation_is_config_error(bad):
    with pytest.raises(hlopass.ConfigError, match="truncate=.*positive integer"):
        AdjointPass(truncate=bad)


def test_options_on_a_program_without_recurrence():
    f = jax.grad(hlopass.jit(lambda x: jnp.sum(jnp.sin(x) ** 2), passes=[AdjointPass(truncate=4)]))
    assert float(jnp.abs(f(jnp.ones(3)) - jax.grad(lambda x: jnp.sum(jnp.sin(x) ** 2))(jnp.ones(3))).max()) < 1e-6
    text = str(hlopass.reports(f, jnp.ones(3)))
    assert "no scan in the differentiated program" in text


def test_undifferentiated_program_untouched():
    layer, params, h0, xs = problem("diagonal", 13, "float32")
    loss = models.loss_of(layer)
    f = hlopass.jit(loss, passes="adjoint")
    assert f(params, h0, xs) == jax.jit(loss)(params, h0, xs)
    assert _kinds(f.trace(params, h0, xs).report) == []


def test_options_on_a_program_without_recurrence_grad_inside():
    f = hlopass.jit(jax.grad(lambda x: jnp.sum(jnp.cos(x) ** 2)), passes=[AdjointPass(chunk=8)])
    np.testing.assert_allclose(f(jnp.ones(3)), jax.grad(lambda x: jnp.sum(jnp.cos(x) ** 2))(jnp.ones(3)), rtol=1e-6)
    (skip,) = f.trace(jnp.ones(3)).report.skipped
    assert "no scan in the differentiated program" in skip.reason and "chunk=8" in skip.reason


@pytest.mark.parametrize("bad", [0, -1, 1.5, None.__class__])
def test_bad_chunk_is_config_error(bad):
    with pytest.raises(hlopass.ConfigError, match="chunk=.*positive integer"):
        AdjointPass(chunk=bad)
