"""When no pass rewrites anything, XLA gets the user's program itself: outputs bit-identical to
``jax.jit``'s (bfloat16, float16, float32), with the default pipeline and each pass alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlopass
from hlopass.pipeline import run_pipeline

inner = jax.jit(lambda y: jnp.exp(y) * 0.1 + y)

PROGRAMS = {
    "nested_jit_sum": lambda x: inner(x).sum(1),
    "nested_jit_chain": lambda x: jax.jit(lambda z: jnp.tanh(inner(z)) / 3)(x) + x,
    "softplus_sum": lambda x: jax.nn.softplus(x).sum(0),
    "logsumexp": lambda x: jax.nn.logsumexp(x, 1),
    "checkpoint": lambda x: jax.checkpoint(lambda y: jnp.sin(y) * y)(x).max(0),  # a sum of products is a contraction
    "variance": lambda x: jnp.var(x, 1),
    "normalize": lambda x: (x - x.mean(0)) / (x.std(0) + 1e-3),
    "cumsum_then_nested": lambda x: inner(jnp.cumsum(x, 0)),
    "scan": lambda x: jax.lax.scan(lambda c, r: (c * 0.5 + jnp.cos(r), c.sum()), x[0], x)[1],
    "softmax_matmul": lambda x: jax.nn.softmax(x, -1) @ x.T,
}
DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]


def _bits(tree):
    return [np.asarray(leaf).view(np.uint8 if np.asarray(leaf).dtype.itemsize == 1 else
                                  {2: np.uint16, 4: np.uint32, 8: np.uint64}[np.asarray(leaf).dtype.itemsize])
            for leaf in jax.tree.leaves(tree)]


CASES = [(name, dtype, "default") for name in PROGRAMS for dtype in DTYPES] + \
    [(name, jnp.bfloat16, "algebraic") for name in PROGRAMS]


@pytest.mark.parametrize("name, dtype, passes", CASES,
                         ids=[f"{n}-{jnp.dtype(d).name}-{p}" for n, d, p in CASES])
def test_bit_identical_when_no_rewrite_fires(name, dtype, passes):
    fun = PROGRAMS[name]
    x = jnp.asarray(np.random.default_rng(0).normal(size=(37, 23)), dtype)
    h = hlopass.jit(fun, passes=passes)  # default threshold: nothing here is a split candidate
    traced = h.trace(x)
    assert not traced.report.rewrites, "a program of this test was rewritten: choose one no pass rewrites"
    assert traced.rewritten_jaxpr is traced.original_jaxpr  # the user's program itself, not a re-trace
    for got, want in zip(_bits(h(x)), _bits(jax.jit(fun)(x))):
        np.testing.assert_array_equal(got, want)


def test_nothing_rewritten_returns_the_original_object():
    closed = jax.make_jaxpr(lambda x: inner(inner(x)).sum())(jnp.ones(3))
    for passes in ("default", "none"):
        result = run_pipeline(closed, hlopass.resolve_config({"passes": passes}))
        assert result.jaxpr is closed and not result.changed and result.report.equations_after == \
            result.report.equations_before
