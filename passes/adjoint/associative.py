"""``lax.associative_scan`` of a first-order linear recurrence, differentiated by the adjoint method.

Selective-scan code computes ``h_t = a_t * h_{t-1} + b_t`` in parallel as
``lax.associative_scan(combine, (a, b))`` with ``combine((a1, b1), (a2, b2)) =
(a1 * a2, a2 * b1 + b2)`` (``a`` possibly broadcast over trailing axes of
``b``). Traced, that is a log-depth tree of slices, products, pads and
concatenations, and ``jax.grad`` keeps every level of it. While hlopass traces
the user's function (:meth:`AdjointPass.trace_context`), :func:`intercept`
replaces ``jax.lax.associative_scan``: a call whose ``fn`` is that combine
(checked numerically on random elements, :func:`is_linear_combine`) becomes a
``custom_vjp`` (:func:`linear_associative_scan`) whose forward is the
original call and whose backward solves the adjoint recursion
``mu_t = g_t + a_{t+1} mu_{t+1}`` as one reverse associative scan, keeping only
``a`` and the outputs: ``ct_b = mu``, ``ct_a = mu * h_{t-1}`` (summed over the
broadcast axes) plus the same for the cumulative product ``A_t``.

Leaves alone (calls the original): any other ``fn`` (a max-plus scan, a
non-linear combine, one reading traced values), elements that are not a pair
of arrays, integer elements. A call made by a name bound before hlopass
traced (``from jax.lax import associative_scan``) is not seen.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from hlopass import internals as jx

from hlopass.patches import Patches
from hlopass.report import Note

NAME = "adjoint"
_state = threading.local()
#: The scan the backward pass uses (never the patched one).
_ORIGINAL = lax.associative_scan


def _where() -> str:
    import os
    frame = jx.user_frame(jx.current_source_info().traceback)
    if frame is None:
        return "<unknown>"
    return f"{os.path.basename(frame.file_name)}:{frame.start_line} ({frame.function_name})"


def _expand(a, ndim: int):
    return a.reshape(a.shape + (1,) * (ndim - a.ndim))


def is_linear_combine(fn: Callable, a_aval, b_aval) -> bool:
    """Whether ``fn((a1, b1), (a2, b2)) == (a1 * a2, a2 * b1 + b2)`` on random elements shaped like
    one step of ``a`` and ``b`` (``a``'s shape a prefix of ``b``'s), in float64 where possible."""
    if a_aval.shape != b_aval.shape[:len(a_aval.shape)] or len(a_aval.shape) < 1:
        return False
    if not (jnp.issubdtype(a_aval.dtype, jnp.inexact) and jnp.issubdtype(b_aval.dtype, jnp.inexact)):
        return False
    rng = np.random.default_rng(0)

    def draw(aval):
        shape = (2,) + tuple(aval.shape[1:])
        x = rng.uniform(0.5, 1.5, shape)
        if jnp.issubdtype(aval.dtype, jnp.complexfloating):
            x = x + 1j * rng.uniform(-0.5, 0.5, shape)
        return np.asarray(x, dtype=aval.dtype)
    a, b = draw(a_aval), draw(b_aval)
    try:
        with jax.ensure_compile_time_eval():
            out = fn((a[:1], b[:1]), (a[1:], b[1:]))
            got_a, got_b = (np.asarray(o) for o in out)
    except Exception:  # noqa: BLE001 - a combine we cannot evaluate alone is not ours to rewrite
        return False
    want_a = a[:1] * a[1:]
    want_b = _expand(a[1:], b.ndim) * b[:1] + b[1:]
    tol = 1e-5 if np.finfo(np.dtype(a_aval.dtype)).bits <= 32 else 1e-12
    return (got_a.shape == want_a.shape and got_b.shape == want_b.shape
            and np.allclose(got_a, want_a, rtol=tol, atol=tol) and np.allclose(got_b, want_b, rtol=tol, atol=tol))


def _combine(x, y):
    a1, b1 = x
    a2, b2 = y
    return a1 * a2, _expand(a2, b1.ndim) * b1 + b2


def _shift_earlier(x, fill):
    """``x_{t-1}`` along axis 0 (``fill`` at t = 0)."""
    return jnp.concatenate([jnp.full_like(x[:1], fill), x[:-1]], 0)


def _reverse_linear(a, g):
    """``mu_t = g_t + a_{t+1} mu_{t+1}`` (mu_{T-1} = g_{T-1}) as a reverse associative scan."""
    a_next = jnp.concatenate([a[1:], jnp.zeros_like(a[:1])], 0)
    return _ORIGINAL(_combine, (a_next, g), reverse=True)[1]


def _reduce_to(x, ndim: int):
    return x.sum(axis=tuple(range(ndim, x.ndim))) if x.ndim > ndim else x


def linear_associative_scan(original: Callable, fn: Callable) -> Callable:
    """``f(a, b) -> (A, h)`` along axis 0, the forward ``original(fn, (a, b))``, its VJP by adjoints."""

    @jax.custom_vjp
    def f(a, b):
        return tuple(original(fn, (a, b)))

    def fwd(a, b):
        A, h = original(fn, (a, b))
        return (A, h), (a, A, h)

    def bwd(res, cts):
        a, A, h = res
        gA, gh = cts
        mu = _reverse_linear(a, gh)
        ct_b = mu
        ct_a = _reduce_to(mu * _shift_earlier(h, 0), a.ndim)
        nu = _reverse_linear(a, gA)
        ct_a = ct_a + nu * _shift_earlier(A, 1)
        return ct_a.astype(a.dtype), ct_b.astype(h.dtype)

    f.defvjp(fwd, bwd)
    return f


def _patched(original: Callable) -> Callable:
    @functools.wraps(original)
    def associative_scan(fn, elems, reverse: bool = False, axis: int = 0):
        notes = getattr(_state, "notes", None)
        leaves = jax.tree_util.tree_leaves(elems)
        if notes is None or not isinstance(elems, (tuple, list)) or len(elems) != 2 or len(leaves) != 2:
            return original(fn, elems, reverse=reverse, axis=axis)
        a, b = elems
        a_aval, b_aval = jax.typeof(a), jax.typeof(b)
        ax = axis % max(len(a_aval.shape), 1)
        if ax >= len(a_aval.shape) or not is_linear_combine(fn, _moved(a_aval, ax), _moved(b_aval, ax)):
            return original(fn, elems, reverse=reverse, axis=axis)
        site = _where()
        T = a_aval.shape[ax]
        note = Note(NAME, "adjoint_associative", site,
                    f"linear recurrence over {T} steps as lax.associative_scan (h' = a*h + b): gradient by the "
                    f"adjoint method (one reverse associative scan; keeps a and the outputs instead of every "
                    f"level of the scan's tree)", "associative_scan",
                    (("form", "associative"), ("length", T), ("reverse", reverse)))
        if note not in notes:
            notes.append(note)

        def orig_axis0(f_, e):
            return original(f_, e, reverse=False, axis=0)
        x = [jnp.moveaxis(v, ax, 0) for v in (a, b)]
        if reverse:
            x = [jnp.flip(v, 0) for v in x]
        A, h = linear_associative_scan(orig_axis0, fn)(*x)
        if reverse:
            A, h = jnp.flip(A, 0), jnp.flip(h, 0)
        out = (jnp.moveaxis(A, 0, ax), jnp.moveaxis(h, 0, ax))
        return type(elems)(out) if isinstance(elems, tuple) else list(out)
    return associative_scan


def _moved(aval, ax: int):
    shape = list(aval.shape)
    shape.insert(0, shape.pop(ax))
    return jax.ShapeDtypeStruct(tuple(shape), aval.dtype)


_PATCHES = Patches(lambda: [(jax.lax, "associative_scan")],
                   lambda module, name, current: _patched(current))


@contextlib.contextmanager
def intercept(notes: list[Note]):
    """While active (in this thread), linear-recurrence ``lax.associative_scan`` calls get adjoint VJPs."""
    with _PATCHES.active():
        outer = getattr(_state, "notes", None)
        _state.notes = notes
        try:
            yield
        finally:
            _state.notes = outer
