"""Each value's share on one device: which values are cut across devices, and their bytes per device.

The threshold and the split size bound one device's memory: a value whose dimension is known to
be cut into k pieces counts 1/k of its bytes. Known: an explicit sharding in a value's type, a
``with_sharding_constraint``, and (for the program the pass was given, not its sub-programs) the
shardings of the ``jax.jit`` arguments that are its inputs, followed forward through every equation
with an axis rule. A value whose sharding is not known counts whole (the split is then finer than
each device needs, never coarser). Inside a ``shard_map`` body values already are each device's block.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import weakref
from typing import Callable

from jax._src import core

from hlopass.jaxpr_utils import aval_nbytes
from hlopass.sharding import input_shards, sharding_pieces, type_shards

from .rules import dim_map

#: The input types of the program the split pass was given (set by :func:`top_program`): only a
#: jaxpr whose inputs have these types takes the jax.jit arguments' shardings.
_TOP: contextvars.ContextVar = contextvars.ContextVar("hlopass_split_top", default=None)

_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _signature(jaxpr: core.Jaxpr) -> tuple:
    return tuple((getattr(v.aval, "shape", None), str(getattr(v.aval, "dtype", ""))) for v in jaxpr.invars)


@contextlib.contextmanager
def top_program(jaxpr: core.Jaxpr):
    """Within: the jax.jit arguments' shardings (:func:`hlopass.sharding.input_shards`) are those of
    the inputs of ``jaxpr`` (and of its rewritten versions, which have the same input types), not of a
    sub-program (a ``shard_map`` body, a loop step) that happens to have as many inputs."""
    token = _TOP.set(_signature(jaxpr))
    try:
        yield
    finally:
        _TOP.reset(token)


def _argument_shards(jaxpr: core.Jaxpr) -> tuple | None:
    shards = input_shards()
    if shards is None or len(shards) != len(jaxpr.invars):
        return None
    top = _TOP.get()
    if top is not None and top != _signature(jaxpr):
        return None
    return shards


def sharded_values(jaxpr: core.Jaxpr) -> dict:
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
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            pieces = type_shards(var.aval)
            if pieces is None and eqn.primitive.name == "sharding_constraint":
                pieces = sharding_pieces(eqn.params.get("sharding"), len(var.aval.shape))
            if pieces is not None:
                known[var] = pieces
        operands = [known.get(a) if isinstance(a, core.Var) else None for a in eqn.invars]
        if not any(operands) or any(not isinstance(v, core.DropVar) and v in known for v in eqn.outvars):
            continue
        labels = dim_map(eqn)
        if labels is None:
            continue
        for k, pieces in enumerate(operands):
            for d, count in enumerate(pieces or ()):
                label = labels.ins[k][d] if k < len(labels.ins) and d < len(labels.ins[k]) else None
                if count <= 1 or label is None or label in labels.reduced:
                    continue
                for r, out in enumerate(eqn.outvars):
                    axis = labels.out_axis(label, r)
                    if axis is not None and not isinstance(out, core.DropVar):
                        current = list(known.get(out, (1,) * len(out.aval.shape)))
                        current[axis] = max(current[axis], count)
                        known[out] = tuple(current)
    try:
        _cache.setdefault(jaxpr, {})[inputs] = known
    except TypeError:
        pass
    return known


def _whole(atom) -> int:
    return aval_nbytes(atom.aval) if hasattr(atom, "aval") else 0


def device_bytes(jaxpr: core.Jaxpr) -> Callable[[object], int]:
    """A function giving the bytes one device holds of a value (or literal) of ``jaxpr``: its bytes
    divided by the pieces its dimensions are cut into, when known."""
    shards = sharded_values(jaxpr)
    if not shards:
        return _whole

    def share(atom) -> int:
        size = _whole(atom)
        pieces = shards.get(atom) if isinstance(atom, core.Var) else None
        return size if not pieces else -(-size // math.prod(pieces))
    return share
