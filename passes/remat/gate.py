"""Recomputation XLA can neither merge away nor run early.

A recomputed forward value is, to XLA, a common subexpression of the
forward pass: XLA:CPU expands ``optimization_barrier`` before it eliminates
common subexpressions, so ``jax.checkpoint``'s barrier does not stop the
backward pass from reading the forward values again (measured: ``jax.grad``
of a 64-layer tanh MLP with ``jax.checkpoint`` on every layer needs 675 MB
against 411 MB without). And once a recomputation no longer depends on the
backward pass, the scheduler may run it as early as it likes, with all
recomputed values alive at once.

:func:`gated` runs the recomputation inside a ``lax.cond`` whose predicate
reads a value of the backward pass (the cotangent the recomputed values are
about to meet): ``t == t`` for a float scalar ``t`` taken from it. Both
branches are the same function, so the result does not depend on the
predicate (false only for a NaN); XLA cannot prove the predicate constant,
so it keeps the conditional, and a conditional's body is a computation of
its own (no common subexpressions with the forward pass), run only once
its predicate, and so the backward pass up to that cotangent, is known.

:func:`remat_block` wraps a function for ``jax.grad`` of a hlopass function
(before JAX linearises it): a ``jax.custom_vjp`` that keeps only its inputs
and whose backward rule recomputes it under :func:`gated`, ordered by the
incoming cotangent. Nested blocks recompute recursively.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def is_float(x) -> bool:
    """Whether ``x`` is a non-empty floating-point array."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating) and int(np.prod(np.shape(x))) > 0


def scalar_of(x):
    """The first element of a non-empty floating-point array, as a scalar; ``None`` otherwise."""
    if not is_float(x):
        return None
    ndim = np.ndim(x)
    if ndim == 0:
        return x
    return lax.reshape(lax.slice(x, (0,) * ndim, (1,) * ndim), ())


def first_scalar(values: Sequence):
    """:func:`scalar_of` the first floating-point value in ``values`` that has one, or ``None``."""
    for v in values:
        s = scalar_of(v)
        if s is not None:
            return s
    return None


def gated(trigger, fn: Callable, *operands):
    """``fn(*operands)``, computed inside a conditional that waits for ``trigger`` (see the module
    docstring). ``trigger``: a float scalar of the backward pass, or ``None`` to read one from the
    operands (the result then still cannot be merged with the forward pass, but may run early)."""
    t = trigger if trigger is not None else first_scalar(operands)
    if t is None:
        return fn(*operands)
    return lax.cond(t == t, fn, fn, *operands)


def _zero_cotangent(x):
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(np.shape(x), dtype=jax.dtypes.float0)


def remat_block(fn: Callable[..., list], *, keep: Callable | None = None, restore: Callable | None = None,
                nondiff: Sequence[bool] | None = None) -> Callable[..., list]:
    """``fn`` (flat arrays in, a list of arrays out) as a ``jax.custom_vjp`` that saves only what
    ``keep(args)`` returns (its inputs by default; ``restore(kept)`` rebuilds the inputs from it) and
    whose backward rule recomputes ``fn`` and its VJP under :func:`gated`. Inputs marked in
    ``nondiff`` get zero cotangents without being differentiated."""
    keep = keep or (lambda args: tuple(args))
    restore = restore or (lambda kept: list(kept))

    @jax.custom_vjp
    def block(*args):
        return fn(*args)

    def forward(*args):
        return fn(*args), keep(args)

    def backward(kept, cts):
        args = list(restore(kept))
        skip = nondiff or [False] * len(args)
        diff = [jnp.issubdtype(jnp.result_type(a), jnp.inexact) and not s for a, s in zip(args, skip)]

        def pullback(args, cts):
            def along(*d):
                it = iter(d)
                return fn(*[next(it) if flag else a for a, flag in zip(args, diff)])
            _, vjp = jax.vjp(along, *[a for a, flag in zip(args, diff) if flag])
            return list(vjp(list(cts)))

        grads = iter(gated(first_scalar(jax.tree_util.tree_leaves(cts)), pullback, args, list(cts)))
        return tuple(next(grads) if flag else _zero_cotangent(a) for a, flag in zip(args, diff))

    block.defvjp(forward, backward)
    return block
