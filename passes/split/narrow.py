"""Small slices of large values, computed from slices of what the values are made of.

A contrastive loss reads the positive logit as a column of the logits it also reduces:
``logsumexp(a @ b.T, axis=1) - (a @ b.T)[:, 0]``. The column is a ``slice`` along the key axis, and a
slice cannot be split along the axis it cuts, so a region split along keys (an online logsumexp
whose rows no longer fit) cannot take the slice in, and the whole logits row stays alive for it.

:func:`narrow_slices` gives such a slice its own computation: the equations that build the sliced
value along the cut axis (its producers, back to values within the threshold) are evaluated on
slices of their inputs, ``a @ b[0:1].T`` in the example, and the slice no longer reads the large
value. Same values up to the rounding of a product of another width.

Matches: a ``slice`` (unit strides) of a value over the threshold, computed here, whose result is
within the split size, when every producer of the value along the cut axis has split rules and no
effects. Emits: those producers on slices of their inputs (:class:`~.emit.LoopPlan` steps, one step
of the slice's width), then the slice along the other axes. Leaves alone: strided slices, slices
that keep most of the axis, values read from inputs, and producers the split rules do not cover.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from hlopass import internals as jx
from hlopass.config import Config
from hlopass.interpreter import Replacement, rewrite
from hlopass.jaxpr_utils import aval_str, trace_flat
from hlopass.report import PassReport

from .emit import LoopPlan
from .region import SplitRegion
from .rules import dim_map
from .shares import device_bytes

#: A slice is narrowed when it keeps at most this fraction of the axis it cuts.
MAX_KEPT_FRACTION = 0.25


def narrow_slices(closed: jx.ClosedJaxpr, config: Config, report: PassReport) -> jx.ClosedJaxpr:
    """``closed`` with each small slice of a large computed value computed from slices of its
    producers' inputs (``closed`` itself when none applies)."""
    jaxpr = closed.jaxpr
    share = device_bytes(jaxpr)
    producer = {var: i for i, eqn in enumerate(jaxpr.eqns) for var in eqn.outvars}
    replacements = []
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name != "slice" or any(s not in (None, 1) for s in eqn.params.get("strides") or ()):
            continue
        value = eqn.invars[0]
        if not isinstance(value, jx.Var) or value not in producer or share(value) <= config.threshold \
                or share(eqn.outvars[0]) > config.split_size:
            continue
        shape, starts, limits = value.aval.shape, eqn.params["start_indices"], eqn.params["limit_indices"]
        cut = [d for d in range(len(shape)) if limits[d] - starts[d] <= MAX_KEPT_FRACTION * shape[d]]
        if not cut:
            continue
        axis = max(cut, key=lambda d: shape[d] / max(limits[d] - starts[d], 1))
        try:
            region = producers_along(jaxpr, producer, value, axis, config.threshold, share)
            if region is None:
                continue
            plan = LoopPlan(jaxpr, region, region.inputs(jaxpr), [value], limits[axis] - starts[axis])
            build = _builder(plan, value, axis, starts, limits)
            trace_flat(build, [v.aval for v in plan.input_vars], "split_narrow_check")
        except Exception as err:  # noqa: BLE001 - the slice stays as written; the level goes on
            report.skip(eqn, "slice", f"left reading the whole {aval_str(value.aval)} ({type(err).__name__}: {err})")
            continue
        replacements.append(Replacement([i], plan.input_vars, list(eqn.outvars), build, anchor=i))
        report.rewrite("narrowed", eqn,
                       f"slice {aval_str(eqn.outvars[0].aval)} of {aval_str(value.aval)} computed from slices of "
                       f"its {len(region.eqns)} producer equation(s)' inputs along axis {axis}, not read from it",
                       equations=len(region.eqns), axis=axis)
    if not replacements:
        return closed
    return rewrite(closed, replacements, name="split_narrow")


def _builder(plan: LoopPlan, value, axis: int, starts, limits):
    def build(*inputs):
        whole = plan.step_values(jnp.int32(starts[axis]), limits[axis] - starts[axis], dict(zip(plan.input_vars, inputs)))
        part = whole[plan.carried.index(value)]
        begin = [0 if d == axis else s for d, s in enumerate(starts)]
        end = [part.shape[d] if d == axis else e for d, e in enumerate(limits)]
        return [lax.slice(part, begin, end)]
    return build


def producers_along(jaxpr: jx.Jaxpr, producer: dict, value, axis: int, threshold: int, share) -> SplitRegion | None:
    """The equations that build ``value`` along ``axis``, back to values within ``threshold`` (read
    as sliced inputs), as a region along that axis; ``None`` when one has no split rule for it."""
    eqns, label_of, var_axis, operand_axis = set(), {}, {}, {}
    work = [(value, axis)]
    while work:
        var, d = work.pop()
        if var in var_axis:
            if var_axis[var] != d:
                return None
            continue
        i = producer.get(var)
        if i is None or (var is not value and share(var) <= threshold):
            continue  # read as an input of the region, sliced along ``d``
        eqn = jaxpr.eqns[i]
        dm = dim_map(eqn)
        if dm is None or eqn.effects:
            return None
        k = eqn.outvars.index(var)
        label = dm.outs[k][d]
        if label is None or label in dm.scanned or (i in label_of and label_of[i] != label):
            return None  # a cumulative op's slice reads every element before it (or after, reversed)
        eqns.add(i)
        label_of[i] = label
        for out, labels in zip(eqn.outvars, dm.outs):
            out_axis = labels.index(label) if label in labels else None
            if var_axis.get(out, out_axis) != out_axis:
                return None
            var_axis[out] = out_axis
        for pos, atom in enumerate(eqn.invars):
            in_axis = dm.in_axis(label, pos)
            operand_axis[(i, pos)] = in_axis
            if isinstance(atom, jx.Var) and in_axis is not None:
                work.append((atom, in_axis))
            elif isinstance(atom, jx.Var) and atom in producer and share(atom) > threshold:
                return None  # a large value read whole by every step: no narrower than before
    if not eqns:
        return None
    # every region value is read along the axis by region equations (no dimension dropped on the way)
    for i in eqns:
        for pos, atom in enumerate(jaxpr.eqns[i].invars):
            if isinstance(atom, jx.Var) and atom in var_axis and var_axis[atom] != operand_axis[(i, pos)]:
                return None
    return SplitRegion(seed=producer[value], eqns=eqns, size=value.aval.shape[axis], label=label_of,
                       var_axis=var_axis, operand_axis=operand_axis, reducing={})
