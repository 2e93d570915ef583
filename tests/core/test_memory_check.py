"""The memory check holds under every composition: an outer ``jax.jit``, ``jax.jit(jax.grad(...))``,
``jax.jit(jax.vmap(...))``, inside another hlopass function, eager transformations, and a new value
of a static argument passed by position; in warning and strict modes. Programs far below the limit
pay no second compile."""

import functools
import logging

import jax
import jax.numpy as jnp
import pytest
from hlopass import internals as jx

import hlopass


def outer_exp(x):
    return jnp.exp(x[:, None] * x[None, :])  # a 200 x 200 float32 result: 160 kB


def compositions(h):
    """(name, thunk) for each way of calling ``h``; each needs h's program (or its derivative)."""
    x = jnp.ones(200)
    return [
        ("direct", lambda: h(x)),
        ("jit", lambda: jax.jit(lambda v: h(v) + 1)(x)),
        ("jit_grad", lambda: jax.jit(jax.grad(lambda v: h(v).sum()))(x)),
        ("jit_vmap", lambda: jax.jit(jax.vmap(h))(jnp.ones((2, 200)))),
        ("inside_hlopass", lambda: hlopass.jit(lambda v: h(v) * 2, memory_limit="off")(x)),
        ("eager_grad", lambda: jax.grad(lambda v: h(v).sum())(x)),
        ("eager_vmap", lambda: jax.vmap(h)(jnp.ones((2, 200)))),
        ("lower_compile", lambda: h.lower(x).compile()),
    ]


NAMES = [name for name, _ in compositions(None)]


@pytest.mark.parametrize("which", NAMES)
def test_strict_raises_under_every_composition(which):
    h = hlopass.jit(outer_exp, memory_limit="10kB", strict=True, passes="none")
    thunk = dict(compositions(h))[which]
    with pytest.raises(hlopass.MemoryLimitError) as err:
        thunk()
    assert err.value.check.footprint > 10_000 and "over the memory limit" in str(err.value)


@pytest.mark.parametrize("which", NAMES)
def test_warns_under_every_composition(which, caplog):
    # a function of its own: a program warns once, and JAX shares traces of one function between
    # compositions (plain jax.jit's and a hlopass function's, since neither rewrites it)
    h = hlopass.jit(functools.wraps(outer_exp)(lambda x: outer_exp(x)), memory_limit="10kB", passes="none")
    thunk = dict(compositions(h))[which]
    with caplog.at_level(logging.WARNING, logger="hlopass"):
        thunk()
    assert "over the memory limit" in caplog.text
    assert "test_memory_check.py" in caplog.text  # the user's source line, not hlopass's


def test_default_pipeline_strict_under_outer_jit():
    h = hlopass.jit(outer_exp, memory_limit="10kB", strict=True)
    with pytest.raises(hlopass.MemoryLimitError):
        jax.jit(lambda v: h(v) * 3)(jnp.ones(200))


def test_within_limit_under_outer_jit_is_quiet(caplog):
    h = hlopass.jit(outer_exp, memory_limit="1GB", strict=True)
    with caplog.at_level(logging.WARNING, logger="hlopass"):
        jax.jit(lambda v: h(v) + 1)(jnp.ones(200))
    assert "over the memory limit" not in caplog.text


def test_new_static_value_by_position_with_static_argnames_is_checked():
    def f(x, mode):
        return outer_exp(x) if mode == "big" else x * 2
    h = hlopass.jit(f, static_argnames=("mode",), memory_limit="10kB", strict=True, passes="none")
    h(jnp.ones(200), "small")
    with pytest.raises(hlopass.MemoryLimitError):
        h(jnp.ones(200), "big")
    with pytest.raises(hlopass.MemoryLimitError):
        h(jnp.ones(200), mode="big")
    assert len(h.memory_checks()) == 1


def test_programs_far_below_the_limit_compile_once_under_outer_jit():
    """The lowering rule's own check compiles a program alone only when a crude bound on its bytes
    does not already show that it fits: a small program under an outer jit is compiled once."""
    h = hlopass.jit(lambda v: jnp.tanh(v) @ v.T)
    outer = jax.jit(lambda v: h(v) + 1)
    x = jnp.ones((30, 20))
    with jx.count_jit_and_pmap_lowerings() as count:
        outer(x)
    assert count() == 1


def test_top_level_call_compiles_once():
    h = hlopass.jit(lambda v: jnp.tanh(v) @ v.T, memory_limit="1GB")
    x = jnp.ones((30, 20))
    with jx.count_jit_and_pmap_lowerings() as count:
        for _ in range(3):
            h(x)
    assert count() == 1
