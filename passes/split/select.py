"""Exact two-level ``top_k`` for a step's long rows (the split kNN's selection).

XLA's ``top_k`` over a long last axis is a sort-like kernel on one thread, and in a split kNN step it
costs more than the distances themselves (README, *Speed*). :func:`grouped_top_k` selects the same
elements in two cheap passes instead:

1. the row is cut into groups of ``G`` neighbours; each group's best element is found by an integer
   ``max`` over keys that order floats exactly as ``top_k`` does (``-0 < +0``, NaN above ``+Inf``),
   in the same fusion as the values themselves (which XLA need not store);
2. ``top_k`` of the ``n / G`` group bests picks ``k`` groups; their ``k·G`` elements (and the ``n % G``
   elements after the last whole group) are gathered, in index order, and ``top_k`` of those is the
   answer.

It is exact, ties included: an element among the true ``k`` best lies in a group whose best is at
least as good, and ``k`` groups with better (key, group index) would each hold an element better than it.
Candidates are kept in index order, so ties go to the earlier index, as ``lax.top_k`` breaks them.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

#: Group size: large enough that ``top_k`` sees ``G`` times fewer elements, small enough that the
#: ``k·G`` candidates stay cheap (``python -m tools.profile_knn --group G``: 16 and 32 are within 10%).
GROUP = 32
#: The grouped selection is used when a row holds at least this many groups per selected element
#: (fewer, and the gather of ``k·G`` candidates costs what it saves).
MIN_GROUPS_PER_K = 4


def group_size(n: int, k: int) -> int | None:
    """The group size for ``top_k`` of ``k`` over rows of ``n``, or ``None`` to bind ``top_k`` whole."""
    for g in (GROUP, GROUP // 2, GROUP // 4):
        if g >= 2 and k >= 1 and n // g >= MIN_GROUPS_PER_K * k:
            return g
    return None


def order_keys(values, back_to=None):
    """Integers ordered as ``lax.top_k`` orders floating ``values`` (a float's bits, its negatives'
    flipped: the IEEE total order; NaN made positive beforehand sorts above ``+Inf``); with
    ``back_to`` (a float dtype), the floats of such keys (the map is its own inverse)."""
    dtype = jnp.dtype(values.dtype if back_to is None else back_to)
    if not jnp.issubdtype(dtype, jnp.floating):
        return values
    int_type = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[dtype.itemsize]
    bits = lax.bitcast_convert_type(values, int_type) if back_to is None else values
    magnitude = jnp.array(jnp.iinfo(int_type).max, int_type)
    keys = bits ^ (lax.shift_right_arithmetic(bits, jnp.array(8 * dtype.itemsize - 1, int_type)) & magnitude)
    return keys if back_to is None else lax.bitcast_convert_type(keys, dtype)


def grouped_top_k(values, k: int, index_dtype):
    """``lax.top_k(values, k)`` along the last axis, computed in two levels (module docstring), or
    ``None`` when the rows are too short for it to pay (:func:`group_size`)."""
    n = values.shape[-1]
    g = group_size(n, k)
    if g is None:
        return None
    lead, groups = values.shape[:-1], n // g
    whole = lax.slice_in_dim(values, 0, groups * g, axis=values.ndim - 1).reshape(*lead, groups, g)
    # back to floats for the groups' top_k: XLA:CPU's TopK kernel takes floats, integers get a full sort
    best = order_keys(lax.reduce_max(order_keys(whole), (values.ndim,)), values.dtype)
    _, chosen = lax.top_k(best, k)
    chosen = lax.sort(chosen.astype(jnp.int32), dimension=values.ndim - 1)
    taken = jnp.take_along_axis(whole, chosen[..., None], axis=values.ndim - 1)
    where = chosen[..., None] * g + lax.broadcasted_iota(jnp.int32, (*lead, k, g), values.ndim)
    candidates, indices = taken.reshape(*lead, k * g), where.reshape(*lead, k * g)
    if groups * g < n:
        tail = n - groups * g
        candidates = lax.concatenate(
            [candidates, lax.slice_in_dim(values, groups * g, n, axis=values.ndim - 1)], values.ndim - 1)
        indices = lax.concatenate(
            [indices, groups * g + lax.broadcasted_iota(jnp.int32, (*lead, tail), values.ndim - 1)], values.ndim - 1)
    top, at = lax.top_k(candidates, k)
    return [top, jnp.take_along_axis(indices, at, axis=values.ndim - 1).astype(index_dtype)]
