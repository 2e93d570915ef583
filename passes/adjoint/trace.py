"""Trace-time half of the adjoint rewrite: ``jax.grad`` called inside a hlopass function.

Once JAX has differentiated a program, its scan is already split into a
forward scan that keeps every step's values and a transposed one. So, while
``hlopass.jit`` traces the user's function (:meth:`hlopass.Pass.retrace_context`:
with default options, only the second trace of a function whose first one
holds a transposed scan),
:func:`intercept_gradients` replaces JAX's ``vjp`` entry point (through which
``jax.grad``, ``jax.value_and_grad``, ``jax.jacrev`` and ``jax.vjp`` go) by
one that traces the function being differentiated to a jaxpr, replaces its
linear-recurrence scans by adjoint scans (:func:`.rewrite.rewrite_scans`)
and differentiates that instead. A function without such a scan is
differentiated as it was written: JAX differentiates the probe's jaxpr, replayed equation by
equation (with their source lines), so the user's Python runs once, not twice; only when the
function itself takes a reverse-mode derivative inside (an inner ``jax.grad``, which the hvp pass
may replace at its own depth) is it traced again under the derivative.
Derivatives taken by this pass's own machinery are left alone.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable

import jax
from hlopass import internals as jx

from hlopass.patches import Patches
from hlopass.report import Note
from hlopass.sharding import typed_mesh

from .rewrite import in_machinery, own_machinery, rewrite_scans

_state = threading.local()


def _targets():
    return [(jx.api_module, "vjp"), (jax, "vjp")]


def _in_a_mesh(trace: Callable, values):
    """``trace()`` in the current context, or, where JAX refuses it there for want of a mesh, in the
    explicit mesh of ``values``' types (:func:`~hlopass.sharding.typed_mesh`). A ``vmap`` of a custom
    derivative over explicitly sharded values, traced outside their mesh, puts their shardings on an
    empty mesh ("Resource axis ... not found in mesh: ()"); inside the mesh, other operations (a
    Cholesky factorisation's ``select``) check shardings that JAX leaves unchecked outside it, so the
    mesh is entered only when it is missing."""
    try:
        return trace()
    except ValueError as err:
        if "not found in mesh" not in str(err):
            raise
        with typed_mesh(values):
            return trace()


def _patched(original: Callable) -> Callable:
    @functools.wraps(original)
    def vjp(fun, *primals, has_aux=False, **kwargs):
        tracing = getattr(_state, "tracing", None)
        if tracing is None or in_machinery() or kwargs:
            if tracing is not None and in_machinery():
                _state.nested = getattr(_state, "nested", 0) + 1  # seen by a probe around it
            return original(fun, *primals, has_aux=has_aux, **kwargs)
        notes, memory_limit, options, check, seen = tracing
        seen.append(getattr(fun, "__name__", "a function"))
        nested_before = getattr(_state, "nested", 0)
        with own_machinery():  # a probe at this depth: does ``fun`` hold a linear recurrence?
            probe, shape = _in_a_mesh(lambda: jax.make_jaxpr(fun, return_shape=True)(*primals), primals)
            found: list[Note] = []
            if rewrite_scans(probe, memory_limit, options, found, check) is probe:
                notes.extend(n for n in found if n not in notes)   # the scans left alone, and why
                if getattr(_state, "nested", 0) != nested_before:  # an inner gradient: trace it again
                    return original(fun, *primals, has_aux=has_aux)   # differentiated as written
                return original(_replay(fun, probe, shape), *primals, has_aux=has_aux)

        @functools.wraps(fun)
        def rewritten(*args):
            def traced():
                with own_machinery():
                    closed, shape = jax.make_jaxpr(fun, return_shape=True)(*args)
                    new = rewrite_scans(closed, memory_limit, options, notes, check)
                return jx.jaxpr_as_fun(new)(*jax.tree_util.tree_leaves(args)), shape
            outs, shape = _in_a_mesh(traced, args)
            return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), list(outs))
        return original(rewritten, *primals, has_aux=has_aux)
    return vjp


def _replay(fun: Callable, probe: jx.ClosedJaxpr, shape) -> Callable:
    """``fun`` as the equations of its traced ``probe`` (same results, same source lines), for JAX
    to differentiate without running the user's Python a second time."""
    out_tree = jax.tree_util.tree_structure(shape)

    @functools.wraps(fun)
    def replayed(*args):
        outs = jx.jaxpr_as_fun(probe)(*jax.tree_util.tree_leaves(args))
        return jax.tree_util.tree_unflatten(out_tree, list(outs))
    return replayed


_PATCHES = Patches(_targets, lambda module, name, current: _patched(current))


@contextlib.contextmanager
def intercept_gradients(notes: list[Note], memory_limit, options, check: bool):
    """While active (in this thread), reverse-mode derivatives of functions with linear recurrences
    are taken by the adjoint method; findings go to ``notes``. Yields the list of the names of the
    functions differentiated meanwhile."""
    seen: list[str] = []
    with _PATCHES.active():
        outer = getattr(_state, "tracing", None)
        _state.tracing = (notes, memory_limit, options, check, seen)
        try:
            yield seen
        finally:
            _state.tracing = outer
