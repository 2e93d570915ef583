"""A real client: tinygp spells the squared distance naively; under hlopass the n x n x d tensor is gone."""

from __future__ import annotations

import jax
import pytest

from tests.passes.algebraic.test_algebraic import (algebraic, assert_close, big, check_values_and_grads, kinds, normal, precision,
                                  stablehlo_max_bytes)

import tinygp

N, D = 31, 5


KERNELS = {
    "plain": lambda: tinygp.kernels.ExpSquared(),
    "scaled": lambda: 1.7 * tinygp.kernels.ExpSquared(scale=0.8),
    "sum_of_two": lambda: tinygp.kernels.ExpSquared(scale=0.8) + tinygp.kernels.ExpSquared(scale=2.5),
}


@pytest.mark.parametrize("kernel,dtype", [("plain", "float32"), ("plain", "float64"), ("scaled", "float32"),
                                          ("sum_of_two", "float64")])
def test_exp_squared_matvec_loses_its_n_n_d_tensor(kernel, dtype):
    def kernel_matvec(x, v):
        return KERNELS[kernel]()(x, x) @ v

    with precision(dtype):
        x, v = normal(0, (N, D), dtype), normal(1, (N,), dtype)
        compiled = check_values_and_grads(kernel_matvec, (x, v), big_bytes=big(dtype, N, N, D))
        assert set(kinds(compiled, x, v)) == {"squared_distance"}


@pytest.mark.slow
def test_gp_log_likelihood_matches():
    """A whole tinygp GaussianProcess: same log-likelihood and gradient, no n x n x d tensor."""
    def loglik(x, y):
        gp = tinygp.GaussianProcess(tinygp.kernels.ExpSquared(scale=1.3), x, diag=0.1)
        return gp.log_probability(y)

    x, y = normal(0, (N, D), "float32"), normal(1, (N,), "float32")
    compiled = algebraic(loglik)
    assert_close(compiled(x, y), jax.jit(loglik)(x, y))
    assert_close(jax.grad(compiled)(x, y), jax.jit(jax.grad(loglik))(x, y))
    assert "squared_distance" in kinds(compiled, x, y)
    assert stablehlo_max_bytes(compiled, x, y) < big("float32", N, N, D)
