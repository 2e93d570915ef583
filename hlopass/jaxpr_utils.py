"""Small facts about jaxprs: byte sizes, the one sub-jaxpr walker, tracing a function to a ClosedJaxpr."""

from __future__ import annotations

import functools
import hashlib
import heapq
import math
import re
from typing import Any, Callable, Iterator, Sequence

import numpy as np
from hlopass import internals as jx

from hlopass import progress
from hlopass.families import CUSTOM_DERIVATIVE_CALLS, INLINABLE, OWN_PROGRAMS
from hlopass.sharding import body_context


def aval_nbytes(aval) -> int:
    """Bytes of an array abstract value (0 for tokens and other non-arrays)."""
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:
        itemsize = getattr(dtype, "itemsize", 4)
    try:
        return math.prod(shape) * itemsize  # plain ints: much faster than np.prod, and analyses call it often
    except TypeError:
        return int(np.prod(shape, dtype=np.int64)) * itemsize


def aval_str(aval) -> str:
    """``f32[100,3]`` style description."""
    return aval.str_short(short_dtypes=True) if hasattr(aval, "str_short") else str(aval)


def count_equations(jaxpr) -> int:
    """Equations in ``jaxpr`` and, recursively, its sub-jaxprs."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for sub in subjaxprs(eqn):
            total += count_equations(sub)
    return total


def is_backward(eqn) -> bool:
    """Whether JAX's transposition emitted ``eqn`` (its name stack holds ``transpose(...)``)."""
    return "transpose(" in str(eqn.source_info.name_stack)


def subjaxprs(eqn, into_own_programs: bool = False) -> Sequence[jx.Jaxpr]:
    """Every (open) sub-jaxpr held in ``eqn.params``: scan/while/cond bodies, call bodies...

    A nested ``hlopass_call`` is another hlopass program, with its own settings: entered only with
    ``into_own_programs``. (A list, built without generators: every walk of a program asks this of
    every equation, and most hold none.)
    """
    if eqn.primitive.name in OWN_PROGRAMS and not into_own_programs:
        return ()
    found: list = []
    for value in eqn.params.values():
        if isinstance(value, _HOLDERS):
            _collect_jaxprs(value, found)
    return found


#: The parameter values that are or may hold a jaxpr.
_HOLDERS = (jx.ClosedJaxpr, jx.Jaxpr, tuple, list)


def _collect_jaxprs(value, found: list) -> None:
    if jx.is_closed_jaxpr(value):
        found.append(value.jaxpr)
    elif isinstance(value, jx.Jaxpr):
        found.append(value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            if isinstance(item, _HOLDERS):
                _collect_jaxprs(item, found)


def _jaxprs_in(value) -> list[jx.Jaxpr]:
    found: list = []
    if isinstance(value, _HOLDERS):
        _collect_jaxprs(value, found)
    return found


def has_subjaxprs(eqn) -> bool:
    """Whether ``eqn`` holds any sub-jaxpr."""
    return bool(subjaxprs(eqn))


def map_subjaxprs(eqn, transform: Callable[[jx.ClosedJaxpr], jx.ClosedJaxpr]) -> dict | None:
    """``eqn.params`` with every sub-jaxpr passed through ``transform``; ``None`` if none changed.

    Open ``Jaxpr`` params (``checkpoint``, ``shard_map``) are closed for the transform and
    kept as they were when the result needs constants. A ``shard_map`` body is transformed with
    its manual axes bound (:func:`hlopass.sharding.body_context`).
    """
    if eqn.primitive.name in OWN_PROGRAMS:
        return None
    changed = False

    def in_context(closed):
        with body_context(eqn), progress.at(functools.partial(_describe_body, eqn)):
            return transform(closed)

    def visit(key, value):
        nonlocal changed
        if jx.is_open_body(eqn.primitive.name, key, value):
            wrapped = jx.closed(value)
            new = in_context(wrapped)
            if new is not wrapped and new.jaxpr is not value and not new.consts:
                changed = True
                return new.jaxpr
            return value
        if jx.is_closed_jaxpr(value):
            new = in_context(value)
            if new is not value:
                changed = True
            return new
        if isinstance(value, (tuple, list)) and _jaxprs_in(value):
            items = [visit(key, v) for v in value]
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # namedtuples too
        return value

    params = {key: visit(key, value) for key, value in eqn.params.items()}
    return params if changed else None


def _describe_body(eqn) -> str:
    """``inside scan at model.py:12 (f)``: the sub-program a pass works on, for progress lines."""
    from hlopass.report import source_line
    return f"inside {eqn.primitive.name} at {source_line(eqn)}"


def call_body(eqn) -> jx.ClosedJaxpr | None:
    """The body a call-like equation runs on its operands (``pjit``, ``closed_call``,
    ``checkpoint``, ``custom_jvp_call``, ``custom_vjp_call``), closed; ``None`` for other equations.

    For custom-derivative calls this is the primal computation; the derivative
    rules are not part of it.
    """
    name = eqn.primitive.name
    if name not in INLINABLE:
        return None
    keys = ("call_jaxpr", "fun_jaxpr") if name in CUSTOM_DERIVATIVE_CALLS else ("jaxpr", "call_jaxpr")
    for key in keys:
        body = eqn.params.get(key)
        if jx.is_open_body(name, key, body):
            return jx.closed(body)
        if jx.is_closed_jaxpr(body):
            return body
    return None


def iter_eqns(jaxpr, into_own_programs: bool = False) -> Iterator[Any]:
    """All equations of ``jaxpr``, including those of sub-jaxprs (pre-order); with
    ``into_own_programs`` also those of nested ``hlopass_call`` programs."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in subjaxprs(eqn, into_own_programs):
            yield from iter_eqns(sub, into_own_programs)


def trace_flat(fun: Callable, in_avals: Sequence[Any], name: str = "hlopass") -> jx.ClosedJaxpr:
    """Trace ``fun(*flat_args) -> list`` at ``in_avals`` (exact avals, weak types kept)."""
    dbg = jx.tracing_debug_info(name, fun, tuple(in_avals), {})
    wrapped = jx.wrap_init(fun, debug_info=dbg)
    jaxpr, _, consts = jx.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
    return jx.ClosedJaxpr(jaxpr, consts)


def dce(closed: jx.ClosedJaxpr) -> jx.ClosedJaxpr:
    """Remove equations whose results are unused, keeping every input.

    A ``custom_jvp`` body traced with ``nondiff_argnums`` keeps the argument names of the whole
    function (``logsumexp(mat, axis, return_sign)`` for one input, as ott-jax writes it), which JAX's
    dead-code elimination asserts against: such names are dropped first. A program JAX still cannot
    clean is returned as it is (dead code costs the passes a little precision in their estimates,
    not correctness)."""
    jaxpr = closed.jaxpr
    info = getattr(jaxpr, "debug_info", None)
    names = getattr(info, "arg_names", None)
    if names is not None and len(names) != len(jaxpr.invars):
        jaxpr = jaxpr.replace(debug_info=info._replace(arg_names=None))
    try:
        jaxpr, _ = jx.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    except AssertionError:  # a sub-program's own debug information (see above), deeper down
        return closed
    return jx.ClosedJaxpr(jaxpr, closed.consts)


def largest_values(closed, limit: int = 5) -> list[tuple[str, int, str]]:
    """The ``limit`` largest values defined in ``closed`` (recursively), as (type, bytes, source line)."""
    sized = ((aval_nbytes(var.aval), var, eqn) for eqn in iter_eqns(closed) for var in eqn.outvars)
    return _described(heapq.nlargest(limit, (row for row in sized if row[0]), key=lambda row: row[0]))


def largest_value_bytes(closed) -> int:
    """The bytes of the largest value anywhere in ``closed``: its inputs and constants, every
    equation's results, and the same in every sub-jaxpr (loop, branch and call bodies; not nested
    ``hlopass_call`` programs, which are checked on their own). One walk over the avals."""
    jaxpr = getattr(closed, "jaxpr", closed)
    largest = max((aval_nbytes(v.aval) for v in (*jaxpr.invars, *jaxpr.constvars)), default=0)
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            n = aval_nbytes(v.aval)
            if n > largest:
                largest = n
        for sub in subjaxprs(eqn):
            n = largest_value_bytes(sub)
            if n > largest:
                largest = n
    return largest


def values_above(closed, threshold: int, limit: int = 8) -> list[tuple[str, int, str]]:
    """Values defined inside ``closed`` (recursively; its inputs and outputs aside) larger than
    ``threshold`` bytes, largest first, as (type, bytes, primitive at source line)."""
    top = getattr(closed, "jaxpr", closed)
    outputs = {v for v in top.outvars if isinstance(v, jx.Var)}
    sized = ((aval_nbytes(var.aval), var, eqn) for eqn in iter_eqns(closed) for var in eqn.outvars)
    above = (row for row in sized if row[0] > threshold and row[1] not in outputs)
    return _described(heapq.nlargest(limit, above, key=lambda row: row[0]))


def _described(rows) -> list[tuple[str, int, str]]:
    from hlopass.report import source_line
    return [(aval_str(var.aval), nbytes, f"{eqn.primitive.name} at {source_line(eqn)}") for nbytes, var, eqn in rows]


def last_uses(jaxpr: jx.Jaxpr) -> dict[jx.Var, int]:
    """For each variable, the index of the last equation reading it (``len(eqns)`` for outputs)."""
    last: dict[jx.Var, int] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for atom in eqn.invars:
            if isinstance(atom, jx.Var):
                last[atom] = i
    for atom in jaxpr.outvars:
        if isinstance(atom, jx.Var):
            last[atom] = len(jaxpr.eqns)
    return last


# -- a program's text ---------------------------------------------------------------------------

def program_text(closed: jx.ClosedJaxpr) -> str:
    """A text naming ``closed`` in any process: each equation's primitive, operands (numbered in order
    of definition; literals by value and type), parameters (sub-programs written the same way, others
    by ``repr``) and result types, and a digest of each constant's value (sub-programs' too). Written
    in a third of the time ``str(jaxpr)`` takes. Addresses in reprs (a PRNG implementation's
    functions) are left out. Raises :class:`UnnamedProgram` for a constant that is not an array.

    The persistent cache's name for a program (:mod:`hlopass.program_cache`), and the remat pass's key
    for a program it meets again."""
    parts: list = []
    _describe(closed.jaxpr, parts, {})
    parts.extend(map(_const_text, closed.consts))
    return _ADDRESS.sub("", repr(parts))


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class UnnamedProgram(Exception):
    """A program :func:`program_text` cannot name (a constant that is not an array)."""


def _describe(jaxpr: jx.Jaxpr, parts: list, types: dict) -> None:
    """Append ``jaxpr``'s text to ``parts``; ``types`` memoises the avals' texts (the same few recur)."""
    numbers: dict = {}

    def type_text(aval):
        text = types.get(aval)
        if text is None:
            text = types[aval] = aval.str_short()
        return text

    def number(v):
        if isinstance(v, jx.Literal):
            value = v.val
            return (value.tobytes() if hasattr(value, "tobytes") else repr(value), type_text(v.aval))
        n = numbers.get(v)
        if n is None:
            n = numbers[v] = len(numbers)
        return n

    for v in (*jaxpr.constvars, *jaxpr.invars):
        number(v)
        parts.append(type_text(v.aval))
    parts.append(len(jaxpr.constvars))
    for eqn in jaxpr.eqns:
        parts.append(eqn.primitive.name)
        parts.append(tuple(map(number, eqn.invars)))
        for name, value in eqn.params.items():
            parts.append(name)
            _describe_param(value, parts, types)
        for v in eqn.outvars:
            number(v)
            parts.append(type_text(v.aval))
    parts.append(tuple(map(number, jaxpr.outvars)))
    parts.append(repr(jaxpr.effects) if jaxpr.effects else "")


def _describe_param(value, parts: list, types: dict) -> None:
    if isinstance(value, jx.ClosedJaxpr):
        parts.append("{")
        _describe(value.jaxpr, parts, types)
        parts.extend(map(_const_text, value.consts))
        parts.append("}")
    elif isinstance(value, jx.Jaxpr):
        parts.append("{")
        _describe(value, parts, types)
        parts.append("}")
    elif isinstance(value, (tuple, list)) and value and isinstance(value[0], (jx.Jaxpr, jx.ClosedJaxpr)):
        for item in value:
            _describe_param(item, parts, types)
    else:
        parts.append(repr(value))


def _const_text(const) -> str:
    try:
        value = np.asarray(const)
    except Exception as err:  # noqa: BLE001 - then the program is not cached
        raise UnnamedProgram(type(err).__name__) from None
    if value.dtype == object:
        raise UnnamedProgram("object constant")
    return f"{value.dtype}{value.shape}:{hashlib.sha256(value.tobytes()).hexdigest()}"
