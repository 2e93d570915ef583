"""Trace counts equal ``jax.jit``'s: under ``jax.grad``, inside an outer ``jax.jit``, for a fresh
``hlopass.jit`` of the same function; nothing recompiles on repeated transformed calls; closed-over
arrays are freed by reference counting, as with ``jax.jit``. All with the default pipeline (the hvp
pass's trace context included)."""

import gc
import weakref

import jax
import jax.numpy as jnp
import pytest
from hlopass import internals as jx

import hlopass


def counted():
    """A function and the list its traces append to."""
    calls = []

    def f(x):
        calls.append(1)
        return jnp.sin(x) * 2 + jnp.sum(x ** 2)

    return f, calls


def traces_under_grad(jit):
    f, calls = counted()
    h = jit(f)
    for _ in range(3):
        jax.grad(lambda v: h(v).sum())(jnp.arange(4.0))
    return len(calls)


def traces_inside_outer_jit(jit):
    f, calls = counted()
    h = jit(f)

    @jax.jit
    def outer(v):
        for _ in range(10):
            v = h(v)
        return v
    outer(jnp.arange(4.0))
    return len(calls)


def traces_of_fresh_jits(jit):
    f, calls = counted()
    for _ in range(3):
        jit(f)(jnp.arange(4.0))
    return len(calls)


def traces_under_vmap(jit):
    f, calls = counted()
    h = jit(f)
    for _ in range(3):
        jax.vmap(h)(jnp.ones((2, 4)))
    return len(calls)


def traces_under_jit_of_grad_fresh_outer(jit):
    f, calls = counted()
    h = jit(f)
    for _ in range(3):
        jax.jit(jax.grad(lambda v: h(v).sum()))(jnp.arange(4.0))
    return len(calls)


def traces_inside_another_hlopass_function(jit):
    f, calls = counted()
    h = jit(f)
    outer = hlopass.jit(lambda v: h(h(h(v))))
    for _ in range(2):
        outer(jnp.arange(4.0))
    return len(calls)


CASES = [traces_under_grad, traces_inside_outer_jit, traces_of_fresh_jits, traces_under_vmap,
         traces_under_jit_of_grad_fresh_outer, traces_inside_another_hlopass_function]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_trace_counts_equal_jax_jits(case):
    assert case(hlopass.jit) == case(jax.jit) == 1


def test_default_pipeline_includes_the_hvp_trace_context():
    assert "hvp" in hlopass.resolve_config().pass_names


def test_repeated_transformed_calls_compile_nothing_new():
    h = hlopass.jit(lambda x: jnp.sum(jnp.sin(x[:, None] * x[None]) ** 2), threshold="1kB")
    x = jnp.linspace(0.0, 1.0, 50)
    for transform, arg in ((jax.grad, x), (jax.vmap, jnp.ones((3, 50))), (jax.hessian, x[:8])):
        fn = transform(h)
        fn(arg)
        with jx.count_jit_and_pmap_lowerings() as count:
            for _ in range(3):
                fn(arg)
        assert count() == 0, transform.__name__


@pytest.mark.parametrize("jit", [jax.jit, hlopass.jit], ids=["jax.jit", "hlopass.jit"])
def test_closed_over_array_freed_without_garbage_collection(jit):
    enabled = gc.isenabled()
    gc.disable()
    try:
        array = jnp.ones(1000)
        ref = weakref.ref(array)
        f = (lambda a: lambda: a * 2)(array)
        h = jit(f)
        h()
        jax.grad(lambda s: jit(lambda v: (f() * v).sum())(s))(1.0)
        del array, f, h
        assert ref() is None
    finally:
        if enabled:
            gc.enable()


def test_hlopass_function_freed_without_garbage_collection():
    enabled = gc.isenabled()
    gc.disable()
    try:
        def f(x):
            return x + 1
        h = hlopass.jit(f)
        h(jnp.ones(3))
        refs = [weakref.ref(h), weakref.ref(f)]
        del f, h
        assert all(r() is None for r in refs)
    finally:
        if enabled:
            gc.enable()
