"""The split pass's accelerator steps (``SplitOptions.accelerator_steps``), forced on the CPU.

On a GPU a step is sized by its largest value alone and a product with a thin operand is bound as a
multiply and a sum (so XLA fuses it with what computes the other operand). The speed is the GPU's
(``tools/bench_gpu.py``); here the numbers must equal ``jax.jit``'s, with the fused sums in use.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlopass
from fixtures.kernels import kernel_matvec
from fixtures.knn import knn_l2
from hlopass.passes.split import SplitPass

emit = importlib.import_module("hlopass.passes.split.emit")


def passes(accelerator: bool):
    return ["hvp", "algebraic", "matrix_chain", SplitPass(accelerator_steps=accelerator), "remat"]


@pytest.fixture
def fused_sums(monkeypatch):
    """Whether each step's product was bound as a fused sum (True) or left a product (False)."""
    seen = []
    original = emit._thin_dot_as_sum

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append(out is not None)
        return out
    monkeypatch.setattr(emit, "_thin_dot_as_sum", spy)
    return seen


def _inputs(n, dtype, columns=1):
    rng = np.random.default_rng(n)
    x, y = (rng.standard_normal((n, 3)).astype(dtype) for _ in range(2))
    v = rng.standard_normal((n, columns) if columns > 1 else n).astype(dtype)
    return x, y, v


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("columns", [1, 3])
def test_kernel_matvec_value_and_gradient(dtype, columns, fused_sums):
    """float64: equal to jax.jit; float32: as close to the float64 result as jax.jit (sums of 5,003
    terms in another order)."""
    x, y, v = _inputs(5003, dtype, columns)   # a prime: the last step is shorter
    grad = jax.value_and_grad(lambda x, y, v: jnp.sum(jnp.sin(kernel_matvec(x, y, v))), argnums=(0, 1, 2))
    with jax.enable_x64(True):
        exact = [np.asarray(a) for a in jax.tree.leaves(jax.jit(grad)(*(a.astype(np.float64) for a in (x, y, v))))]
    with jax.enable_x64(dtype == np.float64):
        f = hlopass.jit(grad, threshold="16MB", passes=passes(True))
        got, want = f(x, y, v), jax.jit(grad)(x, y, v)
        assert "split" in str(f.trace(x, y, v).report)
    for a, b, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), exact):
        scale = float(np.max(np.abs(e)))
        err, err_jit = (float(np.max(np.abs(np.asarray(z, np.float64) - e))) for z in (a, b))
        if dtype == np.float64:
            assert err <= 1e-11 * scale
        else:
            assert err <= 4 * err_jit + 1e-6 * scale, (err, err_jit, scale)
    assert any(fused_sums), "no step bound a product as a fused sum"


def test_steps_are_sized_by_their_largest_value():
    x, y, v = _inputs(5003, np.float32)
    steps = {}
    for accelerator in (False, True):
        report = hlopass.jit(kernel_matvec, threshold="16MB", passes=passes(accelerator)).trace(x, y, v).report
        (rewrite,) = [r for p in report.passes if p.name == "split" for r in p.rewrites]
        steps[accelerator] = rewrite.summary
    assert steps[True] != steps[False]
    # 16 MB over rows of 5,003 floats: 799 rows fit; the CPU's live-set estimate takes fewer
    assert "iterations of 715" in steps[True] or "iterations of 7" in steps[True], steps[True]


def test_knn_indices_equal_jax_jit(fused_sums):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((301, 3)).astype(np.float32)
    p = rng.standard_normal((20_011, 3)).astype(np.float32)
    knn = lambda q, p: knn_l2(q, p, 5)  # noqa: E731
    got = hlopass.jit(knn, threshold="4MB", passes=passes(True))(q, p)
    want = jax.jit(knn)(q, p)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)


def test_thin_product_shapes():
    """Vectors and thin matrices on either side, batch dimensions, contracting dimensions first or last."""
    rng = np.random.default_rng(4)
    cases = [
        ((2048, 600), (600,), (((1,), (0,)), ((), ()))),           # matrix @ vector
        ((600,), (600, 2048), (((0,), (0,)), ((), ()))),           # vector @ matrix
        ((2048, 600), (600, 3), (((1,), (0,)), ((), ()))),         # matrix @ thin matrix
        ((3, 600), (2048, 600), (((1,), (1,)), ((), ()))),         # thin @ matrix.T
        ((2, 1024, 600), (2, 600, 2), (((2,), (1,)), ((0,), (0,)))),  # batched
    ]
    for lshape, rshape, dims in cases:
        lhs, rhs = rng.standard_normal(lshape).astype(np.float32), rng.standard_normal(rshape).astype(np.float32)
        fused = emit._thin_dot_as_sum([lhs, rhs], {"dimension_numbers": dims})
        assert fused is not None, (lshape, rshape)
        want = jax.lax.dot_general(lhs, rhs, dims, precision=jax.lax.Precision.HIGHEST)
        np.testing.assert_allclose(np.asarray(fused), np.asarray(want), rtol=1e-4, atol=1e-3)
    wide = emit._thin_dot_as_sum([np.ones((512, 600), np.float32), np.ones((600, 512), np.float32)],
                                 {"dimension_numbers": (((1,), (0,)), ((), ()))})
    assert wide is None  # neither operand is thin: a matrix product stays one


def test_short_contraction_products():
    """A product over a few coordinates (the cross term of squared distances) as broadcast products."""
    rng = np.random.default_rng(5)
    cases = [
        ((2048, 3), (600, 3), (((1,), (1,)), ((), ()))),              # x @ y.T, d = 3
        ((3, 2048), (3, 600), (((0,), (0,)), ((), ()))),              # contracting first
        ((2, 1024, 5), (2, 700, 5), (((2,), (2,)), ((0,), (0,)))),    # batched
        ((1024, 2, 2), (2, 2, 1100), (((1, 2), (0, 1)), ((), ()))),   # two contracting dimensions
        ((1024, 1), (1, 1100), (((1,), (0,)), ((), ()))),             # an outer product
    ]
    for lshape, rshape, dims in cases:
        lhs, rhs = rng.standard_normal(lshape).astype(np.float32), rng.standard_normal(rshape).astype(np.float32)
        fused = emit._thin_dot_as_sum([lhs, rhs], {"dimension_numbers": dims})
        assert fused is not None, (lshape, rshape)
        want = jax.lax.dot_general(lhs, rhs, dims, precision=jax.lax.Precision.HIGHEST)
        assert fused.shape == want.shape
        np.testing.assert_allclose(np.asarray(fused), np.asarray(want), rtol=1e-5, atol=1e-5)
    nine = emit._thin_dot_as_sum([np.ones((2048, 9), np.float32), np.ones((600, 9), np.float32)],
                                 {"dimension_numbers": (((1,), (1,)), ((), ()))})
    assert nine is None  # nine coordinates: a matrix product


def test_steps_sized_by_what_they_build_after_unrolling():
    """Without the algebraic pass a step builds ``x[:, None] - y[None]`` one coordinate at a time
    (the short reduction is unrolled), so its largest value is a row of the kernel, not three."""
    x, y, v = _inputs(5003, np.float32)
    report = hlopass.jit(kernel_matvec, threshold="16MB",
                         passes=[SplitPass(accelerator_steps=True, step_cache_bytes=0)]).trace(x, y, v).report
    (rewrite,) = [r for p in report.passes if p.name == "split" for r in p.rewrites if r.kind != "unrolled"]
    # 16 MB holds 799 kernel rows: 7 steps of 715; sized by the (.., 3) value, 19 steps of 264
    assert "7 iterations of 715" in rewrite.summary, rewrite.summary
    assert any(r.kind == "unrolled" for p in report.passes for r in p.rewrites)
    got = hlopass.jit(kernel_matvec, threshold="16MB",
                      passes=[SplitPass(accelerator_steps=True, step_cache_bytes=0)])(x, y, v)
    with jax.enable_x64(True):
        exact = np.asarray(jax.jit(kernel_matvec)(*(a.astype(np.float64) for a in (x, y, v))))
    err_jit = np.max(np.abs(np.asarray(jax.jit(kernel_matvec)(x, y, v), np.float64) - exact))
    assert np.max(np.abs(np.asarray(got, np.float64) - exact)) <= 4 * err_jit + 1e-6 * np.max(np.abs(exact))


@pytest.mark.parametrize("per_iteration", [3, 64])
def test_several_steps_per_iteration(per_iteration):
    """``accelerator_steps_per_iteration``: the loop's body runs that many steps (more than the loop
    has, too); a prime length leaves a shorter last step."""
    x, y, v = _inputs(5003, np.float64)
    options = SplitPass(accelerator_steps=True, step_cache_bytes=0, accelerator_steps_per_iteration=per_iteration)
    grad = jax.grad(lambda x, y, v: jnp.sum(jnp.sin(kernel_matvec(x, y, v))), argnums=(0, 1, 2))
    with jax.enable_x64(True):
        f = hlopass.jit(grad, threshold="16MB", passes=["algebraic", options])
        text = str(f.trace(x, y, v).rewritten_jaxpr)
        got, want = f(x, y, v), jax.jit(grad)(x, y, v)
    assert f"unroll={per_iteration if per_iteration == 3 else 2}" in text   # 16 MB steps: 2 full ones
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-10 * float(np.max(np.abs(b))))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sibling_products_bound_as_one(dtype, monkeypatch):
    """A kernel mat-vec's gradient in ``x`` reads each kernel block twice, times the vector and times
    the points: one product with both side by side, equal to ``jax.jit``'s."""
    calls = []
    original = emit._merged_thin_dots
    monkeypatch.setattr(emit, "_merged_thin_dots", lambda *a: calls.append(len(a[2])) or original(*a))
    x, y, v = _inputs(3001, dtype)
    grad = jax.grad(lambda x, y, v: jnp.sum(jnp.cos(kernel_matvec(x, y, v))))
    with jax.enable_x64(dtype == np.float64):
        got = hlopass.jit(grad, threshold="4MB", passes=passes(True))(x, y, v)
        want = jax.jit(grad)(x, y, v)
    assert calls and all(n >= 2 for n in calls), calls
    tol = 1e-10 if dtype == np.float64 else 2e-4
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol * float(np.max(np.abs(want))))


def test_merged_thin_products_shapes():
    """Thin operands on either side, vectors and thin matrices, taken apart in each product's layout."""
    rng = np.random.default_rng(6)
    large = rng.standard_normal((40, 700)).astype(np.float64)
    vec, cols, rows = rng.standard_normal(700), rng.standard_normal((700, 3)), rng.standard_normal((2, 700))
    parts = [(vec, (0,), True, np.float64), (cols, (0,), True, np.float64), (rows, (1,), False, np.float64)]
    with jax.enable_x64(True):
        got = emit._merged_thin_dots(large, (1,), parts)
    for g, want in zip(got, [large @ vec, large @ cols, rows @ large.T]):
        np.testing.assert_allclose(np.asarray(g), want, rtol=1e-12, atol=1e-12)
