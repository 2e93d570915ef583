"""The checked call: a compiled hlopass program, checked against the memory limit once per signature.

:class:`CheckedJit` is what ``hlopass.jit`` functions call, and what the ``hlopass_call``
primitive's implementation calls (:func:`checked_primitive_call`: eager ``jax.grad`` /
``jax.vmap``). A new signature is lowered and compiled ahead of time (the compile ``jax.jit`` would
make anyway), measured whole, settled by :func:`hlopass.never_worse.decide` when the passes could
not bound the program, warned about or raised on; then calls take ``jax.jit``'s own fast path.
"""

from __future__ import annotations

import contextvars
import functools
import time
import weakref
from typing import Callable

import jax
from hlopass import internals as jx

from hlopass.memory import MemoryCheck, enforce, measure
from hlopass.never_worse import decide
from hlopass.pipeline import PipelineResult, forget, run_pipeline


def program_name(name: str) -> str:
    """The name a hlopass program's function (or lowered call) takes: ``hlopass_<name>``, made safe."""
    return "hlopass_" + ("".join(c if c.isalnum() or c == "_" else "_" for c in name)[:60] or "call")


def leaf_signature(leaf):
    """What of an argument leaf decides a recompile: shape, dtype, weak type, sharding (or the Python type)."""
    if isinstance(leaf, jax.Array):
        return leaf.shape, leaf.dtype, getattr(leaf, "weak_type", False), getattr(leaf, "sharding", None)
    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    if shape is not None and dtype is not None:
        return tuple(shape), dtype
    return type(leaf)


_UNCOMPARABLE = object()


class _StaticArgumentError(Exception):
    """Tracing failed for a call with static arguments: let jax.jit's call raise its own error."""


#: jax.jit keywords that place or lay out data: calls with them always go through jax.jit itself.
_PLACEMENT_KEYWORDS = frozenset({"in_shardings", "out_shardings", "device", "backend", "compiler_options"})


class WholeProgram:
    """Set by :meth:`CheckedJit.check` (and ``Lowered`` of :mod:`hlopass.api`) while it lowers a hlopass function's trace (one
    ``hlopass_call``, lowered first): that program is compiled and measured whole by the caller, so
    its lowering (:mod:`hlopass.call`) makes no check of its own and hands over its pipeline result,
    and its passes leave the compiles that would only confirm a fit to that measurement
    (:func:`hlopass.memory.deferring_checks`)."""

    __slots__ = ("result", "compares")

    def __init__(self, compares: bool = True):
        self.result = None
        #: whether the caller compiles the original program too when the passes could not bound theirs
        #: (``CheckedJit.check``); if not (``Lowered.compile``), the lowering compares them itself
        self.compares = compares


#: A :class:`WholeProgram` while :meth:`CheckedJit.check` or ``Traced.lower`` lowers; read by the ``hlopass_call``
#: lowering rule.
measured_by_caller: contextvars.ContextVar = contextvars.ContextVar("hlopass_measured_by_caller", default=None)


class CheckedJit:
    """``jax.jit`` of ``staged`` whose first compile for each signature is checked against the limit.

    A call computes a cheap signature (tree structure, shapes, dtypes, static
    values; static arguments resolved as ``jax.jit`` resolves them). For a new
    one it lowers and compiles ahead of time (``lower().compile()``, which fills
    jax.jit's caches), measures the program whole, keeps the better of the
    rewritten and the original program when the passes could not bound it
    (``plain`` is jax.jit of the original), warns or raises, then calls
    through jax.jit's usual fast path. Calls inside a trace (tracer arguments,
    an outer ``jax.jit``, eager ``jax.grad`` / ``jax.vmap``) take jax.jit's
    cached trace of ``staged`` and bind its ``hlopass_call`` there, so that
    JAX transforms the primitive (and nothing is traced again); its
    lowering rule or its implementation then checks the derived programs.
    """

    def __init__(self, staged, jit_kwargs: dict, config, label: str, on_first_compile=None,
                 plain: Callable | None = None, result: PipelineResult | None = None):
        self.unjitted = staged
        self.jit_kwargs = dict(jit_kwargs)
        self.jitted = jax.jit(staged, **jit_kwargs)
        self.plain = plain
        self.result = result
        self.config = config
        self.label = label
        self.on_first_compile = on_first_compile
        info = self.jitted._jit_info
        self.static_argnums = tuple(info.static_argnums)
        self.static_argnames = tuple(info.static_argnames)
        self._bind_directly = not (_PLACEMENT_KEYWORDS & set(jit_kwargs))
        self._entries: dict = {}

    @property
    def checks(self) -> list[MemoryCheck]:
        return [check for check, _ in self._entries.values()]

    def signature(self, args, kwargs):
        """The cache key of a call, or ``None`` when an argument is a tracer."""
        if not kwargs and not self.static_argnums and all(type(a) is jx.ArrayImpl for a in args):
            return tuple((a.shape, a.dtype, a.weak_type, a.sharding) for a in args)  # common case: no flattening
        static = ()
        if self.static_argnums or self.static_argnames:
            static = (tuple(args[i] for i in self.static_argnums if i < len(args)),
                      tuple((k, kwargs[k]) for k in self.static_argnames if k in kwargs))
            args = tuple(a for i, a in enumerate(args) if i not in self.static_argnums)
            kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        for leaf in leaves:
            if isinstance(leaf, jx.Tracer):
                return None
        return treedef, tuple(map(leaf_signature, leaves)), static

    def __call__(self, *args, **kwargs):
        key = self.signature(args, kwargs)
        if key is None:
            return self.in_trace(args, kwargs)
        try:
            entry = self._entries.get(key)
        except Exception:  # noqa: BLE001 - a static argument that cannot be hashed or compared
            entry = _UNCOMPARABLE
        if entry is _UNCOMPARABLE:  # jax.jit raises its own error for it
            return self.jitted(*args, **kwargs)
        if entry is None:
            if self.result is None and not jx.trace_state_clean():
                return self.in_trace(args, kwargs)  # concrete arguments, but staged into a trace
            try:
                entry = self.check(args, kwargs)
            except _StaticArgumentError:  # raise what jax.jit's call raises for them
                return self.jitted(*args, **kwargs)
            self._entries[key] = entry
        target = entry[1]
        if not kwargs:  # jax.jit's C++ fast path is only taken without a kwargs dict
            return target(*args)
        return target(*args, **kwargs)

    def afresh(self):
        """``jax.jit`` of the same function under a new identity: it traces and lowers it afresh (the
        passes run again; the jitted function keeps the program it lowered)."""
        return jax.jit(_restaged(self.unjitted), **self.jit_kwargs)

    def in_trace(self, args, kwargs):
        """Bind the ``hlopass_call`` of jax.jit's cached trace in the current trace."""
        if not self._bind_directly:
            return self.jitted(*args, **kwargs)
        params, args_flat = jx.jit_infer_params(self.jitted._fun, self.jitted._jit_info, args, kwargs)
        closed = params.params["jaxpr"]
        return jx.tree_unflatten(params.out_tree, _bind_here(closed, args_flat))

    def check(self, args, kwargs) -> tuple[MemoryCheck, Callable]:
        """Lower and compile for these arguments, measure, keep the better program if the passes
        could not bound it, warn or raise if over the limit. Returns the check and what to call."""
        try:
            traced = self.jitted.trace(*args, **kwargs)
        except Exception as err:  # noqa: BLE001
            if self.static_argnums or self.static_argnames:
                # jax.jit's call (not its trace) says what is wrong with a static argument
                raise _StaticArgumentError() from err
            raise
        result = self.result
        target = self.jitted
        if result is not None and result.kept == "original" and self.plain is not None:
            check, _, lowered = self._compile(self.plain.trace(*args, **kwargs), "original")
            target = self.plain
        else:
            whole = WholeProgram() if result is None else None
            token = measured_by_caller.set(whole)
            try:
                check, seconds, lowered = self._compile(traced)
            finally:
                measured_by_caller.reset(token)
            if whole is not None:
                result = whole.result
            if result is not None and not result.confirm(check):
                # a pass took its program as fitting and it does not: run the passes again, checking
                # (a fresh jax.jit: the one above keeps the program it lowered)
                forget(result)
                target = self.afresh()
                check, seconds, lowered = self._compile(target.trace(*args, **kwargs))
                result = None  # settled by its lowering
            if result is not None and not result.settled:
                if result.needs_comparison and self.plain is not None:
                    plain_check, plain_seconds, plain_lowered = self._compile(self.plain.trace(*args, **kwargs),
                                                                              "original")
                    if decide(result, check, seconds, plain_check, plain_seconds) == "original":
                        check, target, lowered = plain_check, self.plain, plain_lowered
                else:
                    result.check = check
                result.settled = True
        if self.on_first_compile is not None:
            self.on_first_compile(args, kwargs, lowered, None, check)
        enforce(check, self.config.strict)
        return check, target

    def _compile(self, traced, which: str = "") -> tuple[MemoryCheck, float, object]:
        start = time.perf_counter()
        lowered = traced.lower()
        compiled = lowered.compile()
        seconds = time.perf_counter() - start
        label = f"{self.label} ({which})" if which else self.label
        return measure(compiled, lowered, self.config.memory_limit, label, list_largest="over_limit"), seconds, lowered


_primitive_calls: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def checked_primitive_call(jaxpr: jx.ClosedJaxpr, config, name: str, notes: tuple = ()) -> CheckedJit:
    """A checked, compiled callable for a ``hlopass_call`` met outside any trace (eager AD, eager vmap).

    It compiles the pipeline's result itself (and ``jaxpr`` when the passes could not bound it), as
    functions that hold the programs weakly: the cache is keyed by ``jaxpr``.
    """
    per_config = _primitive_calls.setdefault(jaxpr, {})
    key = (config, notes)
    checked = per_config.get(key)
    if checked is None:
        result = run_pipeline(jaxpr, config, name, notes)
        plain = jax.jit(_evaluator(jaxpr, name)) if result.changed else None
        checked = per_config[key] = CheckedJit(_evaluator(result.jaxpr, name), {}, config, name, plain=plain,
                                               result=result)
    return checked


def _bind_here(closed: jx.ClosedJaxpr, args) -> list:
    """Evaluate ``closed`` in the current trace, each equation under the caller's source line (as
    jax.jit's own equation would be), not under the line recorded when it was traced."""
    env = dict(zip(closed.jaxpr.constvars, closed.consts))
    env.update(zip(closed.jaxpr.invars, args))

    def read(atom):
        return atom.val if isinstance(atom, jx.Literal) else env[atom]

    for eqn in closed.jaxpr.eqns:
        params = eqn.primitive.get_bind_params(eqn.params)
        outs = eqn.primitive.bind(*map(read, eqn.invars), **params)
        env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]))
    return [read(v) for v in closed.jaxpr.outvars]


def _restaged(staged: Callable) -> Callable:
    """``staged`` under a new identity, so that ``jax.jit`` traces and lowers it afresh."""
    @functools.wraps(staged)
    def again(*args, **kwargs):
        return staged(*args, **kwargs)
    return again


def _evaluator(closed: jx.ClosedJaxpr, name: str) -> Callable:
    """``jaxpr_as_fun(closed)`` holding ``closed`` weakly (as ``jx._get_jaxpr_as_fun`` does)."""
    ref = weakref.ref(closed)

    def evaluate(*args):
        program = ref()
        return jx.eval_jaxpr(program.jaxpr, program.consts, *args)

    evaluate.__name__ = evaluate.__qualname__ = program_name(name)
    return evaluate
