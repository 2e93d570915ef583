"""The GPU subset: ``pytest -m gpu`` on a machine with a GPU (not collected by the default run).

Each test runs a program of the benchmark at a size a GPU finishes in seconds, under settings that
make the passes fire, and compares it with ``jax.jit`` of the same program, or, where XLA's GPU
``top_k`` over long rows is itself wrong, with exact float64 neighbours. Run on an NVIDIA H200
with JAX 0.11.2 (``python -m pytest -m gpu tests/gpu``); the README's install section says when.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlopass
from hlopass import internals as jx

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True, scope="module")
def _on_a_gpu():
    if jax.default_backend() != "gpu":
        pytest.fail(f"the GPU subset needs a GPU; the default backend is {jax.default_backend()!r}")


def _temp(fn, *args) -> int:
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes


def _report(fn, *args) -> str:
    return str(fn.trace(*args).report)


def test_the_installed_jax_is_in_the_declared_range():
    import pathlib
    import tomllib
    pyproject = tomllib.loads((pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text())
    spec = next(d for d in pyproject["project"]["dependencies"] if d.startswith("jax>") or d.startswith("jax["))
    low, high = re.findall(r">=([\d.]+)", spec)[0], re.findall(r"<([\d.]+)", spec)[0]
    version = tuple(int(p) for p in jax.__version__.split(".")[:3])
    assert tuple(int(p) for p in low.split(".")) <= version < tuple(int(p) for p in high.split("."))


def test_knn_is_exact_and_small():
    from fixtures.knn import knn_l2
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1000, 3)).astype(np.float32)
    p = rng.standard_normal((200_003, 3)).astype(np.float32)
    f = hlopass.jit(lambda q, p: knn_l2(q, p, 10), threshold="64MB")
    dist, idx = f(q, p)
    assert "split" in _report(f, q, p)
    exact = np.sort(np.sum((q[:, None, :].astype(np.float64) - p[np.asarray(idx)].astype(np.float64)) ** 2, -1), 1)
    q64, p64 = q.astype(np.float64), p.astype(np.float64)
    full = np.sum(q64 ** 2, 1)[:, None] + np.sum(p64 ** 2, 1)[None] - 2 * q64 @ p64.T
    np.testing.assert_allclose(exact[:, -1], np.partition(full, 9, 1)[:, 9], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dist), np.sort(exact, 1), rtol=1e-4, atol=1e-5)
    assert _temp(f, q, p) < 3 * 64e6


def _x64(on: bool):
    return jax.enable_x64(on) if hasattr(jax, "enable_x64") else jax.experimental.enable_x64(on)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kernel_matvec_and_its_gradient_are_as_accurate_as_jax_jit(dtype):
    """float64: equal to jax.jit's; float32 (whose products XLA's GPU default precision rounds to
    TF32): as close to the float64 result as jax.jit's."""
    from fixtures.kernels import kernel_matvec
    rng = np.random.default_rng(1)
    x, y = (rng.standard_normal((20_011, 3)) for _ in range(2))
    v = rng.standard_normal(20_011)
    loss = lambda x, y, v: jnp.sum(kernel_matvec(x, y, v) ** 2)  # noqa: E731
    grad = jax.grad(loss, argnums=(0, 2))
    with _x64(True):
        exact = [np.asarray(g) for g in jax.jit(grad)(x, y, v)]
    with _x64(dtype == np.float64):
        args = [a.astype(dtype) for a in (x, y, v)]
        f = hlopass.jit(grad, threshold="32MB")
        got, plain = f(*args), jax.jit(grad)(*args)
        assert "split" in _report(f, *args)
        for a, b, e in zip(got, plain, exact):
            scale = float(np.max(np.abs(e)))
            err, err_plain = float(np.max(np.abs(np.asarray(a) - e))), float(np.max(np.abs(np.asarray(b) - e)))
            if dtype == np.float64:
                assert err <= 1e-10 * scale
            else:
                assert err <= 2 * err_plain + 1e-5 * scale, (err, err_plain, scale)
        assert _temp(f, *args) < _temp(jax.jit(grad), *args) / 4


def test_sgpr_bound_and_gradient_in_float64():
    from fixtures.gp import make_sgpr, sgpr_value_and_grad
    with _x64(True):
        args = make_sgpr(100_003, 101, 5)
        f = hlopass.jit(sgpr_value_and_grad, threshold="16MB")
        (value, grads), (value_ref, grads_ref) = f(*args), jax.jit(sgpr_value_and_grad)(*args)
        np.testing.assert_allclose(float(value), float(value_ref), rtol=1e-9)
        for a, b in zip(grads, grads_ref):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-8 * float(np.max(np.abs(b))))
        assert "split" in _report(f, *args)


def test_attention_loss_and_gradient():
    from fixtures.attention import attention_loss
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 2, 4096, 64)).astype(np.float32) for _ in range(3))
    grad = jax.value_and_grad(attention_loss, argnums=(0, 1, 2))
    f = hlopass.jit(grad, threshold="16MB")
    (val, gs), (val_ref, gs_ref) = f(q, k, v), jax.jit(grad)(q, k, v)
    np.testing.assert_allclose(float(val), float(val_ref), rtol=1e-4)
    for a, b in zip(gs, gs_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-3 * float(np.max(np.abs(b))))


def test_transformer_gradient_under_a_memory_limit():
    from tools.bench_remat import transformer_inputs, transformer_loss
    params, x = transformer_inputs(4, 128, 2048)
    grad = jax.jit(jax.grad(transformer_loss))
    plain = _temp(grad, params, x)
    f = hlopass.jit(jax.grad(transformer_loss), memory_limit=plain // 2)
    got, want = f(params, x), grad(params, x)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-3 * float(np.max(np.abs(b))))
    assert _temp(f, params, x) < plain


def test_meta_gradient_takes_the_hessian_products_forward_over_reverse():
    from fixtures.mixflow import toy_inputs, toy_task
    task = toy_task(M=4)
    args = toy_inputs(B=32, D=64, T=8)
    f = hlopass.jit(task)
    got, want = f(*args), jax.jit(task)(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-3, atol=1e-3 * float(np.max(np.abs(want))))
    assert "hvp" in _report(f, *args)


def test_composes_with_vmap_and_grad():
    from fixtures.kernels import kernel_matvec
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 5_003, 3)).astype(np.float32)
    y = rng.standard_normal((5_003, 3)).astype(np.float32)
    v = rng.standard_normal(5_003).astype(np.float32)
    f = hlopass.jit(lambda x: kernel_matvec(x, y, v), threshold="8MB")
    got = jax.vmap(jax.grad(lambda x: jnp.sum(f(x))))(x)
    want = jax.vmap(jax.grad(lambda x: jnp.sum(kernel_matvec(x, y, v))))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4 * float(np.max(np.abs(want))))


def test_bad_settings_are_clear_errors():
    with pytest.raises(hlopass.ConfigError, match="threshold"):
        hlopass.jit(lambda x: x, threshold="lots")
    with pytest.raises(hlopass.ConfigError, match="passes"):
        hlopass.jit(lambda x: x, passes="split,no_such_pass")


def test_the_door_finds_this_jax_s_forms():
    closed = jax.make_jaxpr(lambda x: [jnp.sin(x) * x])(jnp.ones(3))
    primal, num_res, nzs, in_fwd, tangent = jx.linearize_jaxpr(closed, [True], is_vjp=True)
    assert isinstance(num_res, int) and list(nzs) == [True]
    assert jx.JAXPRS_CARRY_CONSTS == (jx.ClosedJaxpr is jx.Jaxpr)
