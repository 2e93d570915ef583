"""Small facts about jaxprs: byte sizes, sub-jaxprs, tracing a function to a ClosedJaxpr."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import numpy as np
from jax._src import api_util, core
from jax._src import linear_util as lu
from jax._src.interpreters import partial_eval as pe

#: Primitives that are plain calls of a sub-jaxpr and can be inlined. A
#: ``checkpoint`` body only matters across a forward/backward boundary, which
#: hlopass programs no longer have once JAX has split them into calls.
CALL_PRIMITIVES = ("pjit", "jit", "closed_call", "core_call", "checkpoint", "remat", "remat2")


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


def subjaxprs(eqn) -> Iterator[core.Jaxpr]:
    """Every (open) sub-jaxpr held in ``eqn.params``: scan/while/cond bodies, call bodies..."""
    for value in eqn.params.values():
        yield from _jaxprs_in(value)


def _jaxprs_in(value) -> Iterator[core.Jaxpr]:
    if isinstance(value, core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _jaxprs_in(item)


def iter_eqns(jaxpr) -> Iterator[Any]:
    """All equations of ``jaxpr``, including those of sub-jaxprs (pre-order)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in subjaxprs(eqn):
            yield from iter_eqns(sub)


def trace_flat(fun: Callable, in_avals: Sequence[Any], name: str = "hlopass") -> core.ClosedJaxpr:
    """Trace ``fun(*flat_args) -> list`` at ``in_avals`` (exact avals, weak types kept)."""
    dbg = api_util.debug_info(name, fun, tuple(in_avals), {})
    wrapped = lu.wrap_init(fun, debug_info=dbg)
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
    return core.ClosedJaxpr(jaxpr, consts)


def dce(closed: core.ClosedJaxpr) -> core.ClosedJaxpr:
    """Remove equations whose results are unused, keeping every input."""
    jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=True)
    return core.ClosedJaxpr(jaxpr, closed.consts)


def largest_values(closed, limit: int = 5) -> list[tuple[str, int, str]]:
    """The ``limit`` largest values defined in ``closed`` (recursively), as (type, bytes, source line)."""
    from hlopass.report import source_line
    found = []
    for eqn in iter_eqns(closed):
        for var in eqn.outvars:
            nbytes = aval_nbytes(var.aval)
            if nbytes:
                found.append((aval_str(var.aval), nbytes, f"{eqn.primitive.name} at {source_line(eqn)}"))
    found.sort(key=lambda row: -row[1])
    return found[:limit]
