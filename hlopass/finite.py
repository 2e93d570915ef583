"""The finite guard: a rewrite's values where they are all finite, the written program's otherwise.

A rewrite that multiplies sums out or factors them (``Σ_nm a_n·b_m = Σa·Σb``, a reordered matrix
chain) is exact for finite numbers, but IEEE arithmetic on infinities is not distributive:
``Inf·0`` is NaN in one order and ``Inf`` in the other. An infinity or a NaN reaching such a sum
makes its result non-finite in every order (a product with an infinity is ±Inf or NaN, a sum with
one is too), so the rewritten value is checked once it is computed: finite everywhere, it is the
answer; otherwise the written program is run as JAX would run it (a branch taken only then), and its
non-finite entries are plain JAX's. The check reads only the rewrite's (small) result. The branch is
emitted only where it costs no memory the rewrite saved (:func:`why_unguarded`); elsewhere an infinity
may give NaN where plain JAX gives ±Inf, or the other way round.

That holds while every axis has a length. Over an empty axis a sum is an exact zero, and the order
decides whether a NaN or an infinity is multiplied by it (``NaN·0``: NaN everywhere it spreads) or
summed away with it (nothing left): :func:`has_empty_axis` operands are left as written.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from hlopass.jaxpr_utils import aval_nbytes, aval_str
from hlopass.sharding import distributed_type, input_shards
from hlopass.sizes import format_size


#: What a pass's report says of a chain it leaves as written for :func:`has_empty_axis`.
EMPTY_AXIS = "an operand has an empty axis; left as written, where NaN and infinities spread as written"


def has_empty_axis(avals) -> bool:
    """Whether some of ``avals`` has an axis of length 0: a rewrite that sums over it in another
    order than written can drop the NaN or infinity that the written program spreads (see above)."""
    return any(0 in getattr(a, "shape", ()) for a in avals)


def finite_or_written(fast: Sequence[Any], written: Callable[..., Sequence[Any]], operands: Sequence[Any]) -> list:
    """``fast`` (a rewrite's values) if every floating one is finite everywhere, else
    ``written(*operands)``, in a ``lax.cond`` (only the branch taken runs). Values keep the types
    ``written`` gives them."""
    fast = list(fast)
    checks = [jnp.all(jnp.isfinite(v)) for v in fast if jnp.issubdtype(jnp.result_type(v), jnp.inexact)]
    if not checks:
        return fast
    ok = functools.reduce(jnp.logical_and, checks)
    shapes = [np.shape(v) for v in fast]

    def keep(*_):
        return fast

    def rerun(*args):
        outs = list(written(*args))
        return [jnp.asarray(o).astype(jnp.result_type(f)).reshape(s) for o, f, s in zip(outs, fast, shapes)]
    return list(lax.cond(ok, keep, rerun, *operands))


#: The capability of a later pass that bounds the written program kept for non-finite values.
SPLITS_REGIONS = "split_regions"


def why_unguarded(result_aval, written_peak_bytes: int, threshold: int | None, splitter: str | None,
                  operand_avals=(), built_operand_avals=()) -> str | None:
    """Why a rewrite gets no finite guard, or ``None`` when it gets one: the written program peaks
    over the threshold and a later pass (``splitter``) splits it in the guard's branch, so the branch
    holds at most a split step (a branch keeping a smaller written program whole would hold memory
    the rewrite saved); and the result is at most the threshold (a branch around a larger one would
    hide it from the split pass, which must split its readers), and so is every operand the program
    builds (``built_operand_avals``; the branch takes its operands whole, so a larger one would be built
    whole on every call: the memory and time the split saves, e.g. the ``K_uf``-sized cotangents of an
    SGPR gradient; the program's own arguments cost nothing). Not in a sharded program: the split
    pass does not always see the arguments' shardings inside the branch, so it could split a sharded
    axis there (gathering it onto every device); a process with several devices counts as sharded."""
    if _sharded(list(operand_avals) + [result_aval]):
        return "not guarded: a sharded program"
    if threshold is not None and aval_nbytes(result_aval) > threshold:
        return f"not guarded: the {aval_str(result_aval)} result is over the threshold"
    large = [a for a in built_operand_avals if threshold is not None and aval_nbytes(a) > threshold]
    if large:
        return f"not guarded: its operand {aval_str(large[0])} is over the threshold (a branch would need it whole)"
    if threshold is None or written_peak_bytes <= threshold:
        return f"not guarded: the written form ({format_size(written_peak_bytes)}) is under the threshold"
    if splitter is None:
        return "not guarded: no later pass splits the written form"
    return None


def _sharded(avals) -> bool:
    """Whether the program being rewritten may be cut across devices: these values or its arguments
    are, or the process has several devices (a backward program lowered under an outer ``jax.jit``
    does not always learn its operands' shardings)."""
    shards = input_shards() or ()
    return (jax.device_count() > 1 or any(distributed_type(a) for a in avals)
            or any(s is not None and any(p > 1 for p in s) for s in shards))
