"""``hlopass.jit`` behaves like ``jax.jit``: call semantics, caching, AOT stages, transformations."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlopass
from tests import programs
from tests.core import retrace_pass  # noqa: F401  (registers the test_retrace pass)

IDENTITY_PIPELINES = ("none", "test_retrace")


def assert_trees_equal(a, b, exact=True, rtol=1e-6):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        if exact:
            np.testing.assert_array_equal(x, y)
        else:
            np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("passes", IDENTITY_PIPELINES)
@pytest.mark.parametrize("name, fun, args", programs.zoo(), ids=[z[0] for z in programs.zoo()])
def test_identity_pipeline_is_bit_identical(name, fun, args, passes):
    assert_trees_equal(hlopass.jit(fun, passes=passes)(*args), jax.jit(fun)(*args))


DIFF = [z for z in programs.zoo() if z[0] in ("pytree", "scan", "fori", "cond", "custom_jvp", "custom_vjp",
                                               "checkpoint", "nested_jit")]


def _scalar(fun):
    return lambda *args: sum(jnp.sum(leaf) for leaf in jax.tree.leaves(fun(*args)))


@pytest.mark.parametrize("passes", IDENTITY_PIPELINES)
@pytest.mark.parametrize("name, fun, args", DIFF, ids=[z[0] for z in DIFF])
def test_grad_jvp_vmap_match_jax(name, fun, args, passes):
    hfun = hlopass.jit(fun, passes=passes)
    argnums = tuple(range(len(args)))
    assert_trees_equal(jax.grad(_scalar(hfun), argnums)(*args), jax.grad(_scalar(jax.jit(fun)), argnums)(*args),
                       exact=False)
    tangents = jax.tree.map(lambda a: jnp.ones_like(a) * 0.3, args)
    if name == "custom_vjp":  # JAX itself refuses forward mode here; so must we
        for f in (hfun, jax.jit(fun)):
            with pytest.raises(TypeError, match="custom_vjp"):
                jax.jvp(f, args, tangents)
    else:
        assert_trees_equal(jax.jvp(hfun, args, tangents), jax.jvp(jax.jit(fun), args, tangents), exact=False)
    batched = jax.tree.map(lambda a: jnp.stack([a, a * 0.5 + 0.1]), args)
    assert_trees_equal(jax.vmap(hfun)(*batched), jax.vmap(jax.jit(fun))(*batched), exact=False)


def test_vjp_value_and_grad_and_second_order():
    f = lambda x: jnp.sum(jnp.sin(x) ** 3)  # noqa: E731
    h = hlopass.jit(f, passes="test_retrace")
    x = jnp.linspace(-0.3, 1.0, 11)
    out, pullback = jax.vjp(h, x)
    ref_out, ref_pullback = jax.vjp(f, x)
    np.testing.assert_allclose(out, ref_out, rtol=1e-6)
    np.testing.assert_allclose(pullback(1.0)[0], ref_pullback(1.0)[0], rtol=1e-6)
    value, grad = jax.value_and_grad(h)(x)
    np.testing.assert_allclose(grad, jax.grad(f)(x), rtol=1e-6)
    np.testing.assert_allclose(jax.hessian(h)(x), jax.hessian(f)(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.jacfwd(jax.grad(h))(x), jax.hessian(f)(x), rtol=1e-5, atol=1e-6)


def test_inside_jax_jit_and_jax_jit_inside():
    inner = hlopass.jit(lambda v: jnp.exp(v) * 2.0, passes="test_retrace")
    outer = jax.jit(lambda v: inner(v) + inner(v * 2))
    x = jnp.arange(5.0)
    np.testing.assert_allclose(outer(x), jnp.exp(x) * 2 + jnp.exp(2 * x) * 2, rtol=1e-6)
    wrapped = hlopass.jit(lambda v: jax.jit(jnp.cos)(v) + 1, passes="test_retrace")
    np.testing.assert_allclose(wrapped(x), jnp.cos(x) + 1, rtol=1e-6)


def test_closure_over_outer_tracer():
    def loss(scale, x):
        h = hlopass.jit(lambda v: jnp.sin(v) * scale, passes="test_retrace")
        return h(x).sum()
    x = jnp.arange(4.0)
    np.testing.assert_allclose(jax.grad(loss)(2.0, x), jnp.sin(x).sum(), rtol=1e-6)


def test_decorator_forms_keep_name_and_doc():
    @hlopass.jit
    def plain(x):
        """Doubles."""
        return 2 * x

    @hlopass.jit(passes="none", threshold="1MB")
    def configured(x):
        """Triples."""
        return 3 * x

    assert plain.__name__ == "plain" and plain.__doc__ == "Doubles."
    assert configured.__name__ == "configured" and configured.__doc__ == "Triples."
    assert configured.config().threshold == 10**6
    np.testing.assert_array_equal(plain(jnp.ones(3)), 2 * jnp.ones(3))
    np.testing.assert_array_equal(configured(jnp.ones(3)), 3 * jnp.ones(3))


def test_rewrapping_merges_settings():
    @hlopass.jit(threshold="1MB", passes="none")
    def f(x):
        return x + 1

    g = hlopass.jit(f, split_size="500kB")
    assert g.__name__ == "f" and g._fun is f._fun
    assert (g.config().threshold, g.config().split_size, g.config().passes) == (10**6, 5 * 10**5, ())
    np.testing.assert_array_equal(g(jnp.ones(2)), 2 * np.ones(2))


def test_static_args_kwargs_and_donation():
    h = hlopass.jit(programs.uses_static, static_argnums=(1,), static_argnames=("mode",), passes="test_retrace")
    x = jnp.linspace(0.0, 1.0, 8)
    assert float(h(x, 2)) == pytest.approx(float(jnp.sum(x ** 2)), rel=1e-6)
    assert float(h(x, 3, mode="max")) == pytest.approx(1.0)
    assert h.trace_count == 2
    h(x, 2)
    assert h.trace_count == 2
    donating = hlopass.jit(lambda a: a + 1, donate_argnums=0, passes="none")
    y = jnp.ones(4)
    np.testing.assert_array_equal(donating(y), 2 * np.ones(4))


def test_one_trace_per_signature_and_settings(monkeypatch):
    calls = []

    def f(x):
        calls.append(1)
        return x * 2

    h = hlopass.jit(f, passes="none")
    x = jnp.ones((3, 4))
    for _ in range(5):
        h(x)
    assert len(calls) == 1
    h(jnp.ones((3, 5)))
    assert len(calls) == 2
    h(jnp.ones((3, 4), jnp.int32))
    assert len(calls) == 3
    monkeypatch.setenv("HLOPASS_TENSOR_SIZE_THRESHOLD", "5MB")
    h(x)  # settings are part of the key
    assert len(calls) == 4
    h(x)
    assert len(calls) == 4


def test_ahead_of_time_stages():
    h = hlopass.jit(lambda x, y: jnp.tanh(x) @ y, passes="test_retrace")
    x, y = jnp.ones((8, 4)), jnp.ones((4, 2))
    traced = h.trace(x, y)
    assert traced.out_info.shape == (8, 2)
    assert "tanh" in str(traced.original_jaxpr) and "tanh" in str(traced.rewritten_jaxpr)
    assert traced.report.passes[0].name == "test_retrace"
    lowered = h.lower(x, y)
    text = lowered.as_text()
    assert "stablehlo.tanh" in text and "hlopass_" in text
    compiled = lowered.compile()
    assert compiled.memory_analysis().temp_size_in_bytes >= 0
    assert isinstance(compiled.cost_analysis(), (dict, list))
    np.testing.assert_allclose(compiled(x, y), jnp.tanh(x) @ y, rtol=1e-6)
    assert lowered.memory_check is not None and lowered.memory_check.footprint > 0
    assert h.eval_shape(x, y).shape == (8, 2)


def outer_exp(x):
    return jnp.exp(x[:, None] * x[None, :])


def test_memory_limit_warns_with_largest_tensors(caplog):
    h = hlopass.jit(outer_exp, memory_limit="10kB", passes="none")
    x = jnp.ones(200)
    with caplog.at_level(logging.WARNING, logger="hlopass"):
        h(x)
    text = caplog.text
    assert "over the memory limit" in text and "tensor<200x200xf32>" in text and "test_jit.py" in text


def test_memory_limit_strict_raises():
    h = hlopass.jit(outer_exp, memory_limit="10kB", strict=True, passes="none")
    with pytest.raises(hlopass.MemoryLimitError) as err:
        h(jnp.ones(200))
    assert err.value.check.footprint > 10_000


def test_memory_limit_respected_does_not_warn(caplog):
    h = hlopass.jit(lambda x: x + 1, memory_limit="1GB", strict=True, passes="none")
    with caplog.at_level(logging.WARNING, logger="hlopass"):
        h(jnp.ones(10))
    assert "over the memory limit" not in caplog.text
    assert h.memory_checks() and not h.memory_checks()[0].over_limit


def test_eager_grad_path_is_checked_too():
    h = hlopass.jit(lambda x: outer_exp(x).sum(), memory_limit="10kB", strict=True, passes="none",
                    threshold="off")
    h(jnp.ones(20))  # small: fine
    with pytest.raises(hlopass.MemoryLimitError):
        jax.grad(h)(jnp.ones(200))  # the saved 200x200 residual is over the limit


def test_backward_program_goes_through_pipeline():
    h = hlopass.jit(lambda x: jnp.sum(jnp.sin(x) ** 2), passes="test_retrace")
    labels = [report.label for report in hlopass.reports(jax.grad(h), jnp.ones(5))]
    assert any(label.startswith("transpose(") for label in labels), labels


def test_large_residuals_are_rematerialised():
    """With a threshold, the backward program recomputes big forward values instead of saving them."""
    def f(x):
        return jnp.sum(jnp.exp(-((x[:, None] - x[None, :]) ** 2)))
    x = jnp.linspace(0.0, 1.0, 300)
    saved = hlopass.jit(f, passes="none", threshold="off")
    remat = hlopass.jit(f, passes="none", threshold="100kB")
    np.testing.assert_allclose(jax.grad(remat)(x), jax.grad(saved)(x), rtol=1e-5)
    residuals = lambda h: [v.aval for v in jax.make_jaxpr(jax.grad(h))(x).eqns[0].outvars]  # noqa: E731
    assert max(a.size for a in residuals(saved)) == 300 * 300
    assert max(a.size for a in residuals(remat)) < 300 * 300


def test_unknown_primitives_pass_through():
    f = lambda x: jax.pure_callback(lambda v: np.asarray(v) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x)  # noqa: E731
    x = jnp.arange(3.0)
    np.testing.assert_array_equal(hlopass.jit(f, passes="test_retrace")(x), 2 * x)
