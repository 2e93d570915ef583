"""``hlopass.jit``: ``jax.jit`` with the pass pipeline in between tracing and lowering."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import weakref
from typing import Any, Callable

import jax
from hlopass import internals as jx

from hlopass import settings, sharding
from hlopass.call import as_lowered, hlopass_call_p
from hlopass.checked import CheckedJit, WholeProgram, measured_by_caller
from hlopass.config import Config
from hlopass.errors import ConfigError
from hlopass.jaxpr_utils import trace_flat
from hlopass.memory import enforce, measure
from hlopass.pipeline import collector_paused, forget, retrace_wanted, run_pipeline, trace_contexts

logger = logging.getLogger("hlopass")

_ENV_VARS = tuple(settings.SETTINGS.values())

#: Called as ``listener(function, config, args, kwargs)`` after a function's first compile for a
#: signature when ``config.dump_to`` is set; :mod:`hlopass` installs the dump writer of
#: :mod:`hlopass.inspection` here (the API does not import the tools built on it). A listener that
#: raises is logged as a warning: a dump never breaks the user's call.
compile_listeners: list[Callable] = []

#: The keywords ``jax.jit`` accepts (everything ``hlopass.jit`` passes through to it).
_JAX_JIT_KEYWORDS = tuple(name for name, p in inspect.signature(jax.jit).parameters.items()
                          if p.kind is inspect.Parameter.KEYWORD_ONLY)


def jit(fun: Callable | None = None, /, *, threshold: Any = None, split_size: Any = None,
        memory_limit: Any = None, passes: Any = None, dump_to: Any = None, strict: Any = None,
        min_gain: Any = None, never_worse: Any = None, **jit_kwargs):
    """Like ``jax.jit``, with hlopass's passes applied to the traced program.

    Accepts everything ``jax.jit`` accepts (``static_argnums``,
    ``static_argnames``, ``donate_argnums``, ...) plus hlopass settings that
    override the environment for this function: ``threshold``,
    ``split_size``, ``memory_limit`` (sizes such as ``"100MB"`` or bytes;
    ``"off"`` turns one off), ``passes`` (names or a comma-separated string),
    ``dump_to`` (a folder) and ``strict`` (raise ``MemoryLimitError``
    instead of warning), ``min_gain`` (the factor by which a reordering of products must cut
    their multiply-adds) and ``never_worse`` (``False``: run the rewritten program even when the
    passes could not bound it and XLA says the original needs less). Usable as ``@hlopass.jit``
    and ``@hlopass.jit(...)``.

    The keywords are checked when ``hlopass.jit`` is applied: an unknown keyword or a bad setting is a
    :class:`~hlopass.ConfigError`; bad ``jax.jit`` arguments (``static_argnums`` out of range, a
    generator function, ...) raise what ``jax.jit`` raises. The environment is read when the
    function is called.
    """
    overrides = {k: v for k, v in dict(threshold=threshold, split_size=split_size, memory_limit=memory_limit,
                                       passes=passes, dump_to=dump_to, strict=strict, min_gain=min_gain,
                                       never_worse=never_worse).items() if v is not None}
    unknown = sorted(set(jit_kwargs) - set(_JAX_JIT_KEYWORDS))
    if unknown:
        raise ConfigError(
            f"hlopass.jit got unknown keyword argument(s) {', '.join(unknown)}; accepted keywords: hlopass's "
            f"settings {', '.join(settings.SETTINGS)} and jax.jit's {', '.join(_JAX_JIT_KEYWORDS)}")
    settings.check_keywords(overrides)
    if fun is None:
        return lambda f: jit(f, **overrides, **jit_kwargs)
    if isinstance(fun, HlopassFunction):  # re-wrapping: new settings on the same function
        return HlopassFunction(fun._fun, {**fun._overrides, **overrides}, {**fun._jit_kwargs, **jit_kwargs})
    return HlopassFunction(fun, overrides, jit_kwargs)


class HlopassFunction:
    """A function compiled by hlopass; behaves like the object ``jax.jit`` returns."""

    def __init__(self, fun: Callable, overrides: dict, jit_kwargs: dict):
        # jax.jit checks the function and its arguments now, raising what it raises; the result is
        # also the unrewritten program, run when the passes cannot bound a program and it needs less.
        # A callable that cannot be weakly referenced fails when called, as under jax.jit (whose
        # object for it may crash the interpreter when collected, so none is made here).
        self._plain = jax.jit(fun, **jit_kwargs) if _weakly_referenceable(fun) or not callable(fun) else None
        functools.update_wrapper(self, fun)
        self._fun = fun
        self._overrides = dict(overrides)
        self._jit_kwargs = dict(jit_kwargs)
        self._per_config: dict[Config, CheckedJit] = {}
        self._config_cache: dict[tuple, Config] = {}

    @property
    def label(self) -> str:
        return getattr(self._fun, "__qualname__", getattr(self._fun, "__name__", "function"))

    @property
    def trace_count(self) -> int:
        """How many times the function was traced (for all settings)."""
        return sum(checked.unjitted.trace_count for checked in self._per_config.values())

    # -- configuration -------------------------------------------------------------
    def config(self) -> Config:
        """The settings in force now (environment read now, keyword overrides applied)."""
        key = tuple(map(_environ_get, _ENV_VARS))
        config = self._config_cache.get(key)
        if config is None:
            config = self._config_cache[key] = settings.resolve(self._overrides)
        return config

    # -- staging ---------------------------------------------------------------------
    def _checked(self, config: Config) -> CheckedJit:
        checked = self._per_config.get(config)
        if checked is None:
            on_first_compile = None
            if config.dump_to:
                on_first_compile = functools.partial(_notify_compile, weakref.ref(self), config)
            staged = staged_function(self._fun, config, self.label)
            checked = self._per_config[config] = CheckedJit(staged, self._jit_kwargs, config, self.label,
                                                            on_first_compile, plain=self._plain)
        return checked

    # -- jax.jit's interface -------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if jx.disable_jit.value:  # as jax.jit does: run the function eagerly
            return self._fun(*args, **kwargs)
        return self._checked(self.config())(*args, **kwargs)

    def __get__(self, instance, owner=None):
        return self if instance is None else functools.partial(self, instance)

    def trace(self, *args, **kwargs) -> "Traced":
        """Trace as ``jax.jit(...).trace`` does; the result also offers the rewritten jaxpr and report."""
        return self.trace_with(self.config(), *args, **kwargs)

    def trace_with(self, config: Config, *args, **kwargs) -> "Traced":
        """:meth:`trace` with the given settings instead of those in force now."""
        checked = self._checked(config)
        traced = Traced(checked.jitted.trace(*args, **kwargs), config, self.label)
        traced.retrace = functools.partial(_trace_afresh, checked, *_abstractly((args, kwargs)))
        traced.input_shards = sharding.argument_shards(checked, args, kwargs)
        traced.input_shardings = sharding.argument_shardings(checked, args, kwargs)
        return traced

    def lower(self, *args, **kwargs) -> "Lowered":
        """Lower to the rewritten StableHLO (``.as_text()``); ``.compile()`` checks the memory limit."""
        return self.trace(*args, **kwargs).lower()

    def eval_shape(self, *args, **kwargs):
        return self._checked(self.config()).jitted.eval_shape(*args, **kwargs)

    def memory_checks(self) -> list:
        """The memory checks made so far, one per compiled signature and configuration."""
        return [c for jitted in self._per_config.values() for c in jitted.checks]

    def __repr__(self) -> str:
        return f"<hlopass.jit {self.label}>"


class StagedFunction:
    """What ``jax.jit`` traces for a hlopass function: the user's function traced to a jaxpr and
    staged as one ``hlopass_call`` with the settings.

    There is one per (function object, settings), shared by every ``hlopass.jit`` of that function:
    ``jax.jit`` keys its trace and compile caches by the function it is given, so a fresh
    ``hlopass.jit(f)`` reuses them as a fresh ``jax.jit(f)`` does. It holds the user's function
    weakly (the registry of these objects must not keep it alive); ``jax.jit`` needs the function
    to be weakly referenceable anyway.
    """

    def __init__(self, fun: Callable, config: Config, label: str):
        self._fun = weakref.ref(fun)
        self.config = config
        self.label = label
        self.trace_count = 0
        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            value = getattr(fun, attr, None)
            if value is not None:
                setattr(self, attr, value)
        base = fun
        while isinstance(base, functools.partial):
            base = base.func
        code = getattr(inspect.unwrap(base), "__code__", None)
        if code is not None:  # jax's debug info (source line of the function) reads it
            self.__code__ = code
        try:
            self.__signature__ = inspect.signature(fun)  # static_argnames resolve against it
        except (TypeError, ValueError):
            self.__signature__ = None

    def __call__(self, *args, **kwargs):
        fun = self._fun()
        if fun is None:  # unreachable while a hlopass.jit of the function exists
            raise RuntimeError(f"hlopass: the function {self.label} no longer exists")
        self.trace_count += 1
        config, label = self.config, self.label
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        dynamic = [isinstance(leaf, jx.Tracer) for leaf in leaves]
        out_tree = []
        notes: list = []
        again: tuple[str, ...] = ()

        def flat_fun(*dynamic_values):
            values = iter(dynamic_values)
            full = [next(values) if d else leaf for leaf, d in zip(leaves, dynamic)]
            call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, full)
            with trace_contexts(config, notes, again):
                result = fun(*call_args, **call_kwargs)
            out_leaves, tree = jax.tree_util.tree_flatten(result)
            out_tree[:] = [tree]
            return out_leaves

        dynamic_leaves = [leaf for leaf, d in zip(leaves, dynamic) if d]
        in_avals = [jx.typeof(x) for x in dynamic_leaves]
        with collector_paused():  # see pipeline.collector_paused: the passes' trace-time work allocates too
            closed = trace_flat(flat_fun, in_avals, label)
            again = retrace_wanted(closed, config)
            if again:  # a pass's trace-time work matters here: traced once more, with its findings alone
                notes.clear()
                closed = trace_flat(flat_fun, in_avals, label)
        consts = list(closed.consts)
        body = jx.ClosedJaxpr(jx.convert_constvars_jaxpr(closed.jaxpr), ()) if consts else closed
        outs = hlopass_call_p.bind(*consts, *dynamic_leaves, jaxpr=body, config=config, name=label,
                                   notes=tuple(notes))
        return jax.tree_util.tree_unflatten(out_tree[0], outs)


#: id(function) -> (weak reference to it, {config: StagedFunction}); an entry goes when its function does.
_staged: dict[int, tuple[weakref.ref, dict]] = {}


def staged_function(fun: Callable, config: Config, label: str) -> StagedFunction:
    """The :class:`StagedFunction` of ``fun`` with ``config`` (one per function object and settings).

    Raises ``TypeError`` for a function that cannot be weakly referenced, as ``jax.jit`` does when
    such a function is called.
    """
    key = id(fun)
    entry = _staged.get(key)
    if entry is None or entry[0]() is not fun:
        ref = weakref.ref(fun, lambda _, key=key: _forget(key))
        entry = _staged[key] = (ref, {})
    per_config = entry[1]
    staged = per_config.get(config)
    if staged is None:
        staged = per_config[config] = StagedFunction(fun, config, label)
    return staged


def _forget(key: int) -> None:
    entry = _staged.get(key)
    if entry is not None and entry[0]() is None:
        del _staged[key]


def _weakly_referenceable(obj) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True


def _read_environ_fast():
    # os.environ.get encodes and decodes on every call; the bytes mapping
    # behind it answers the same question about twenty times faster.
    data = getattr(os.environ, "_data", None)
    if isinstance(data, dict) and os.name == "posix":
        return lambda name: data.get(name.encode())
    return os.environ.get


_environ_get = _read_environ_fast()


def _hlopass_eqn(closed_jaxpr):
    for eqn in closed_jaxpr.jaxpr.eqns:
        if eqn.primitive is hlopass_call_p:
            return eqn
    raise ValueError("no hlopass_call in the traced program")


class Traced:
    """``jax.stages.Traced`` plus ``rewritten_jaxpr`` and ``report``."""

    def __init__(self, traced, config, label: str = "function"):
        self._traced = traced
        self.config = config
        self.label = label
        self.input_shards = None  # how the arguments are sharded (the passes see it, as when lowering)
        self.input_shardings = None  # and their NamedShardings
        self.retrace: Callable | None = None  # the same trace under a new identity (lowered afresh)

    def __getattr__(self, name):
        return getattr(self._traced, name)

    @property
    def original_jaxpr(self) -> jx.ClosedJaxpr:
        """The user's program as traced, before any pass."""
        return _hlopass_eqn(self._traced.jaxpr).params["jaxpr"]

    @functools.cached_property
    def _result(self):
        eqn = _hlopass_eqn(self._traced.jaxpr)
        program, used = as_lowered(eqn)   # what the lowering's passes get: dead code removed
        shards, shardings = self.input_shards, self.input_shardings
        if shards is not None:  # the constants come first
            shards = (None,) * (len(eqn.params["jaxpr"].in_avals) - len(shards)) + tuple(shards)
        if shardings is not None and shards is not None:
            shardings = (None,) * (len(shards) - len(shardings)) + tuple(shardings)
        shards = tuple(s for s, keep in zip(shards, used) if keep) if shards is not None else None
        shardings = tuple(s for s, keep in zip(shardings, used) if keep) if shardings is not None else None
        with sharding.inputs_sharded(shards, shardings):
            return run_pipeline(program, eqn.params["config"], eqn.params["name"], eqn.params["notes"]), used

    @property
    def rewritten_jaxpr(self) -> jx.ClosedJaxpr:
        """The program after the passes, taking the traced program's inputs (those it does not read too);
        :attr:`original_jaxpr` itself when no pass rewrote it."""
        result, used = self._result
        if not result.changed:
            return self.original_jaxpr
        closed = result.jaxpr
        if all(used):
            return closed
        kept = iter(closed.jaxpr.invars)
        invars = [next(kept) if keep else jx.Var(aval) for keep, aval in zip(used, self.original_jaxpr.in_avals)]
        return jx.ClosedJaxpr(closed.jaxpr.replace(invars=invars), closed.consts)

    @property
    def report(self):
        """The :class:`~hlopass.report.PipelineReport` of the passes."""
        return self._result[0].report

    def lower(self, **kwargs) -> "Lowered":
        # the program is compiled whole and measured by Lowered.compile: the passes leave to that
        # measurement the compiles that would only confirm a fit (as a call does, CheckedJit.check)
        whole = WholeProgram(compares=False)
        token = measured_by_caller.set(whole)
        try:
            lowered = self._traced.lower(**kwargs)
        finally:
            measured_by_caller.reset(token)
        relower = (lambda: self.retrace().lower(**kwargs)) if self.retrace is not None else None
        return Lowered(lowered, self, self.config, self.label, whole if relower is not None else None, relower)


def _abstractly(tree):
    """``tree`` with each JAX array a ``ShapeDtypeStruct`` (its sharding where it is committed to one):
    what tracing needs, without holding the arrays."""
    def abstract(a):
        if not isinstance(a, jax.Array) or isinstance(a, jx.Tracer) or not hasattr(a, "weak_type"):
            return a  # (a PRNG key array is kept as it is)
        return jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type,
                                    sharding=a.sharding if getattr(a, "committed", False) else None)
    try:
        return jax.tree_util.tree_map(abstract, tree)
    except Exception:  # noqa: BLE001 - an argument it cannot describe: keep them as they are
        return tree


def _trace_afresh(checked: CheckedJit, args, kwargs):
    """``checked`` 's function traced again under a new identity: JAX lowers it afresh (the passes run)."""
    return checked.afresh().trace(*args, **kwargs)


class Lowered:
    """``jax.stages.Lowered`` of the rewritten program; ``compile()`` also checks the memory limit."""

    def __init__(self, lowered, traced: Traced, config, label: str, whole: WholeProgram | None = None,
                 relower: Callable | None = None):
        self._lowered = lowered
        self._traced = traced
        self.config = config
        self.label = label
        self.memory_check = None
        self._whole = whole      # the passes' result whose fit this compile confirms
        self._relower = relower  # lowers again, the passes checking for themselves

    def __getattr__(self, name):
        return getattr(self._lowered, name)

    @property
    def report(self):
        return self._traced.report

    def compile(self, *args, **kwargs):
        """Compile, measure against the memory limit (warn, or raise when strict). Where a pass took its
        program as fitting without compiling it, this measurement confirms it; when it does not fit,
        the passes run again, checking, and the program they give is lowered and compiled instead."""
        compiled = self._lowered.compile(*args, **kwargs)
        check = measure(compiled, self._lowered, self.config.memory_limit, self.label, list_largest="over_limit")
        result, self._whole = (self._whole.result if self._whole is not None else None), None
        if result is not None and not result.confirm(check):
            forget(result)
            self._lowered = self._relower()
            compiled = self._lowered.compile(*args, **kwargs)
            check = measure(compiled, self._lowered, self.config.memory_limit, self.label, list_largest="over_limit")
        elif result is not None and not result.settled:
            result.check, result.settled = check, True
        self.memory_check = check
        enforce(self.memory_check, self.config.strict)
        return compiled


def _notify_compile(function_ref, config, args, kwargs, lowered, compiled, check) -> None:
    function = function_ref()
    if function is None:
        return
    for listener in compile_listeners:
        try:
            listener(function, config, args, kwargs)
        except Exception as err:  # noqa: BLE001 - a dump must never break the user's call
            logger.warning("hlopass: %s for %s failed (the call goes on): %s: %s",
                           getattr(listener, "__name__", "a compile listener"), function.label,
                           type(err).__name__, err)
