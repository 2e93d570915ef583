"""The algebraic pass sees through calls as if their bodies were written inline (issue 13): a
``custom_jvp``/``custom_vjp`` function whose body holds part of the pattern (it used to stop at "a value
inside a sub-jaxpr is not readable outside it"), a library's squared distance whose readers are
outside it, and a nested ``jit`` that receives the cost matrix as an argument inside a loop.
Values and gradients against ``jax.jit`` of the unrewritten program, float32 and float64, odd sizes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hlopass.stablehlo import max_tensor_bytes
from tests.passes.algebraic.test_algebraic import (DTYPES, algebraic, assert_close, big, check_values_and_grads, kinds,
                                                   normal, precision, stablehlo_max_bytes)

N, M, D = 13, 11, 7


@jax.custom_jvp
def warped_difference(x, y):
    """``tanh(x)[:, None] - tanh(y)[None]``: the warp (a leaf) is inside the custom_jvp body."""
    return jnp.tanh(x)[:, None] - jnp.tanh(y)[None]


@warped_difference.defjvp
def _warped_difference_jvp(primals, tangents):
    (x, y), (tx, ty) = primals, tangents
    gx, gy = tx * (1 - jnp.tanh(x) ** 2), ty * (1 - jnp.tanh(y) ** 2)
    return warped_difference(x, y), gx[:, None] - gy[None]


@jax.custom_vjp
def warped_difference_vjp(x, y):
    return jnp.tanh(x)[:, None] - jnp.tanh(y)[None]


def _fwd(x, y):
    return warped_difference_vjp(x, y), (x, y)


def _bwd(res, g):
    x, y = res
    return g.sum(1) * (1 - jnp.tanh(x) ** 2), -g.sum(0) * (1 - jnp.tanh(y) ** 2)


warped_difference_vjp.defvjp(_fwd, _bwd)


@pytest.mark.parametrize("call", [warped_difference, warped_difference_vjp], ids=["custom_jvp", "custom_vjp"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_pattern_inside_a_custom_derivative_call(call, dtype):
    fun = lambda x, y, v: jnp.exp(-jnp.sum(call(x, y) ** 2, -1)) @ v  # noqa: E731
    with precision(dtype):
        args = normal(0, (N, D), dtype), normal(1, (M, D), dtype), normal(2, (M,), dtype)
        compiled = check_values_and_grads(fun, args)
        assert kinds(compiled, *args) == ["squared_distance"]
        report = compiled.trace(*args).report
        assert not any("not readable" in s.reason for s in report.skipped)
        assert stablehlo_max_bytes(compiled, *args) < big(dtype, N, M, D)


@jax.custom_jvp
def library_squared_distance(x, y):
    """A library's squared distance with its own derivative rule (the rule is what jax.grad uses)."""
    return jnp.sum((x[:, None] - y[None]) ** 2, -1)


@library_squared_distance.defjvp
def _library_jvp(primals, tangents):
    (x, y), (tx, ty) = primals, tangents
    diff = x[:, None] - y[None]
    return library_squared_distance(x, y), 2 * jnp.sum(diff * (tx[:, None] - ty[None]), -1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_library_squared_distance_is_rewritten_for_a_kernel(dtype):
    fun = lambda x, y, v: jnp.exp(-0.5 * library_squared_distance(x, y)) @ v  # noqa: E731
    with precision(dtype):
        args = normal(0, (N, D), dtype), normal(1, (M, D), dtype), normal(2, (M,), dtype)
        compiled = check_values_and_grads(fun, args, big_bytes=big(dtype, N, M, D))
        assert "squared_distance" in kinds(compiled, *args)


def test_library_squared_distance_under_sqrt_outside_the_call_is_left_as_written():
    """The reader of the call's result (a sqrt) is outside the call: it is seen."""
    fun = lambda x, y: jnp.sqrt(library_squared_distance(x, y))  # noqa: E731
    x, y = normal(0, (N, D), jnp.float32), normal(1, (M, D), jnp.float32)
    compiled = algebraic(fun)
    report = compiled.trace(x, y).report
    assert report.rewrites == [] and any("square root" in s.reason for s in report.skipped)
    np.testing.assert_array_equal(compiled(x, y), jax.jit(fun)(x, y))


@jax.jit
def _logsumexp_rows(cost, potential, eps):
    """A nested jit that receives the cost matrix as an argument."""
    return eps * jax.nn.logsumexp((potential[None, :] - cost) / eps, axis=1)


def sinkhorn(x, y, eps=0.5, iterations=5):
    """Log-domain Sinkhorn potentials, the squared-Euclidean cost recomputed inside the loop."""
    def step(_, fg):
        f, g = fg
        cost = jnp.sum((x[:, None] - y[None]) ** 2, -1)
        f = -_logsumexp_rows(cost, g, eps)
        g = -_logsumexp_rows(cost.T, f, eps)
        return f, g
    zeros = (jnp.zeros(x.shape[0], x.dtype), jnp.zeros(y.shape[0], y.dtype))
    f, g = jax.lax.fori_loop(0, iterations, step, zeros)
    return jnp.sum(f) + jnp.sum(g)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cost_matrix_handed_to_a_nested_jit_inside_a_loop(dtype):
    with precision(dtype):
        x, y = normal(0, (N, D), dtype), 0.5 * normal(1, (M, D), dtype)
        compiled = algebraic(sinkhorn)
        assert kinds(compiled, x, y) == ["squared_distance"]
        assert_close(compiled(x, y), jax.jit(sinkhorn)(x, y))
        assert_close(jax.jit(jax.grad(compiled, (0, 1)))(x, y)[0], jax.jit(jax.grad(sinkhorn, (0, 1)))(x, y)[0])
        # anywhere, loop bodies included (JAX 0.11 lowers the loop's nested jit inside the body)
        anywhere = lambda f: max_tensor_bytes(f.lower(x, y).compiler_ir("stablehlo"), outside_loops=False)  # noqa: E731
        assert anywhere(compiled) < big(dtype, N, M, D) <= anywhere(jax.jit(sinkhorn))
