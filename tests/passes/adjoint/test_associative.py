"""``lax.associative_scan`` of a linear recurrence: gradients by the adjoint method equal jax.grad."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlopass
from hlopass.passes.adjoint.associative import is_linear_combine

from . import models


def _entries(report):
    return [r for p in report.passes if p.name == "adjoint" for r in p.rewrites]


def _data(T, dtype, batch=(), P=3, N=4, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    params = (jax.random.normal(k[0], (P, N)).astype(dtype), jax.random.normal(k[1], (P, N)).astype(dtype))
    return params, jax.random.normal(k[2], batch + (T, P)).astype(dtype)


def _close(got, want, dtype):
    tol = dict(rtol=2e-4, atol=2e-5) if dtype == "float32" else dict(rtol=1e-10, atol=1e-12)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **tol)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("T,batch,axis,reverse", [(97, (), 0, False), (31, (2,), 1, False), (53, (), 0, True),
                                                  (1, (), 0, False)])
def test_gradient_equals_jax_grad(T, batch, axis, reverse, dtype):
    with jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext():
        params, x = _data(T, dtype, batch)
        loss = lambda p, x: models.selective_parallel(p, x, axis, reverse)  # noqa: E731
        grad = jax.grad(loss, (0, 1))
        want = jax.jit(grad)(params, x)
        inside = hlopass.jit(grad, passes="adjoint")
        _close(inside(params, x), want, dtype)
        (entry,) = _entries(inside.trace(params, x).report)
        assert entry.details["form"] == "associative" and entry.details["length"] == T
        assert "models.py" in entry.location
        if dtype == "float32":
            outside = jax.jit(jax.grad(hlopass.jit(loss, passes="adjoint"), (0, 1)))
            _close(outside(params, x), want, dtype)


def test_complex_diagonal():
    k = jax.random.split(jax.random.key(2), 3)
    lam = jnp.exp(-jnp.exp(jax.random.normal(k[0], (4,))) + 1j * jax.random.normal(k[1], (4,)))
    x = jax.random.normal(k[2], (41, 4))

    def loss(lam, x):
        a = jnp.broadcast_to(lam, x.shape)
        _, h = jax.lax.associative_scan(models.affine_combine, (a, x.astype(lam.dtype)))
        return jnp.sum(jnp.abs(h) ** 2)
    grad = jax.grad(loss, (0, 1))
    _close(hlopass.jit(grad, passes="adjoint")(lam, x), jax.jit(grad)(lam, x), "float32")


def test_stacked_parallel_layers_and_nan_inf_as_jit():
    params, x = _data(29, "float32")
    layers = [params, _data(29, "float32", seed=1)[0]]

    def loss(layers, x):
        total = 0.0
        for p in layers:
            a = jax.nn.sigmoid(x @ p[0])
            _, h = jax.lax.associative_scan(models.affine_combine, (a, jnp.tanh(x)[:, None, :] * a[..., None]))
            x = x + jnp.einsum("tnp,pn->tp", h, p[1])
            total = total + jnp.sum(x ** 2)
        return total
    grad = jax.grad(loss, (0, 1))
    f = hlopass.jit(grad, passes="adjoint")
    _close(f(layers, x), jax.jit(grad)(layers, x), "float32")
    assert len(_entries(f.trace(layers, x).report)) >= 1
    bad = x.at[4, 1].set(jnp.nan).at[17, 0].set(jnp.inf)
    for g, w in zip(jax.tree_util.tree_leaves(f(layers, bad)), jax.tree_util.tree_leaves(jax.jit(grad)(layers, bad))):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_array_equal(np.isinf(g), np.isinf(w))


def test_other_combines_left_alone():
    params, x = _data(16, "float32")
    grad = jax.grad(models.maxplus)
    f = hlopass.jit(grad, passes="adjoint")
    _close(f((params[0],), x), jax.jit(grad)((params[0],), x), "float32")
    assert _entries(f.trace((params[0],), x).report) == []
    a = jax.ShapeDtypeStruct((8, 4), jnp.float32)
    assert is_linear_combine(models.affine_combine, a, jax.ShapeDtypeStruct((8, 4, 2), jnp.float32))
    assert not is_linear_combine(lambda x, y: (x[0] * y[0], x[1] + y[1]), a, a)
    assert not is_linear_combine(lambda x, y: (x[0] * y[0], y[0] * x[1] ** 2 + y[1]), a, a)
    assert not is_linear_combine(models.affine_combine, jax.ShapeDtypeStruct((8, 4), jnp.int32), a)


def test_keeps_less_than_the_tree():
    params, x = _data(4096, "float32", P=8, N=16)
    grad = jax.grad(models.selective_parallel, (0, 1))
    plain = jax.jit(grad).lower(params, x).compile().memory_analysis().temp_size_in_bytes
    ours = hlopass.jit(grad, passes="adjoint").lower(params, x).compile().memory_analysis().temp_size_in_bytes
    assert ours < plain, (ours, plain)
