"""The adjoint scan: a ``custom_vjp`` that keeps the carry every K steps and takes the VJP by adjoints.

Forward: the scan as written, as an outer scan over chunks of K steps (and a
last partial chunk), keeping only the carry entering each chunk.

Backward, chunk by chunk from the last:

1. the carries inside the chunk are recomputed from its first one;
2. the body is linearised over the whole chunk at once (``vmap`` over its
   steps): one VJP gives the readout's contribution ``s_t`` to each step's
   carry cotangent, and for a diagonal recurrence the multipliers ``a_t``
   come from a JVP with unit tangents;
3. the adjoint states ``mu_{t-1} = a_t mu_t + s_t`` (``M_t^T mu_t + s_t``
   for a dense ``M_t``) are solved backwards from the chunk's end: an
   associative scan (log-depth, parallel) for a diagonal recurrence, a
   sequential scan of the carry update's transpose for a dense one;
4. the same VJP, fed ``(mu_t, g_t)``, gives every step's cotangents for its
   inputs at once; parameters' cotangents are summed over the chunk and
   accumulated across chunks, and ``mu`` before the chunk's first step goes
   to the chunk before it (to the initial state after the first chunk).

Gradients are those of the scan as written up to floating-point reordering.
With ``truncate=T`` the adjoint is not passed from one block of T steps to
the one before it: each output's gradient reaches back between 1 and T steps
(an approximation).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from hlopass import internals as jx

logger = logging.getLogger("hlopass")


def _zeros(x):
    return jnp.zeros_like(x)     # keeps the value's type across a mesh (varying axes in shard_map)


def _values_mesh(tree):
    """The manual mesh the values of ``tree`` live on when it is not the context's (a backward pass
    traced inside a ``shard_map``'s transpose), to be entered; else a null context."""
    for leaf in jax.tree_util.tree_leaves(tree):
        mesh = getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None)
        manual = getattr(mesh, "manual_axes", None)
        if manual and mesh != jax.sharding.get_abstract_mesh():
            return jx.use_abstract_mesh(mesh)
    return contextlib.nullcontext()


def _inexact(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _split(xs: Sequence, n: int, k: int):
    """``xs`` (leading axis ``n*k + r``) as ``(n, k, ...)`` blocks and the ``r`` remaining rows."""
    full = [x[:n * k].reshape((n, k) + x.shape[1:]) for x in xs]
    rest = [x[n * k:] for x in xs]
    return full, rest


#: JAX's associative scan, taken when this module is imported: the adjoint pass replaces
#: ``jax.lax.associative_scan`` while it traces, and this machinery's own scans are not the user's.
_associative_scan = lax.associative_scan


def _affine_reverse(alphas, sigmas, mu_end):
    """``m_j = alpha_{j+1} m_{j+1} + sigma_{j+1}`` backwards from ``m_{K-1} = mu_end``, as an associative scan."""
    alpha = jnp.concatenate([alphas[1:], jnp.zeros_like(alphas[:1])], 0)
    sigma = jnp.concatenate([sigmas[1:], mu_end[None]], 0)

    def combine(later, earlier):  # reverse scan: ``later`` holds the maps of larger indices
        a_l, s_l = later
        a_e, s_e = earlier
        return a_e * a_l, a_e * s_l + s_e
    return _associative_scan(combine, (alpha, sigma), reverse=True)[1]


def adjoint_scan(step: Callable, num_consts: int, num_carry: int, length: int, chunk: int, form: str,
                 truncate: int | None = None, on_truncation: Callable | None = None,
                 guard: Callable = contextlib.nullcontext) -> Callable:
    """``f(*consts, *init, *xs) -> (*carry, *ys)``, the scan of ``step`` with an adjoint-method VJP.

    ``step(consts, carry, xs_t) -> (carry', ys_t)`` takes and returns lists. ``chunk`` is K;
    ``form`` is ``"diagonal"``/``"complex"`` (associative adjoint) or ``"dense"`` (sequential).
    ``on_truncation(rel)`` receives, when given, the relative difference of the truncated
    gradient from the exact one (both are computed then).
    """
    nc, nk = num_consts, num_carry
    k = max(1, min(int(chunk), length)) if truncate is None else max(1, min(int(truncate), length))
    n, r = divmod(length, k)

    def run(consts, h, xs, steps):
        return lax.scan(lambda c, x: tuple(step(consts, c, list(x))), list(h), list(xs), length=steps)

    def forward(consts, init, xs):
        full, rest = _split(xs, n, k)
        h, ys, starts = list(init), None, None
        if n:
            def chunk_body(c, x):
                c2, y = run(consts, c, x, k)
                return c2, (c, y)
            h, (starts, ys_full) = lax.scan(chunk_body, h, full, length=n)
            ys = [y.reshape((n * k,) + y.shape[2:]) for y in ys_full]
        last_start = h
        if r:
            h, ys_rest = run(consts, h, rest, r)
            ys = ys_rest if ys is None else [jnp.concatenate([a, b], 0) for a, b in zip(ys, ys_rest)]
        return list(h), list(ys), starts, last_start

    def batched(hp, xc, cs):
        out = jax.vmap(lambda h, x: tuple(step(cs, h, list(x))), in_axes=(0, 0))(hp, xc)
        return list(out[0]), list(out[1])

    def chunk_grads(consts, h0, xs_c, g_c, mu_end, steps: int):
        """Cotangents of one chunk: (mu before it, of its xs, of the consts)."""
        _, hs_prev = lax.scan(lambda c, x: (step(consts, c, list(x))[0], c), list(h0), list(xs_c), length=steps)
        hs_prev = list(hs_prev)
        (hs_next, _), pull = jax.vjp(batched, hs_prev, list(xs_c), list(consts))
        s = pull(([_zeros(h) for h in hs_next], list(g_c)))[0]
        if form in ("diagonal", "complex"):
            ones = [jnp.ones_like(h) for h in hs_prev]
            a = jax.jvp(lambda hp: batched(hp, list(xs_c), list(consts))[0], (hs_prev,), (ones,))[1]
            mus = [_affine_reverse(ai, si, me) for ai, si, me in zip(a, s, mu_end)]
        else:
            def back(m, inp):
                x, hp, s_j = inp
                _, vjp_h = jax.vjp(lambda h: step(consts, h, list(x))[0], list(hp))
                prev = vjp_h(list(m))[0]
                return [p + q for p, q in zip(prev, s_j)], m
            _, mus = lax.scan(back, list(mu_end), (list(xs_c), hs_prev, list(s)), reverse=True, length=steps)
        ct_hp, ct_x, ct_c = pull((list(mus), list(g_c)))
        return [c[0] for c in ct_hp], list(ct_x), list(ct_c)

    def add(acc, new):
        return [a if not _inexact(a) else a + b for a, b in zip(acc, new)]

    def backward(consts, xs, starts, last_start, ct_final, ct_ys, truncated: bool):
        full_x, rest_x = _split(xs, n, k)
        full_g, rest_g = _split(ct_ys, n, k)
        mu = list(ct_final)
        ct_consts = [_zeros(c) for c in consts]
        ct_rest = None
        if r:
            mu, ct_rest, ct_c = chunk_grads(consts, last_start, rest_x, rest_g, mu, r)
            ct_consts = add(ct_consts, ct_c)
            if truncated:
                mu = [_zeros(m) for m in mu]
        ct_full = None
        if n:
            def chunk_body(carry, inp):
                mu, acc = carry
                h0, x_c, g_c = inp
                mu, ct_x, ct_c = chunk_grads(consts, h0, x_c, g_c, mu, k)
                if truncated:
                    mu = [_zeros(m) for m in mu]
                return (mu, add(acc, ct_c)), [c if _inexact(c) else jnp.zeros(c.shape, jnp.float32) for c in ct_x]
            (mu, ct_consts), ct_full = lax.scan(chunk_body, (mu, ct_consts), (list(starts), full_x, full_g),
                                                reverse=True, length=n)
        ct_xs = []
        for i in range(len(xs)):
            parts = ([ct_full[i].reshape((n * k,) + ct_full[i].shape[2:])] if n else []) + ([ct_rest[i]] if r else [])
            ct_xs.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts, 0))
        return ct_consts, mu, ct_xs

    def split_args(args):
        return list(args[:nc]), list(args[nc:nc + nk]), list(args[nc + nk:])

    @jax.custom_vjp
    def f(*args):
        consts, init, xs = split_args(args)
        h, ys, _, _ = forward(consts, init, xs)
        return (*h, *ys)

    def f_fwd(*args):
        with guard():
            return _fwd(*args)

    def _fwd(*args):
        consts, init, xs = split_args(args)
        h, ys, starts, last_start = forward(consts, init, xs)
        return (*h, *ys), (consts, xs, starts, last_start)

    def f_bwd(res, cts):
        with guard(), _values_mesh(res):
            return _bwd(res, cts)

    def _bwd(res, cts):
        consts, xs, starts, last_start = res
        ct_final, ct_ys = list(cts[:nk]), list(cts[nk:])
        ct_consts, mu, ct_xs = backward(consts, xs, starts, last_start, ct_final, ct_ys, truncate is not None)
        if truncate is not None and on_truncation is not None:
            exact = backward(consts, xs, starts, last_start, ct_final, ct_ys, False)
            leaves_t = jax.tree_util.tree_leaves((ct_consts, mu, ct_xs))
            leaves_e = jax.tree_util.tree_leaves(exact)
            pairs = [(a, b) for a, b in zip(leaves_t, leaves_e) if _inexact(b)]
            num = sum(jnp.sum(jnp.abs(a - b) ** 2) for a, b in pairs)
            den = sum(jnp.sum(jnp.abs(b) ** 2) for _, b in pairs)
            jax.debug.callback(on_truncation, jnp.sqrt(num / jnp.maximum(den, np.finfo(np.float32).tiny)))
        args_all = list(consts) + list(mu) + list(xs)
        return tuple(c if _inexact(a) else None for a, c in zip(args_all, ct_consts + mu + ct_xs))

    f.defvjp(f_fwd, f_bwd)
    return f
