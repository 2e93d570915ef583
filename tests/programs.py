"""A zoo of JAX programs used to check that hlopass leaves semantics alone."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def pytree_in_out(params, x):
    h = jnp.tanh(x @ params["w"] + params["b"])
    return {"out": h.sum(-1), "aux": (h.mean(), [h.max()])}


def with_scan(x):
    def step(carry, row):
        carry = carry * 0.9 + jnp.sin(row)
        return carry, carry.sum()
    final, sums = jax.lax.scan(step, jnp.zeros(x.shape[1:], x.dtype), x)
    return final, sums


def with_while(x):
    def cond(state):
        i, _ = state
        return i < 5
    def body(state):
        i, value = state
        return i + 1, jnp.cos(value) + i
    return jax.lax.while_loop(cond, body, (0, x))[1]


def with_fori(x):
    return jax.lax.fori_loop(0, 7, lambda i, v: v * 1.01 + jnp.float32(i), x)


def with_cond(x):
    return jax.lax.cond(x.sum() > 0, lambda v: jnp.exp(v), lambda v: -v, x)


def with_custom_jvp(x):
    return jax.nn.softplus(x).sum() + jax.nn.gelu(x).mean() + jax.nn.logsumexp(x)


@jax.custom_vjp
def clipped_identity(x):
    return x


def _clip_fwd(x):
    return x, None


def _clip_bwd(_, g):
    return (jnp.clip(g, -0.5, 0.5),)


clipped_identity.defvjp(_clip_fwd, _clip_bwd)


def with_custom_vjp(x):
    return jnp.sum(clipped_identity(x) ** 2)


def with_checkpoint(x):
    f = jax.checkpoint(lambda v: jnp.sin(jnp.sin(v)) * v)
    return f(x).sum()


def with_nested_jit(x):
    inner = jax.jit(lambda v: v * 2 + 1)
    return inner(inner(x)) - x


def with_random(key, x):
    noise = jax.random.normal(key, x.shape, x.dtype)
    mask = jax.random.bernoulli(key, 0.3, x.shape)
    return jnp.where(mask, x + noise, x)


def integer_and_bool(i, b):
    j = (i * 3 + 7) // 2 % 5
    return j, jnp.logical_xor(b, j > 2), jnp.bitwise_and(i, 6), jnp.argmax(i)


@functools.partial(jax.jit, static_argnums=1)
def static_power(x, n):
    return x ** n


def uses_static(x, n, mode="sum"):
    y = x ** n
    return y.sum() if mode == "sum" else y.max()


def with_sort_and_cumsum(x):
    return jnp.sort(x, axis=-1), jnp.cumsum(x, axis=0), jax.lax.top_k(x, 2)


def make_inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(6, 5)).astype(np.float32))
    params = {"w": jnp.asarray(rng.normal(size=(5, 4)).astype(np.float32)),
              "b": jnp.asarray(rng.normal(size=(4,)).astype(np.float32))}
    ints = jnp.asarray(rng.integers(0, 100, size=(7,)).astype(np.int32))
    bools = jnp.asarray(rng.integers(0, 2, size=(7,)).astype(bool))
    return x, params, ints, bools


def zoo():
    """(name, function, args) triples covering the constructs hlopass must pass through."""
    x, params, ints, bools = make_inputs()
    return [
        ("pytree", pytree_in_out, (params, x)),
        ("scan", with_scan, (x,)),
        ("while", with_while, (x,)),
        ("fori", with_fori, (x,)),
        ("cond", with_cond, (x,)),
        ("custom_jvp", with_custom_jvp, (x,)),
        ("custom_vjp", with_custom_vjp, (x,)),
        ("checkpoint", with_checkpoint, (x,)),
        ("nested_jit", with_nested_jit, (x,)),
        ("random", with_random, (jax.random.key(3), x)),
        ("int_bool", integer_and_bool, (ints, bools)),
        ("sort_cumsum_topk", with_sort_and_cumsum, (x,)),
    ]


DIFFERENTIABLE = ("pytree", "scan", "while_fwd_only", "fori", "cond", "custom_jvp", "custom_vjp",
                  "checkpoint", "nested_jit")
