"""``hlopass.jit`` runs like ``jax.jit``: ``jax.disable_jit()``, ``jax_remat3``, and the arguments
``jax.jit`` rejects when it is applied (same exception types and messages)."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from hlopass import internals as jx

import hlopass


def test_disable_jit_runs_the_function_eagerly():
    seen = []

    def f(x):
        seen.append(type(x))
        return jnp.sin(x) * float(jnp.sum(x))  # concrete values only: as jax.jit under disable_jit

    x = jnp.arange(3.0)
    h = hlopass.jit(f)
    with jax.disable_jit():
        np.testing.assert_allclose(h(x), jax.jit(f)(x), rtol=1e-6)
        np.testing.assert_allclose(jax.grad(lambda v: hlopass.jit(jnp.sin)(v).sum())(x), jnp.cos(x), rtol=1e-6)
    assert seen and all(not issubclass(t, jax.core.Tracer) for t in seen)


def test_disable_jit_reaches_a_staged_hlopass_call():
    """A hlopass_call already in a jaxpr, evaluated under disable_jit, runs op by op."""
    h = hlopass.jit(lambda v: jnp.exp(v) * 2)
    x = jnp.arange(3.0)
    closed = jax.make_jaxpr(h)(x)
    with jax.disable_jit():
        out = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, x)[0]
    np.testing.assert_allclose(out, jnp.exp(x) * 2, rtol=1e-6)


def _sin_sin(x):
    return lax.sin(lax.sin(x)), 3.0


def _remat_program(x):
    y, _ = jax.remat(_sin_sin)(x)
    return y


@pytest.mark.parametrize("passes", ["default", "none"])
def test_remat3_inside_hlopass(passes):
    """With jax_remat3 the program holds a high-level primitive: lowering needs hlopass_call's
    ``to_lojax`` rule (it raised NotImplementedError)."""
    with jx.remat3(True):
        h = hlopass.jit(_remat_program, passes=passes)
        assert "sine" in h.lower(2.0).as_text()
        np.testing.assert_allclose(h(2.0), _remat_program(2.0), rtol=1e-6)
        np.testing.assert_allclose(jax.grad(h)(2.0), jax.grad(_remat_program)(2.0), rtol=1e-6)
        np.testing.assert_allclose(jax.jit(jax.grad(h))(2.0), jax.grad(_remat_program)(2.0), rtol=1e-6)
        np.testing.assert_allclose(jax.vmap(h)(jnp.ones(3)), jax.vmap(_remat_program)(jnp.ones(3)), rtol=1e-6)


def _two(x, y):
    return x + y


def _generator(x):
    yield x


class _Slots:
    __slots__ = ()

    def __call__(self, x):
        return x + 1


BAD_JIT_ARGUMENTS = [
    ("static_argnums out of range", _two, dict(static_argnums=(5,))),
    ("static_argnames unknown", _two, dict(static_argnames=("z",))),
    ("static_argnums not ints", _two, dict(static_argnums="a")),
    ("donate_argnums out of range", _two, dict(donate_argnums=(5,))),
    ("donate_argnames unknown", _two, dict(donate_argnames=("z",))),
    ("static and donated", _two, dict(static_argnums=0, donate_argnums=0)),
    ("generator function", _generator, {}),
    ("not callable", 3, {}),
    ("not callable string", "f", {}),
]


@pytest.mark.parametrize("name, fun, kwargs", BAD_JIT_ARGUMENTS, ids=[b[0] for b in BAD_JIT_ARGUMENTS])
def test_rejected_when_applied_as_jax_jit_rejects(name, fun, kwargs):
    with pytest.raises(Exception) as expected:
        jax.jit(fun, **kwargs)
    with pytest.raises(type(expected.value)) as got:
        hlopass.jit(fun, **kwargs)
    assert str(got.value) == str(expected.value)
    with pytest.raises(type(expected.value)):
        hlopass.jit(**kwargs)(fun)


def test_not_weakly_referenceable_callable_fails_when_called_as_under_jax_jit():
    """jax.jit builds the object but the call raises TypeError (its caches need weak references)."""
    h = hlopass.jit(_Slots())
    with pytest.raises(TypeError, match="cannot create weak reference"):
        h(jnp.ones(2))


def _uncomparable_static_class(hash_value):
    """Hashable, but comparing two of them raises. Each call site gets its own hash: jax.jit's global
    caches would otherwise compare instances from another call site (and raise elsewhere)."""
    class Uncomparable:
        def __hash__(self):
            return hash_value

        def __eq__(self, other):
            raise ValueError("cannot compare")
    return Uncomparable


def test_static_argument_whose_eq_raises_gives_jax_jits_error():
    def call_twice(jit, hash_value):
        static = _uncomparable_static_class(hash_value)
        h = jit(lambda x, s: x * 2, static_argnums=1)
        h(jnp.ones(2), static())
        h(jnp.ones(2), static())

    with pytest.raises(ValueError) as expected:
        call_twice(jax.jit, 1001)
    with pytest.raises(ValueError) as got:
        call_twice(hlopass.jit, 2002)
    assert "static arguments should be comparable" in str(expected.value)
    assert str(got.value).split("The error was")[0] == str(expected.value).split("The error was")[0]


def test_unhashable_static_argument_gives_jax_jits_error():
    for jit in (jax.jit, hlopass.jit):
        with pytest.raises(ValueError, match="Non-hashable static arguments"):
            jit(lambda x, s: x, static_argnums=1)(jnp.ones(2), [1, 2])


def test_static_argnames_resolve_like_jax_jit():
    """static_argnames given, the argument passed by position (jax.jit infers its number)."""
    def f(x, mode):
        return x * 2 if mode == "double" else x * 3
    h = hlopass.jit(f, static_argnames="mode")
    x = jnp.ones(3)
    np.testing.assert_array_equal(h(x, "double"), 2 * x)
    np.testing.assert_array_equal(h(x, "triple"), 3 * x)
    np.testing.assert_array_equal(h(x, mode="triple"), 3 * x)
    assert inspect.signature(h) == inspect.signature(f)
