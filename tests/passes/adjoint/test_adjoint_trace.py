"""The adjoint pass's probe of a differentiated function is the trace JAX differentiates: the user's
Python runs once per gradient, as under ``jax.jit``, unless the function takes an inner gradient."""

import jax
import jax.numpy as jnp
import numpy as np

import hlopass


def _data():
    rng = np.random.default_rng(0)
    return rng.standard_normal((16, 8), np.float32), rng.standard_normal((32, 16), np.float32)


def test_first_order_gradient_traces_the_loss_once():
    calls = []

    def loss(w, x):
        calls.append(None)
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    def step(w, x):
        return jax.value_and_grad(loss)(w, x)

    w, x = _data()
    value, grad = hlopass.jit(step)(w, x)
    assert len(calls) == 1, f"the loss ran {len(calls)} times while hlopass traced"
    calls.clear()
    want_value, want_grad = jax.jit(step)(w, x)
    assert len(calls) == 1
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6)


def test_jaxpr_as_jax_jit_traces_it():
    def step(w, x):
        return jax.grad(lambda w: jnp.sum(jnp.sin(x @ w)))(w)
    w, x = _data()
    ours = hlopass.jit(step, passes="adjoint").trace(w, x).original_jaxpr
    assert str(ours.jaxpr) == str(jax.make_jaxpr(step)(w, x).jaxpr)


def test_inner_gradient_is_traced_again_and_still_right():
    calls = []

    def inner(w, x):
        calls.append(None)
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    def meta(w, x):
        return jax.grad(lambda w: jnp.sum(jax.grad(inner)(w, x) ** 2))(w)

    w, x = _data()
    got = hlopass.jit(meta)(w, x)
    np.testing.assert_allclose(got, jax.jit(meta)(w, x), rtol=2e-4, atol=1e-6)
    assert len(calls) >= 2  # traced again under the outer derivative: hvp's rewrite needs it


def _recurrence(a, x):
    def body(h, xt):
        h = a * h + xt
        return h, h
    return jax.lax.scan(body, jnp.zeros(x.shape[1:], x.dtype), x)[1]


def test_a_gradient_through_a_scan_is_traced_again_and_rewritten():
    calls = []

    def step(a, x):
        calls.append(None)
        return jax.grad(lambda a: jnp.sum(jnp.sin(_recurrence(a, x))))(a)

    a = jnp.full((8,), 0.9, jnp.float32)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((37, 8)), jnp.float32)
    f = hlopass.jit(step)
    got = f(a, x)
    assert len(calls) == 2, "traced as written, then again with the adjoint pass's probe"
    calls.clear()
    np.testing.assert_allclose(got, jax.jit(step)(a, x), rtol=2e-5, atol=1e-6)
    report = f.trace(a, x).report
    forms = [r.details.get("form") for p in report.passes if p.name == "adjoint" for r in p.rewrites]
    assert forms == ["diagonal"], str(report)


def test_a_scan_that_is_not_differentiated_costs_no_second_trace():
    calls = []

    def forward(a, x):
        calls.append(None)
        return jnp.sum(jnp.sin(_recurrence(a, x)))

    a = jnp.full((8,), 0.9, jnp.float32)
    x = jnp.ones((11, 8), jnp.float32)
    got = hlopass.jit(forward)(a, x)
    assert len(calls) == 1
    np.testing.assert_allclose(got, jax.jit(forward)(a, x), rtol=1e-6)
