"""Trace-time half of the HVP rewrite: inner gradients under an outer gradient become forward-over-reverse.

For ``@hlopass.jit`` on a function that calls ``jax.grad(meta_loss)``
itself. Once JAX has differentiated such a program, the outer backward pass
is interleaved with the inner one and the inner loss is no longer
recoverable from the jaxpr, so the replacement is made while the function is
traced. :func:`intercept_gradients` (entered by ``hlopass.jit`` around the
user's function when the ``hvp`` pass is enabled, see
:meth:`hlopass.Pass.trace_context`) replaces JAX's ``vjp`` entry point, through
which ``jax.grad``, ``jax.value_and_grad``, ``jax.jacrev`` and ``jax.vjp``
all go however they were imported or created, by a wrapper that counts how
deeply the current code is nested inside functions being differentiated in
reverse mode:

- at depth zero a gradient is the ordinary one, so first-order programs
  trace to exactly the same jaxpr;
- deeper (its result is about to be differentiated again) the pullback is
  :func:`.fwdrev.fwdrev_value_and_grad` of ``<ct, f(x)>``: same
  values, but its own VJP is the forward-over-reverse Hessian-vector
  product, which keeps no inner backward activations;
- forward-mode entry points (``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``,
  ``jax.linearize``) reset the depth, since a ``custom_vjp`` cannot be
  differentiated in forward mode; so do losses that contain a ``custom_vjp``.

Only the thread that is tracing is affected. What was done goes into the
``notes`` list the context was given (one :class:`~hlopass.report.Note` per
call site: ``fwdrev_hvp`` with the inner loss's source line, or ``skip``
with the reason), which travels with the traced program to the pass's
report. Replacements are traced under the named scope :data:`.fwdrev.SCOPE`.

Functions that JAX caches by their trace (``jax.jit``, ``lax.scan`` and
``jax.checkpoint`` bodies) are traced afresh: the context sets a JAX user
context (``jax.make_user_context``, part of every such cache key) to a token
of this trace and its depth. So a ``jax.jit(jax.grad(loss))`` traced before
hlopass is traced again under the interception, and what it traces there
(custom_vjp replacements included) never reaches plain ``jax.jit`` calls
made outside hlopass.

Most programs hold no nested gradient, and tracing their jitted helpers
afresh costs time for nothing (a numpyro potential's 62 helpers, which
``initialize_model`` had traced already: 0.25 s). So ``hlopass.jit`` first
traces under :func:`observe_gradients`, which keeps JAX's caches shared with
plain calls and replaces nothing, only notes whether a gradient was taken
inside reverse-mode differentiation; the pass asks for the replacing trace
(:func:`intercept_gradients`) only then, or when the program calls a jitted
function with a backward pass inside it (:func:`inner_gradient_in_call`: one
JAX had cached, whose gradient the observation could not see being taken).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
from typing import Callable

import jax
import jax.numpy as jnp
from hlopass import internals as jx

from hlopass import report
from hlopass.jaxpr_utils import is_backward, subjaxprs
from hlopass.patches import Patches
from hlopass.report import Note

from .fwdrev import SCOPE, add_note, forward_differentiable, fwdrev_value_and_grad, in_machinery

#: Part of the key of JAX's trace caches (``jax.jit``, ``lax.scan`` bodies...): ``None`` outside
#: the interception, ``(token of this trace, nested?)`` inside it (made when hlopass is imported).
_TRACE_KEY = jx.TRACE_KEY

#: Per thread: ``tracing`` (the :class:`_Tracing` in force, or absent) and ``depth`` (how many
#: reverse-mode differentiations the current code is nested in).
_state = threading.local()

# The installation of the patched entry points, shared by all threads while any of them traces.


class _Tracing:
    """One use of :func:`intercept_gradients` (where its notes go, and its cache-key token) or of
    :func:`observe_gradients` (no token: JAX's caches shared with plain calls; ``nested`` says whether
    a gradient was taken inside reverse-mode differentiation)."""

    __slots__ = ("notes", "token", "nested")

    def __init__(self, notes: list[Note] | None):
        self.notes = notes
        # compared by identity: no other trace shares JAX's cache entries
        self.token = None if notes is None else object()
        self.nested = False

    @property
    def observing(self) -> bool:
        return self.notes is None


def _tracing() -> _Tracing | None:
    """The interception this thread is tracing under (other threads are not touched)."""
    return getattr(_state, "tracing", None)


def _enabled() -> bool:
    return _tracing() is not None


def _depth() -> int:
    return getattr(_state, "depth", 0)


@contextlib.contextmanager
def _at_depth(depth: int):
    saved = _depth()
    _state.depth = depth
    tracing = _tracing()
    if tracing is not None and tracing.observing:
        key = contextlib.nullcontext()  # not even None: a value set counts in JAX's cache keys as such
    else:
        key = _TRACE_KEY(None if tracing is None else (tracing.token, depth > 0))
    try:
        with key:
            yield
    finally:
        _state.depth = saved


def _nested(fun: Callable) -> Callable:
    """``fun`` run one level deeper (it is being differentiated in reverse mode)."""
    @functools.wraps(fun)
    def inner(*args, **kwargs):
        with _at_depth(_depth() + 1):
            return fun(*args, **kwargs)
    return inner


def _forward_barrier(fun: Callable) -> Callable:
    """``fun`` run at depth zero: under forward mode, no gradient may become a custom_vjp."""
    @functools.wraps(fun)
    def inner(*args, **kwargs):
        with _at_depth(0):
            return fun(*args, **kwargs)
    return inner


def _has_tracer(tree) -> bool:
    return any(isinstance(leaf, jx.Tracer) for leaf in jax.tree_util.tree_leaves(tree))


def _describe_function(fun: Callable) -> str:
    target = inspect.unwrap(fun) if callable(fun) else fun
    while isinstance(target, functools.partial):
        target = target.func
    code = getattr(target, "__code__", None)
    if code is None:
        return repr(fun)
    return f"{os.path.basename(code.co_filename)}:{code.co_firstlineno} ({code.co_name})"


#: Frames from these folders (this package, the engine) are never the user's call site.
_OWN_DIRS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
             os.path.dirname(os.path.abspath(report.__file__)) + os.sep)


def _call_site() -> str:
    """``file.py:LINE (function)`` of the user code that called the gradient being replaced."""
    for frame in inspect.stack(context=0)[2:]:
        path = os.path.abspath(frame.filename)
        if not path.startswith(_OWN_DIRS) and f"{os.sep}jax{os.sep}" not in path:
            return f"{os.path.basename(path)}:{frame.lineno} ({frame.function})"
    return "<unknown>"


def _user_function(fun: Callable) -> Callable:
    """The user's function behind JAX's argnums wrapper (``argnums_partial2.<locals>.f_wrapped``)."""
    if getattr(fun, "__name__", "") == "f_wrapped" and fun.__closure__:
        inner = inspect.getclosurevars(fun).nonlocals.get("f")
        if callable(inner):
            return _user_function(inner)
    return fun


def _float_leaves(tree) -> bool:
    leaves = jax.tree_util.tree_leaves(tree)
    return bool(leaves) and all(jnp.issubdtype(jnp.result_type(x), jnp.floating) for x in leaves)


def _fwdrev_vjp(fun: Callable, primals: tuple, has_aux: bool, notes: list[Note]):
    """``jax.vjp(fun, *primals)`` whose pullback's own VJP is forward-over-reverse, or ``None``.

    The pullback at cotangent ``ct`` is the gradient of the scalar
    ``<ct, fun(primals)>`` with respect to the primals, taken by
    :func:`fwdrev_value_and_grad` (``ct`` is one of its inputs, so it gets
    its cotangent, ``J dprimals``, too). ``jax.grad`` calls it with ``ct = 1``.
    A loss that forward mode cannot differentiate (it calls a ``custom_vjp``)
    gets JAX's own pullback and a skip note. ``None`` when ``fun``'s result is
    not floating point.
    """
    out = _nested(fun)(*primals)
    ans, aux = out if has_aux else (out, None)
    if not _float_leaves(ans):
        return None
    loss, site = _describe_function(_user_function(fun)), _call_site()

    def seeded(prims, ct):
        value = fun(*prims)
        value = value[0] if has_aux else value
        products = [jnp.vdot(c, y) for c, y in zip(jax.tree_util.tree_leaves(ct), jax.tree_util.tree_leaves(value))]
        return functools.reduce(lambda a, b: a + b, products)

    def pullback(ct):
        # depth 0: the machinery's own derivatives (and the loss, traced once
        # by closure_convert) must not be intercepted again
        with _at_depth(0):
            if not forward_differentiable(jax.make_jaxpr(seeded)(tuple(primals), ct).jaxpr.eqns):
                add_note(notes, Note("hvp", "skip", site,
                                     f"the inner loss {loss} calls a custom_vjp function, which forward mode "
                                     f"cannot differentiate (Hessian products left reverse-over-reverse)",
                                     "inner gradient"))
                return _original_vjp()(fun, *primals, has_aux=has_aux)[1](ct)
            with jax.named_scope(SCOPE):
                _, grads = fwdrev_value_and_grad(seeded, argnums=0)(tuple(primals), ct)
        add_note(notes, Note("hvp", "fwdrev_hvp", site,
                             f"gradient of {loss} differentiated again: Hessian products taken "
                             f"forward-over-reverse (inner backward activations not kept)"))
        return tuple(grads)

    return (ans, pullback, aux) if has_aux else (ans, pullback)


def _patched_vjp(fun, *primals, has_aux=False, **kwargs):
    original = _original_vjp()
    tracing = _tracing()
    if in_machinery() or tracing is None:
        return original(fun, *primals, has_aux=has_aux, **kwargs)
    if _depth() > 0 and not kwargs and _has_tracer(primals) and _float_leaves(primals):
        if tracing.observing:
            tracing.nested = True
            return original(_nested(fun), *primals, has_aux=has_aux, **kwargs)
        result = _fwdrev_vjp(fun, primals, has_aux, tracing.notes)
        if result is not None:
            return result
    return original(_nested(fun), *primals, has_aux=has_aux, **kwargs)


def _forward_barrier_of(original: Callable) -> Callable:
    @functools.wraps(original)
    def patched(fun, *args, **kwargs):
        return original(_forward_barrier(fun) if _enabled() else fun, *args, **kwargs)
    return patched


#: (module, attribute) pairs patched: JAX's ``vjp`` (which ``grad``,
#: ``value_and_grad`` and ``jacrev`` call through their module's global),
#: and the forward-mode entry points, which reset the depth.
def _targets():
    return [(jx.api_module, "vjp"), (jax, "vjp"), (jx.api_module, "_jvp"), (jx.api_module, "linearize"), (jax, "linearize")]


def _wrap(module, name: str, current: Callable) -> Callable:
    return _patched_vjp if name == "vjp" else _forward_barrier_of(current)


_PATCHES = Patches(_targets, _wrap)


def _original_vjp() -> Callable:
    """JAX's ``vjp`` as it was before these patches went in."""
    return _PATCHES.originals()["vjp"]


@contextlib.contextmanager
def _intercepting(notes: list[Note] | None):
    with _PATCHES.active():
        outer = _tracing()
        _state.tracing = tracing = _Tracing(notes)
        try:
            with _at_depth(0 if outer is None else _depth()):
                yield tracing
        finally:
            _state.tracing = outer
            if tracing.observing:
                _state.nested_seen = tracing.nested


@contextlib.contextmanager
def observe_gradients():
    """While active, the depth of reverse-mode differentiation is tracked as by
    :func:`intercept_gradients`, but nothing is replaced and JAX's trace caches are those of plain
    calls; :func:`nested_gradient_seen` says afterwards whether a gradient was taken inside one."""
    with _intercepting(None):
        yield


def nested_gradient_seen() -> bool:
    """Whether the last :func:`observe_gradients` to end on this thread saw a gradient taken inside
    reverse-mode differentiation (read right after the trace: a trace nested in it ends first)."""
    return getattr(_state, "nested_seen", False)


def inner_gradient_in_call(jaxpr: jx.Jaxpr, transposed: bool = False):
    """The first call (``jax.jit``, ``lax.scan``...) that is not itself part of a backward pass but
    whose program holds one (equations JAX named ``transpose``): a gradient taken inside a function
    JAX may have cached (a ``hlopass.jit`` function too); ``None`` when there is none. The backward
    pass of a first-order program transposes its calls, but those calls are named ``transpose``
    themselves."""
    for eqn in jaxpr.eqns:
        inside = transposed or is_backward(eqn)
        for sub in subjaxprs(eqn, into_own_programs=True):
            if not inside and any(is_backward(e) for e in sub.eqns):
                return eqn
            found = inner_gradient_in_call(sub, inside)
            if found is not None:
                return found
    return None


@contextlib.contextmanager
def intercept_gradients(notes: list[Note]):
    """While active, gradients nested in reverse-mode differentiation are taken forward-over-reverse.

    What is replaced (or left alone, and why) is appended to ``notes``.
    Re-entrant: a ``hlopass.jit`` traced inside another's trace gets its own
    notes and cache token and keeps the depth it was called at; the depth
    starts at zero for each outermost use. The patched entry points are
    installed while any thread traces under this context.
    """
    with _intercepting(notes):
        yield
