"""Each value's share on one device: which values are cut across devices, and their bytes per device.

The threshold and the split size bound one device's memory: a value whose dimension is known to
be cut into k pieces counts 1/k of its bytes. Known: an explicit sharding in a value's type, a
``with_sharding_constraint``, and (for the program the pass was given, not its sub-programs) the
shardings of the ``jax.jit`` arguments that are its inputs, followed through every equation with an
axis rule and into calls, in both directions as XLA's propagation does (:func:`_propagate`). A value whose sharding is not known counts whole (the split is then finer than
each device needs, never coarser). Inside a ``shard_map`` body values already are each device's block.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import weakref
from typing import Callable

from hlopass import internals as jx

from hlopass.jaxpr_utils import aval_nbytes, call_body
from hlopass.sharding import input_shards, sharding_pieces, type_shards

from .kept import Kept
from .rules import MAPS, dim_map

#: The input types of the program the split pass was given (set by :func:`top_program`): only a
#: jaxpr whose inputs have these types takes the jax.jit arguments' shardings.
_TOP: contextvars.ContextVar = contextvars.ContextVar("hlopass_split_top", default=None)

_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _signature(jaxpr: jx.Jaxpr) -> tuple:
    return tuple((getattr(v.aval, "shape", None), str(getattr(v.aval, "dtype", ""))) for v in jaxpr.invars)


@contextlib.contextmanager
def top_program(jaxpr: jx.Jaxpr):
    """Within: the jax.jit arguments' shardings (:func:`hlopass.sharding.input_shards`) are those of
    the inputs of ``jaxpr`` (and of its rewritten versions, which have the same input types), not of a
    sub-program (a ``shard_map`` body, a loop step) that happens to have as many inputs."""
    token = _TOP.set(_signature(jaxpr))
    try:
        yield
    finally:
        _TOP.reset(token)


def _argument_shards(jaxpr: jx.Jaxpr) -> tuple | None:
    shards = input_shards()
    if shards is None or len(shards) != len(jaxpr.invars):
        return None
    top = _TOP.get()
    if top is not None and top != _signature(jaxpr):
        return None
    return shards


def sharded_values(jaxpr: jx.Jaxpr) -> dict:
    """Pieces per dimension of each value of ``jaxpr`` known to be cut across devices (see the module)."""
    inputs = _argument_shards(jaxpr)
    try:
        return _cache[jaxpr][inputs]
    except (KeyError, TypeError):
        pass
    known: dict = {}
    for k, var in enumerate(jaxpr.invars):
        pieces = type_shards(var.aval)
        if pieces is None and inputs is not None:
            entry = inputs[k]
            pieces = entry if entry is not None and len(entry) == len(var.aval.shape) else None
        if pieces is not None:
            known[var] = pieces
    known = _propagate(jaxpr, known)
    try:
        _cache.setdefault(jaxpr, {})[inputs] = known
    except TypeError:
        pass
    return known


#: Sweeps over a program (forward, then back to operands) while new pieces are found.
_SWEEPS = 3


def _propagate(jaxpr: jx.Jaxpr, known: dict) -> dict:
    """``known`` (pieces of some inputs) followed through ``jaxpr`` as XLA's sharding propagation would:
    forward from operands to results along each equation's dimension labels (into the bodies of
    calls), and back from a result to the operands computed in the program that share its
    labels (an unsharded operand of an elementwise op with a sharded one is cut the same way).
    Values whose sharding the program states (explicit types, constraints) and the inputs keep theirs."""
    fixed = set(known) | set(jaxpr.invars) | set(jaxpr.constvars)
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            pieces = type_shards(var.aval)
            if pieces is None and eqn.primitive.name == "sharding_constraint":
                pieces = sharding_pieces(eqn.params.get("sharding"), len(var.aval.shape))
            if pieces is not None:
                known[var] = pieces
                fixed.add(var)
    if not known:  # nothing is cut: the sweeps would find nothing
        return known
    maps = {}
    for _ in range(_SWEEPS):
        changed = False
        for i, eqn in enumerate(jaxpr.eqns):
            changed |= _forward(eqn, i, known, fixed, maps)
        for i in reversed(range(len(jaxpr.eqns))):
            changed |= _backward(jaxpr.eqns[i], i, known, fixed, maps)
        if not changed:
            break
    return known


def _labels(eqn, i: int, maps: dict):
    if i not in maps:
        maps[i] = dim_map(eqn)
    return maps[i]


def _merge(known: dict, fixed: set, var, axis: int, count: int) -> bool:
    if isinstance(var, jx.DropVar) or not isinstance(var, jx.Var) or var in fixed:
        return False
    current = list(known.get(var, (1,) * len(var.aval.shape)))
    if axis >= len(current) or current[axis] >= count:
        return False
    current[axis] = count
    known[var] = tuple(current)
    return True


def _forward(eqn, i: int, known: dict, fixed: set, maps: dict) -> bool:
    operands = [known.get(a) if isinstance(a, jx.Var) else None for a in eqn.invars]
    if not any(operands):
        return False
    labels = _labels(eqn, i, maps)
    changed = False
    if labels is None:
        body = call_body(eqn)
        if body is None or len(body.jaxpr.invars) != len(eqn.invars):
            return False
        inner = _propagate(body.jaxpr, {v: p for v, p in zip(body.jaxpr.invars, operands) if p is not None})
        for out, var in zip(eqn.outvars, body.jaxpr.outvars):
            for axis, count in enumerate(inner.get(var, ()) if isinstance(var, jx.Var) else ()):
                if count > 1:
                    changed |= _merge(known, fixed, out, axis, count)
        return changed
    for k, pieces in enumerate(operands):
        for d, count in enumerate(pieces or ()):
            label = labels.ins[k][d] if k < len(labels.ins) and d < len(labels.ins[k]) else None
            if count <= 1 or label is None or label in labels.reduced:
                continue
            for r, out in enumerate(eqn.outvars):
                axis = labels.out_axis(label, r)
                if axis is not None:
                    changed |= _merge(known, fixed, out, axis, count)
    return changed


def _backward(eqn, i: int, known: dict, fixed: set, maps: dict) -> bool:
    results = [known.get(v) if not isinstance(v, jx.DropVar) else None for v in eqn.outvars]
    if not any(results):
        return False
    labels = _labels(eqn, i, maps)
    if labels is None:
        return False
    changed = False
    for r, pieces in enumerate(results):
        for d, count in enumerate(pieces or ()):
            label = labels.outs[r][d] if r < len(labels.outs) and d < len(labels.outs[r]) else None
            if count <= 1 or label is None:
                continue
            for k, atom in enumerate(eqn.invars):
                axis = labels.in_axis(label, k) if k < len(labels.ins) else None
                if axis is not None:
                    changed |= _merge(known, fixed, atom, axis, count)
    return changed


def _whole(atom) -> int:
    return SIZES.get(atom, _bytes_of)


def _bytes_of(atom) -> int:
    return aval_nbytes(atom.aval) if hasattr(atom, "aval") else 0


#: Each value's bytes, kept while the split pass runs (see :func:`analyses_kept`).
SIZES = Kept()


@contextlib.contextmanager
def analyses_kept():
    """Within: each value's bytes and each equation's dimension map are computed once (the planner asks
    about the same values in every round); let go on leaving."""
    with SIZES.active(), MAPS.active():
        yield


#: Primitives whose operand XLA's SPMD partitioner gathers onto every device whatever its sharding
#: (``top_k`` along the last axis of row-sharded values, XLA:CPU with jax 0.10: an ``all-gather`` of
#: the whole operand in every step, in plain ``jax.jit`` too); their operands count whole.
GATHERED_OPERANDS = frozenset({"top_k"})


def device_bytes(jaxpr: jx.Jaxpr) -> Callable[[object], int]:
    """A function giving the bytes one device holds of a value (or literal) of ``jaxpr``: its bytes
    divided by the pieces its dimensions are cut into, when known (whole for an operand of
    :data:`GATHERED_OPERANDS`)."""
    shards = sharded_values(jaxpr)
    if not shards:
        return _whole
    gathered = {a for eqn in jaxpr.eqns if eqn.primitive.name in GATHERED_OPERANDS
                for a in eqn.invars if isinstance(a, jx.Var)}

    def share(atom) -> int:
        size = _whole(atom)
        pieces = shards.get(atom) if isinstance(atom, jx.Var) and atom not in gathered else None
        return size if not pieces else -(-size // math.prod(pieces))
    return share
