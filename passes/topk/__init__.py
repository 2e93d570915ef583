"""The ``topk`` pass: a large ``top_k`` as a two-level selection, exactly.

**Matches** every ``top_k`` whose axis is long (at least ``TopKOptions.min_length`` elements and
``TopKOptions.min_groups_per_k`` groups per selected element), at every level of the program (loop
bodies included, so it also reaches the per-slice selections the ``split`` pass emits).

**Emits** (:func:`grouped_top_k`): the axis cut into groups of ``g`` (about ``sqrt(n / k)``); the
best element of each group under ``top_k``'s own order (one vectorised reduction over integer keys
that order floats exactly as XLA's total order does: ``+NaN > +Inf > ... > +0 > -0 > ... > -NaN``);
the ``k`` best groups (a ``top_k`` over ``n / g`` elements); the original ``top_k`` over those
groups' ``k·g`` elements, taken in index order. The ``k`` best elements always lie in the ``k``
best groups (each better group holds an element better than any element of a worse group), and
ties break towards the lower index at both levels as ``top_k`` breaks them, so values and indices
are bit-identical to the original's. XLA:CPU's ``top_k`` sorts each row; the grouped form reads
the row once and sorts ``n / g + k·g`` elements (``tools/bench_topk.py``).

**Leaves alone** short axes, ``k`` close to the axis length, and operand types without an order
key (booleans, complex): each left top_k above the minimum length is named in the report.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core

from hlopass.config import Config
from hlopass.interpreter import at_source_of, rewrite
from hlopass.pass_base import Pass
from hlopass.report import PassReport


@dataclasses.dataclass(frozen=True)
class TopKOptions:
    """When a ``top_k`` is worth grouping, and how."""

    #: Axes shorter than this are left alone (the sort is cheap already).
    min_length: int = 2048
    #: At least this many groups for each selected element (else ``k`` is too close to ``n``).
    min_groups_per_k: int = 4
    #: Fixed group size, or 0 for ``round(sqrt(n / k))`` (at least 8).
    group_size: int = 0


#: Signed-integer view of each float width, for the total-order keys.
_BITS = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}


def order_keys(values):
    """Signed-integer keys ordered as ``top_k`` orders ``values`` (floats by IEEE total order).

    For a float, flipping every bit but the sign of a negative number turns the sign-magnitude
    bit pattern into two's complement, so integer comparison gives ``-NaN < -Inf < ... < -0 < +0
    < ... < +Inf < +NaN``, the comparison XLA's ``top_k`` uses. Integers are their own keys.
    """
    dtype = jnp.dtype(values.dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return values
    int_type = _BITS[dtype.itemsize]
    bits = lax.bitcast_convert_type(values, int_type)
    sign = lax.shift_right_arithmetic(bits, np.array(dtype.itemsize * 8 - 1, int_type))  # 0 or -1
    return lax.bitwise_xor(bits, lax.bitwise_and(sign, np.array(np.iinfo(int_type).max, int_type)))


def _lowest(dtype):
    """The value ``top_k`` ranks below every other of ``dtype`` (a padding that never wins)."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return np.array(np.iinfo(dtype).min, dtype)
    int_type = _BITS[dtype.itemsize]
    return np.array(-1, int_type).view(dtype)  # all bits set: the negative NaN with the largest payload


def supported(dtype) -> bool:
    """Whether :func:`grouped_top_k` handles operands of ``dtype`` (integers, 16/32/64-bit floats)."""
    dtype = jnp.dtype(dtype)
    return jnp.issubdtype(dtype, jnp.integer) or (jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize in _BITS)


def group_size(n: int, k: int, options: TopKOptions = TopKOptions()) -> int:
    """The group size for an axis of ``n`` elements and ``k`` selected ones."""
    return options.group_size or max(8, round(math.sqrt(n / k)))


def grouped_top_k(operand, k: int, g: int):
    """``lax.top_k(operand, k)`` along the last axis, computed by groups of ``g`` (bit-identical)."""
    *batch, n = operand.shape
    groups = -(-n // g)
    pad = groups * g - n
    if pad:
        widths = [(0, 0, 0)] * len(batch) + [(0, pad, 0)]
        operand = lax.pad(operand, _lowest(operand.dtype), widths)
    grouped = operand.reshape(*batch, groups, g)
    best_of_group = jnp.max(order_keys(grouped), axis=-1)
    _, chosen = lax.top_k(best_of_group, k)
    chosen = jnp.sort(chosen, axis=-1)  # candidates in index order: ties still go to the lower index
    candidates = jnp.take_along_axis(grouped, chosen[..., None], axis=-2).reshape(*batch, k * g)
    values, where = lax.top_k(candidates, k)
    group = jnp.take_along_axis(chosen, where // g, axis=-1)
    return values, (group * g + where % g).astype(jnp.int32)


class TopKPass(Pass):
    """Two-level exact ``top_k`` (see the module docstring)."""

    name = "topk"
    Options = TopKOptions

    def run_level(self, closed: core.ClosedJaxpr, config: Config, report: PassReport) -> core.ClosedJaxpr:
        options = self.options
        fired = []

        def rule(eqn, invals):
            if eqn.primitive.name != "top_k":
                return None
            aval = eqn.invars[0].aval
            axis = eqn.params.get("axis", aval.ndim - 1) % max(aval.ndim, 1)
            n, k = aval.shape[axis], eqn.params["k"]
            if n < options.min_length:
                return None
            if not supported(aval.dtype):
                report.skip(eqn, "top_k", f"left as written: no order key for {aval.dtype}")
                return None
            g = group_size(n, k, options)
            if -(-n // g) < options.min_groups_per_k * k:
                report.skip(eqn, "top_k", f"left as written: k = {k} is too close to the axis length {n}")
                return None
            with at_source_of(eqn):
                operand = jnp.moveaxis(invals[0], axis, -1)
                values, indices = grouped_top_k(operand, k, g)
                outs = [jnp.moveaxis(values, -1, axis), jnp.moveaxis(indices, -1, axis)]
            fired.append((eqn, n, k, g))
            return [o.astype(v.aval.dtype) for o, v in zip(outs, eqn.outvars)]

        new = rewrite(closed, eqn_rule=rule, name="topk")
        if not fired:
            return closed
        for eqn, n, k, g in fired:
            report.rewrite("grouped_top_k", eqn, f"top_k of {k} over {n} elements by {-(-n // g)} groups of {g}: "
                                                 f"sorts {-(-n // g) + k * g} elements per row, not {n}")
        return new
