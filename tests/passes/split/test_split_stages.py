"""How the split stages a value read before and after a reduction (``recompute.py``): one loop per
pass the arithmetic needs, not one per reduction.

A Transformer block's attention ``softmax(q kᵀ) v`` reduces each row (its maximum, its sum) and
then reads the row again: split along the rows, that is one pass. Its gradient reads the same
probabilities again in the backward pass, after every later layer: that is a second pass, with its
own copy of the probabilities. So two stacked blocks split into three loops: the first block's
forward pass, the last block's forward and backward passes (nothing lies between them), and the
first block's backward pass.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.passes.split.helpers import assert_close, largest_tensor, split_jit, split_rewrites, tolerances
from tools.bench_remat import transformer_loss   # pre-norm single-head blocks in a Python loop


def _inputs(layers: int, seq: int, width: int, dtype):
    rng = np.random.default_rng(0)
    shapes = [(width, width)] * 4 + [(width, 2 * width), (2 * width, width)]
    params = [tuple(jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), dtype) for s in shapes)
              for _ in range(layers)]
    return params, jnp.asarray(rng.standard_normal((seq, width)), dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_stacked_attention_splits_into_one_loop_per_pass(dtype):
    seq, width = 127, 16   # a prime number of rows: the loops end on a remainder step
    with jax.enable_x64(dtype == np.float64):
        params, x = _inputs(2, seq, width, dtype)
        threshold = int(0.6 * seq * seq * np.dtype(dtype).itemsize)   # each attention matrix is over it
        grad = jax.grad(transformer_loss)
        lowered = split_jit(grad, threshold).lower(params, x)
        done = split_rewrites(lowered.report)
        assert len(done) == 3, lowered.report
        assert largest_tensor(lowered) <= 1.5 * threshold, lowered.report
        assert_close(lowered.compile()(params, x), jax.jit(grad)(params, x), **tolerances(dtype))
