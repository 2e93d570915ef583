"""Short last-axis reductions inside a split step, unrolled into elementwise steps.

XLA:CPU reduces a short minor axis (``sum(|q[:, None, :] - p[None]|, -1)`` with ``d = 3``) one
output element at a time: about 10 ns per element read, against well under 1 ns for the same
arithmetic as elementwise work along the long axes. A split step of a kNN or kernel program spends
most of its time there (``tools/bench_split_speed.py``). So, inside each step the split pass emits,
a ``reduce_sum``/``reduce_max``/``reduce_min``/``reduce_prod`` over the last axis of length at most
``SplitOptions.unroll_max_length`` is emitted as that many elementwise steps: the region that builds
its operand (grown along that axis with the split rules) is evaluated on slices of the region's
inputs, and the slices combined elementwise. Sums may round differently (a different order, as any
split); maxima and minima are exact, NaN propagating as the split pass documents.

Left alone: reductions over other axes, longer axes, small outputs, regions whose unreduced values
other equations also read (the unrolled form would have to build them whole anyway), and sums and
products over regions holding 16-bit floats: fused with its reduction, XLA:CPU evaluates such a
region in float32 and rounds once, where the unrolled terms are each rounded (soak seed
s311035862363: a logit 1.5 ulp off, a softmax flipped). A maximum is the same however its terms are
rounded.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from hlopass import internals as jx

from hlopass.graph import DataflowGraph
from hlopass.interpreter import Replacement, rewrite
from hlopass.report import PassReport, source_line

from .emit import LoopPlan
from .region import Infeasible, grow_region
from .rules import dim_map

UNROLLABLE = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod")
SLICING = ("dynamic_slice", "slice", "gather")


def _narrow_float(v) -> bool:
    dtype = getattr(getattr(v, "aval", None), "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating) and np.dtype(dtype).itemsize == 2


def short_reductions(jaxpr: jx.Jaxpr, max_length: int, min_elements: int, graph: DataflowGraph | None = None):
    """``(index, region, outputs)`` of each short last-axis reduction that can be unrolled: its operand's
    region grown along that axis, which only reductions leave; regions do not overlap."""
    found, taken = [], set()
    slicing = frozenset(i for i, eqn in enumerate(jaxpr.eqns) if eqn.primitive.name in SLICING)
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name not in UNROLLABLE:
            continue
        shape = eqn.invars[0].aval.shape
        if not shape or tuple(eqn.params["axes"]) != (len(shape) - 1,):
            continue
        if not 2 <= shape[-1] <= max_length or math.prod(shape[:-1]) < min_elements:
            continue
        dm = dim_map(eqn)
        if dm is None:
            continue
        graph = graph or DataflowGraph(jaxpr)
        try:  # a step's slices of its inputs stay whole: unrolled, they would slice the whole input
            region = grow_region(jaxpr, graph, i, dm.ins[0][-1], 0, whole=slicing)
        except Infeasible:
            continue
        if eqn.primitive.name in ("reduce_sum", "reduce_prod") and any(
                _narrow_float(v) for k in region.eqns for v in (*jaxpr.eqns[k].invars, *jaxpr.eqns[k].outvars)):
            continue
        outputs = region.outputs(jaxpr, graph)
        if region.eqns & taken or any(region.var_axis.get(v) is not None for v in outputs):
            continue  # only reductions leave the region (a NaN check beside a max is one of them)
        taken |= region.eqns
        found.append((i, region, outputs))
    return found


def unrolled_lengths(jaxpr: jx.Jaxpr, graph: DataflowGraph, max_length: int, min_elements: int) -> dict:
    """Values that unrolling would never build whole, each with the length of its unrolled axis (the
    unrolled steps build slices of it one element long)."""
    return {var: jaxpr.eqns[i].invars[0].aval.shape[-1]
            for i, region, _ in short_reductions(jaxpr, max_length, min_elements, graph)
            for var, axis in region.var_axis.items() if axis is not None}


def unroll_short_reductions(closed: jx.ClosedJaxpr, report: PassReport, max_length: int,
                            min_elements: int) -> jx.ClosedJaxpr:
    """``closed`` with its short last-axis reductions unrolled (``closed`` itself if none)."""
    jaxpr = closed.jaxpr
    replacements = []
    for i, region, outputs in short_reductions(jaxpr, max_length, min_elements):
        eqn = jaxpr.eqns[i]
        shape = eqn.invars[0].aval.shape
        plan = LoopPlan(jaxpr, region, region.inputs(jaxpr), outputs, 1, unroll=True)
        replacements.append(Replacement(sorted(region.eqns), plan.input_vars, outputs, plan.build, anchor=i))
        summary = (f"{eqn.primitive.name} over a last axis of {shape[-1]} inside a split step: "
                   f"{shape[-1]} elementwise steps over slices of its {len(region.eqns)}-equation region's inputs")
        if not any(r.kind == "unrolled" and r.summary == summary and r.location == source_line(eqn)
                   for r in report.rewrites):  # a remainder step is the same reduction again
            report.rewrite("unrolled", eqn, summary, length=shape[-1], equations=len(region.eqns))
    if not replacements:
        return closed
    return rewrite(closed, replacements, name="split_unroll")
