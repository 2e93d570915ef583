"""The algebraic pass on products: broadcast-multiply-reduce, diag/trace/sum of a matrix product."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.passes.algebraic.test_algebraic import (D, M, N, algebraic, assert_close, big, check_values_and_grads, kinds,
                                  normal, precision, stablehlo_max_bytes)

# -- broadcast-multiply-reduce becomes a dot_general ---------------------------------------------

CONTRACTIONS = {
    "last_axis": (lambda x, y: (x[:, None, :] * y[None, :, :]).sum(-1), ((N, D), (M, D)), (N, M, D)),
    "commuted": (lambda x, y: jnp.sum(y[None, :, :] * x[:, None, :], axis=2), ((N, D), (M, D)), (N, M, D)),
    "transposed": (lambda x, y: (x.T[:, :, None] * y.T[:, None, :]).sum(0), ((N, D), (M, D)), (D, N, M)),
    "batched": (lambda x, y: (x[:, :, None, :] * y[:, None, :, :]).sum(-1), ((3, N, D), (3, M, D)), (3, N, M, D)),
    "middle_axis": (lambda x, y: (x[:, :, None] * y[None, :, :]).sum(1), ((N, D), (D, M)), (N, D, M)),
}


@pytest.mark.parametrize("name,dtype", [(name, "float32") for name in sorted(CONTRACTIONS)] +
                         [("batched", "float64"), ("middle_axis", "float64")])
def test_broadcast_multiply_reduce_becomes_dot_general(name, dtype):
    fun, shapes, big_shape = CONTRACTIONS[name]
    with precision(dtype):
        args = tuple(normal(i, s, dtype) for i, s in enumerate(shapes))
        compiled = check_values_and_grads(fun, args, big_bytes=big(dtype, *big_shape))
        assert kinds(compiled, *args) == ["contraction"]
        assert "stablehlo.dot_general" in compiled.lower(*args).as_text()


# -- products whose result is only partly used ---------------------------------------------------

PRODUCT_SHAPES = {"square": ((23, 23), (23, 23)), "rectangular": ((29, 5), (5, 29))}


@pytest.mark.parametrize("shapes,dtype", [("square", "float32"), ("rectangular", "float64")])
@pytest.mark.parametrize("kind,fun", [
    ("diagonal_of_product", lambda a, b: jnp.diag(a @ b)),
    ("diagonal_of_product", lambda a, b: jnp.diagonal(a @ b)),
    ("trace_of_product", lambda a, b: jnp.trace(a @ b)),
    ("trace_of_product", lambda a, b: jnp.sum(jnp.eye(a.shape[0], dtype=a.dtype) * (a @ b))),
    ("trace_of_product", lambda a, b: jnp.sum(jnp.where(jnp.eye(a.shape[0], dtype=bool), a @ b, 0))),
])
def test_diag_and_trace_skip_the_product(kind, fun, shapes, dtype):
    with precision(dtype):
        a, b = (normal(i, s, dtype) for i, s in enumerate(PRODUCT_SHAPES[shapes]))
        n = a.shape[0]
        compiled = check_values_and_grads(fun, (a, b), threshold="1kB")
        assert kinds(compiled, a, b) == [kind]
        assert stablehlo_max_bytes(compiled, a, b) < big(dtype, n, n)
        assert stablehlo_max_bytes(jax.jit(fun), a, b) >= big(dtype, n, n)


@pytest.mark.parametrize("axis,dtype", [(0, "float32"), (1, "float64")])
def test_sum_of_product_along_an_axis(axis, dtype):
    fun = lambda a, b: jnp.sum(a @ b, axis=axis)  # noqa: E731
    with precision(dtype):
        a, b = normal(0, (29, 5), dtype), normal(1, (5, 31), dtype)
        compiled = check_values_and_grads(fun, (a, b), threshold="1kB")
        assert kinds(compiled, a, b) == ["sum_of_product"]
        assert stablehlo_max_bytes(compiled, a, b) < big(dtype, 29, 31)


def test_sum_of_product_is_left_to_matrix_chain_when_it_runs():
    a, b = normal(0, (29, 5), jnp.float32), normal(1, (5, 31), jnp.float32)
    import hlopass
    report = hlopass.jit(lambda a, b: jnp.sum(a @ b, 0), passes="algebraic,matrix_chain",
                         threshold="1kB").trace(a, b).report
    assert not [r for r in report.rewrites if r.pass_name == "algebraic"]
    assert any("matrix_chain" in s.reason for s in report.skipped)


# -- look-alikes ---------------------------------------------------------------------------------

def test_offset_diagonal_and_max_of_product_do_not_fire():
    a, b = normal(0, (N, N), jnp.float32), normal(1, (N, N), jnp.float32)
    for fun in (lambda a, b: jnp.diagonal(a @ b, offset=1), lambda a, b: jnp.max(a @ b, axis=0),
                lambda a, b: (a @ b) * jnp.eye(N)):
        compiled = algebraic(fun, threshold="100B")
        assert compiled.trace(a, b).report.rewrites == []
        np.testing.assert_array_equal(compiled(a, b), jax.jit(fun)(a, b))


def test_plain_matrix_product_is_not_touched():
    a, b = normal(0, (N, 5), jnp.float32), normal(1, (5, M), jnp.float32)
    assert algebraic(lambda a, b: a @ b, threshold="off").trace(a, b).report.rewrites == []
    x = normal(2, (N, D), jnp.float32)
    assert algebraic(lambda x: jnp.sum(x * x, -1), threshold="off").trace(x).report.rewrites == []
    assert_close(algebraic(lambda x: jnp.sum(x * x, -1), threshold="off")(x), jnp.sum(x * x, -1))


def test_residual_mlp_is_not_reassociated():
    """``(x + h @ W) @ V`` reads tensors as large as the product it would skip: nothing to gain."""
    fun = lambda x, h, w, v: (x + h @ w) @ v  # noqa: E731
    args = (normal(0, (N, D), jnp.float32), normal(1, (N, D), jnp.float32), normal(2, (D, D), jnp.float32),
            normal(3, (D, 5), jnp.float32))
    assert algebraic(fun, threshold="off").trace(*args).report.rewrites == []
