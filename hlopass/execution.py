"""Calling compiled hlopass functions: one memory check per input signature, then jax.jit's fast path."""

from __future__ import annotations

import weakref
from typing import Any

import jax
from jax._src import core

from hlopass.memory import MemoryCheck, enforce, measure


def leaf_signature(leaf) -> Any:
    """What of an argument leaf decides a recompile: shape, dtype, weak type (or the Python type)."""
    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    if shape is not None and dtype is not None:
        return (tuple(shape), str(dtype), bool(getattr(leaf, "weak_type", False)),
                getattr(leaf, "sharding", None) if isinstance(leaf, jax.Array) else None)
    return type(leaf)


class CheckedJit:
    """A ``jax.jit`` function whose first compile for each signature is checked against the limit.

    The check lowers and compiles ahead of time (``lower().compile()``), which
    also fills jax.jit's caches, so the call itself then takes jax.jit's usual
    fast path. Calls under a transformation (tracer arguments) call
    ``unjitted`` (if given) so that the ``hlopass_call`` it binds meets the
    transformation directly: under eager ``jax.grad`` its primal and backward
    parts then run through the checked primitive implementation.
    """

    def __init__(self, jitted, config, label: str, static_argnums=(), static_argnames=(), on_first_compile=None,
                 unjitted=None):
        self.jitted = jitted
        self.unjitted = unjitted
        self.config = config
        self.label = label
        self.static_argnums = tuple(static_argnums)
        self.static_argnames = tuple(static_argnames)
        self.on_first_compile = on_first_compile
        self.checks: dict[Any, MemoryCheck] = {}

    def signature(self, args, kwargs):
        static = tuple(args[i] for i in self.static_argnums if i < len(args))
        static_kw = tuple((k, kwargs[k]) for k in self.static_argnames if k in kwargs)
        dynamic_args = tuple(a for i, a in enumerate(args) if i not in self.static_argnums)
        dynamic_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        leaves, treedef = jax.tree_util.tree_flatten((dynamic_args, dynamic_kwargs))
        return treedef, tuple(map(leaf_signature, leaves)), static, static_kw

    def __call__(self, *args, **kwargs):
        leaves = jax.tree_util.tree_leaves((args, kwargs))
        if any(isinstance(leaf, core.Tracer) for leaf in leaves):
            return (self.unjitted or self.jitted)(*args, **kwargs)
        try:
            key = self.signature(args, kwargs)
            hash(key)
        except TypeError:
            key = None
        if key is None or key not in self.checks:
            check = self.check(*args, **kwargs)
            if key is not None:
                self.checks[key] = check
        return self.jitted(*args, **kwargs)

    def check(self, *args, **kwargs) -> MemoryCheck:
        """Lower and compile for these arguments, measure, warn or raise if over the limit."""
        lowered = self.jitted.lower(*args, **kwargs)
        compiled = lowered.compile()
        check = measure(compiled, lowered, self.config.memory_limit, self.label)
        if self.on_first_compile is not None:
            self.on_first_compile(args, kwargs, lowered, compiled, check)
        enforce(check, self.config.strict)
        return check


_primitive_calls: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def checked_primitive_call(jaxpr: core.ClosedJaxpr, config, name: str) -> CheckedJit:
    """A checked, compiled callable for a ``hlopass_call`` met outside any trace (eager AD, eager vmap)."""
    from hlopass.primitive import hlopass_call_p
    per_config = _primitive_calls.setdefault(jaxpr, {})
    if config not in per_config:
        def call(*args):
            return hlopass_call_p.bind(*args, jaxpr=jaxpr, config=config, name=name)
        per_config[config] = CheckedJit(jax.jit(call), config, name)
    return per_config[config]
