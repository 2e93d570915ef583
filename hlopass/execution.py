"""Calling compiled hlopass functions: one memory check per input signature, then jax.jit's fast path."""

from __future__ import annotations

import weakref

import jax
from jax._src import core

from hlopass.memory import MemoryCheck, enforce, measure


from jax._src.array import ArrayImpl as _ARRAY_TYPE  # noqa: E402


def leaf_signature(leaf):
    """What of an argument leaf decides a recompile: shape, dtype, weak type (or the Python type)."""
    if isinstance(leaf, jax.Array):
        return leaf.shape, leaf.dtype, getattr(leaf, "weak_type", False)
    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    if shape is not None and dtype is not None:
        return tuple(shape), dtype
    return type(leaf)


def _as_tuple(value) -> tuple:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


class CheckedJit:
    """``jax.jit`` of ``staged`` whose first compile for each signature is checked against the limit.

    A call computes a cheap signature (tree structure, shapes, dtypes, static
    values). For a new one it lowers and compiles ahead of time
    (``lower().compile()``, which fills jax.jit's caches), checks the memory
    figures, then calls through jax.jit's usual fast path. (Interrupting
    jax.jit's own trace instead would be cheaper, but jax.jit never takes its
    C++ fast path for a signature whose first trace raised.) Calls under a
    transformation (tracer arguments) call ``staged`` directly so that the
    ``hlopass_call`` it binds meets the transformation: under eager
    ``jax.grad`` its primal and backward parts then run through the checked
    primitive implementation.
    """

    def __init__(self, staged, jit_kwargs: dict, config, label: str, on_first_compile=None):
        self.unjitted = staged
        self.jitted = jax.jit(staged, **jit_kwargs)
        self.config = config
        self.label = label
        self.on_first_compile = on_first_compile
        self.static_argnums = _as_tuple(jit_kwargs.get("static_argnums"))
        self.static_argnames = _as_tuple(jit_kwargs.get("static_argnames"))
        self.checked: dict = {}

    @property
    def checks(self) -> list[MemoryCheck]:
        return list(self.checked.values())

    def signature(self, args, kwargs):
        """The cache key of a call, or ``None`` when an argument is a tracer."""
        if not kwargs and not self.static_argnums and all(type(a) is _ARRAY_TYPE for a in args):
            return tuple((a.shape, a.dtype, a.weak_type) for a in args)  # the common case, without flattening
        static = ()
        if self.static_argnums or self.static_argnames:
            static = (tuple(args[i] for i in self.static_argnums if i < len(args)),
                      tuple((k, kwargs[k]) for k in self.static_argnames if k in kwargs))
            args = tuple(a for i, a in enumerate(args) if i not in self.static_argnums)
            kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        for leaf in leaves:
            if isinstance(leaf, core.Tracer):
                return None
        return treedef, tuple(map(leaf_signature, leaves)), static

    def __call__(self, *args, **kwargs):
        key = self.signature(args, kwargs)
        if key is None:
            return self.unjitted(*args, **kwargs)
        try:
            known = key in self.checked
        except TypeError:  # an unhashable static argument: jax.jit will say so
            return self.jitted(*args, **kwargs)
        if not known:
            self.checked[key] = self.check(*args, **kwargs)
        if not kwargs:  # jax.jit's C++ fast path is only taken without a kwargs dict
            return self.jitted(*args)
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
        per_config[config] = CheckedJit(call, {}, config, name)
    return per_config[config]
