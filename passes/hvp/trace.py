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

Only the thread that is tracing is affected. Each replacement is traced
under a named scope ``hlopass_hvp_<n>``; the pass finds these scopes in the
jaxpr and reports them with the inner loss's source line (:data:`RECORDS`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import os
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax._src import api as jax_api
from jax._src import core

from .fwdrev import forward_differentiable, fwdrev_value_and_grad, in_machinery

SCOPE_PREFIX = "hlopass_hvp_"


@dataclasses.dataclass(frozen=True)
class Record:
    """One inner gradient replaced at trace time."""

    scope: str
    transform: str
    loss: str  # the inner loss function: ``file.py:LINE (name)``
    call_site: str  # where the gradient function was called


#: scope name -> what was replaced there
RECORDS: dict[str, Record] = {}
_counter = itertools.count()
_state = threading.local()
_lock = threading.Lock()
_active = 0
_originals: dict[str, Callable] = {}
_saved: list = []


def new_scope() -> str:
    """A fresh ``hlopass_hvp_<n>`` scope name."""
    return f"{SCOPE_PREFIX}{next(_counter)}"


def _enabled() -> bool:
    """Whether this thread is tracing under :func:`intercept_gradients` (other threads are not touched)."""
    return getattr(_state, "enabled", 0) > 0


def _depth() -> int:
    return getattr(_state, "depth", 0)


@contextlib.contextmanager
def _at_depth(depth: int):
    saved = _depth()
    _state.depth = depth
    try:
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
    return any(isinstance(leaf, core.Tracer) for leaf in jax.tree_util.tree_leaves(tree))


def _describe_function(fun: Callable) -> str:
    target = inspect.unwrap(fun) if callable(fun) else fun
    while isinstance(target, functools.partial):
        target = target.func
    code = getattr(target, "__code__", None)
    if code is None:
        return repr(fun)
    return f"{os.path.basename(code.co_filename)}:{code.co_firstlineno} ({code.co_name})"


def _call_site() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    for frame in inspect.stack(context=0)[2:]:
        path = os.path.abspath(frame.filename)
        if not path.startswith(here) and f"{os.sep}jax{os.sep}" not in path:
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


def _fwdrev_vjp(fun: Callable, primals: tuple, has_aux: bool):
    """``jax.vjp(fun, *primals)`` whose pullback's own VJP is forward-over-reverse.

    The pullback at cotangent ``ct`` is the gradient of the scalar
    ``<ct, fun(primals)>`` with respect to the primals, taken by
    :func:`fwdrev_value_and_grad` (``ct`` is one of its inputs, so it gets
    its cotangent, ``J dprimals``, too). ``jax.grad`` calls it with ``ct = 1``.
    """
    out = _nested(fun)(*primals)
    ans, aux = out if has_aux else (out, None)
    if not _float_leaves(ans):
        return None
    scope = new_scope()
    record = Record(scope, "vjp", _describe_function(_user_function(fun)), _call_site())

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
                return _originals["vjp"](fun, *primals, has_aux=has_aux)[1](ct)
            RECORDS[scope] = record
            with jax.named_scope(scope):
                _, grads = fwdrev_value_and_grad(seeded, argnums=0)(tuple(primals), ct)
        return tuple(grads)

    return (ans, pullback, aux) if has_aux else (ans, pullback)


def _patched_vjp(fun, *primals, has_aux=False, **kwargs):
    original = _originals["vjp"]
    if in_machinery() or not _enabled():
        return original(fun, *primals, has_aux=has_aux, **kwargs)
    if _depth() > 0 and not kwargs and _has_tracer(primals) and _float_leaves(primals):
        result = _fwdrev_vjp(fun, primals, has_aux)
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
    return [(jax_api, "vjp"), (jax, "vjp"), (jax_api, "_jvp"), (jax_api, "linearize"), (jax, "linearize")]


def _install() -> None:
    _originals["vjp"] = jax_api.vjp
    for module, name in _targets():
        _saved.append((module, name, getattr(module, name)))
        if name == "vjp":
            setattr(module, name, _patched_vjp)
        else:
            setattr(module, name, _forward_barrier_of(getattr(module, name)))


def _uninstall() -> None:
    while _saved:
        module, name, original = _saved.pop()
        setattr(module, name, original)
    _originals.clear()


@contextlib.contextmanager
def intercept_gradients(config=None):
    """While active, gradients nested in reverse-mode differentiation are taken forward-over-reverse.

    Re-entrant (nested ``hlopass.jit`` traces share one installation); the
    depth starts at zero for each outermost use.
    """
    global _active
    with _lock:
        if _active == 0:
            _install()
        _active += 1
    outermost = not _enabled()
    _state.enabled = getattr(_state, "enabled", 0) + 1
    try:
        with _at_depth(0 if outermost else _depth()):
            yield
    finally:
        _state.enabled -= 1
        with _lock:
            _active -= 1
            if _active == 0:
                _uninstall()


def scopes_in(name_stack: Any) -> list[str]:
    """The ``hlopass_hvp_<n>`` scopes named in an equation's name stack."""
    text = str(name_stack)
    found = []
    start = text.find(SCOPE_PREFIX)
    while start != -1:
        end = start + len(SCOPE_PREFIX)
        while end < len(text) and text[end].isdigit():
            end += 1
        found.append(text[start:end])
        start = text.find(SCOPE_PREFIX, end)
    return found
