"""Shared checks of the split tests: the split fired, tensors stay bounded, values and gradients
equal ``jax.jit`` of the original."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import hlopass
from hlopass import stablehlo


def split_jit(fn, threshold, split_size=None, passes="split"):
    kw = {} if passes is None else {"passes": passes}
    return hlopass.jit(fn, threshold=threshold, split_size=split_size or threshold, **kw)


def split_rewrites(report) -> list:
    return [r for r in report.rewrites if r.pass_name == "split" and r.kind == "split"]


def largest_tensor(lowered) -> int:
    """The largest op result anywhere in the lowered module (loop bodies included), not counting
    loops' carried state (their inputs passed through)."""
    return stablehlo.max_tensor_bytes(lowered.compiler_ir("stablehlo"), outside_loops=False, loop_results=False)


def io_bytes(args, outs) -> int:
    return max(int(np.asarray(a).nbytes) for a in jax.tree_util.tree_leaves((args, outs)))


def tolerances(dtype) -> dict:
    if jnp.dtype(dtype) == jnp.float64:
        return dict(rtol=1e-10, atol=1e-10)
    return dict(rtol=2e-4, atol=2e-4)


def assert_close(got, want, rtol, atol):
    """Relative to the largest magnitude of each result (sums reorder)."""
    def one(g, w):
        g, w = np.asarray(g), np.asarray(w)
        if w.dtype.kind in "iub":
            np.testing.assert_array_equal(g, w)
        else:
            scale = float(np.nanmax(np.abs(w.astype(np.float64)), initial=1.0))
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol * scale)
    jax.tree_util.tree_map(one, got, want)


def check(fn, *args, threshold, bound=1.5, grad_argnums=(), rtol=None, atol=None, min_splits=1):
    """The split fired (at least ``min_splits`` times), no tensor of the lowered program exceeds
    ``bound`` times the split size (arguments and results aside), values equal ``jax.jit``; with
    ``grad_argnums``, so do gradients of a fixed linear functional, JAX differentiating *through*
    the hlopass function (its backward program split too)."""
    dtype = next(a.dtype for a in jax.tree_util.tree_leaves(args) if jnp.issubdtype(a.dtype, jnp.floating))
    tol = tolerances(dtype)
    rtol, atol = rtol or tol["rtol"], atol or tol["atol"]
    f = split_jit(fn, threshold)
    lowered = f.lower(*args)
    done = split_rewrites(lowered.report)
    assert len(done) >= min_splits, lowered.report
    want = jax.jit(fn)(*args)
    limit = max(bound * hlopass.sizes.parse_size(threshold, "threshold"), io_bytes(args, want))
    assert largest_tensor(lowered) <= limit, (largest_tensor(lowered), limit, str(lowered.report))
    assert_close(lowered.compile()(*args), want, rtol, atol)
    if grad_argnums:
        def loss(g):
            def scalar(*a):
                outs = jax.tree_util.tree_leaves(g(*a))
                return sum(jnp.sum(o * jnp.cos(jnp.arange(o.size, dtype=o.dtype).reshape(o.shape)))
                           for o in outs if jnp.issubdtype(o.dtype, jnp.floating))
            return scalar
        got = jax.jit(jax.grad(loss(f), argnums=grad_argnums))(*args)
        assert_close(got, jax.jit(jax.grad(loss(fn), argnums=grad_argnums))(*args), rtol, atol)
    return done


def backward_rewrites(fn, threshold, *args, argnums=0) -> list:
    """Split rewrites made in the programs JAX derives when differentiating through ``fn``'s hlopass
    version (its backward program above all)."""
    f = split_jit(fn, threshold)
    grad = jax.grad(lambda *a: jnp.sum(jnp.asarray(jax.tree_util.tree_leaves(f(*a))[0])), argnums=argnums)
    return [r for report in hlopass.reports(grad, *args) if report.label.startswith("transpose(")
            for r in split_rewrites(report)]
