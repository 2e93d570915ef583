"""What the split pass says: one rewrite per loop (:func:`report_split`, with the state the loop
carries, :func:`carried_state`), one skip per region left as written (:func:`report_skip`, at the
line of the operation that prevented it), and the helpers that place entries (source lines, the
sub-program an entry was made in, a failure in one line).
"""

from __future__ import annotations

from hlopass import internals as jx

from hlopass.jaxpr_utils import aval_nbytes, aval_str
from hlopass.report import PassReport, source_line
from hlopass.sizes import format_size

from .emit import LoopPlan
from .rules import SCATTER_MONOIDS
from .shares import sharded_values


def error_text(err: Exception) -> str:
    """A failure in one line: its type and the first line of its message (at most 200 characters)."""
    text = str(err).split("\n")[0]
    return f"{type(err).__name__}: {text[:200]}"


def first_location(closed: jx.ClosedJaxpr) -> str:
    """The first known source line of a level's equations (where a failure of the whole level is reported)."""
    for eqn in closed.jaxpr.eqns:
        where = source_line(eqn)
        if where != "<unknown>":
            return where
    return "<unknown>"


def tag_inside(report: PassReport, mark: tuple[int, int], eqn) -> None:
    """Say in which sub-program (and at which line) the entries made since ``mark`` were made."""
    where = f" (inside {eqn.primitive.name} at {source_line(eqn)})"
    for entry in report.rewrites[mark[0]:]:
        if "(inside " not in entry.summary:
            entry.summary += where
    for entry in report.skipped[mark[1]:]:
        if "(inside " not in entry.reason:
            entry.reason += where


def report_skip(report: PassReport, jaxpr, seed: int, index: int, reason: str) -> None:
    """Name the operation that prevented the split, at its line (the reducer's when it has none)."""
    blocker = jaxpr.eqns[index]
    location = source_line(blocker)
    if location == "<unknown>":
        location = source_line(jaxpr.eqns[seed])
    report.skip(location, blocker.primitive.name, reason)


def named_at(jaxpr, index: int) -> str:
    """``reduce_sum (file.py:12 (f))``: equation ``index`` by primitive and source line."""
    eqn = jaxpr.eqns[index]
    return f"{eqn.primitive.name} ({source_line(eqn)})"


def report_split(report: PassReport, jaxpr, plan: LoopPlan, candidate) -> None:
    """Report the loop of ``plan`` (``candidate``: the plan's :class:`~.plan.Candidate`): what it splits, how,
    what it carries, and the largest value before and after."""
    region = plan.region
    seed = jaxpr.eqns[region.seed]
    per_unit = region.per_unit_bytes(jaxpr)
    chunk_bytes = per_unit * plan.chunk
    pos = max(range(len(seed.invars)), key=lambda k: aval_nbytes(seed.invars[k].aval))
    axis_var, axis = seed.invars[pos], region.operand_axis[(region.seed, pos)]
    remainder = region.size % plan.chunk
    how = "accumulated" if region.reducing else "written slice by slice"
    summary = (f"split {seed.primitive.name} over axis {axis} of {aval_str(axis_var.aval)} "
               f"(length {region.size}) into {plan.iterations} iterations of {plan.chunk}"
               f"{_last_step(plan, remainder)}, {len(region.eqns)} equations per iteration, "
               f"{how}; largest tensor {format_size(region.largest_bytes(jaxpr))} -> {format_size(chunk_bytes)}"
               f"{' per device' if any(v in sharded_values(jaxpr) for v in region.var_axis) else ''}"
               f"{' per step, split again inside (nested)' if candidate.nested else ''}")
    carried = carried_state(plan)
    summary += f"; carries {', '.join(carried)}"
    report.rewrite("split", seed, summary, axis=axis, size=region.size, iterations=plan.iterations, carried=carried,
                   chunk=plan.chunk, chunk_bytes=chunk_bytes, largest_before=region.largest_bytes(jaxpr),
                   largest_after=chunk_bytes, equations=len(region.eqns), nested=candidate.nested,
                   reducers=sorted(jaxpr.eqns[i].primitive.name for i in region.reducing),
                   outputs=len(plan.outputs), overlapping_last=plan.overlaps)


def _last_step(plan: LoopPlan, remainder: int) -> str:
    if not remainder:
        return ""
    if plan.overlaps:
        return f" (the last overlapping the one before by {plan.chunk - remainder})"
    return f" (last {remainder})"


_MONOID_STATE = {"add": "sum", "mul": "product", "max": "maximum", "min": "minimum", "and": "and", "or": "or",
                 "xor": "xor", "argmax": "argmax (value, index)", "argmin": "argmin (value, index)",
                 "top_k": "top-k", "scatter": "scattered result"}


def carried_state(plan: LoopPlan) -> list[str]:
    """What the loop carries from one step to the next, one phrase per value (the report says it)."""
    online = plan.region.online
    sums = {plan.jaxpr.eqns[i].outvars[0] for i in online.sums} if online is not None else set()
    maxima = set(plan.maxima)
    out = []
    for var in plan.carried:
        axis = plan.output_axis(var)
        if axis is not None:
            out.append(f"the result {aval_str(var.aval)} written slice by slice")
        elif var in maxima:
            out.append(f"a running {_MONOID_STATE[plan.monoid_of(var)]} {aval_str(var.aval)} "
                       f"(shift values recomputed from it each step)")
        elif var in sums:
            after = " (scaled by the final program's values after the loop)" if online.final and not any(
                var in plan.jaxpr.eqns[i].invars for i in online.final) else ""
            out.append(f"a running sum {aval_str(var.aval)} rescaled by exp(new shift - old shift) each step, "
                       f"with its shift{after}")
        else:
            monoid = plan.monoid_of(var)
            name = plan.jaxpr.eqns[plan.producer(var)].primitive.name
            out.append(f"a running {_MONOID_STATE.get(monoid, monoid)} {aval_str(var.aval)}" +
                       (" (scatter)" if name in SCATTER_MONOIDS else ""))
    for i, (monoid, reverse) in sorted(plan.region.scans.items()):
        eqn = plan.jaxpr.eqns[i]
        out.append(f"the running total of {eqn.primitive.name} {aval_str(plan.carry_aval(i))} "
                   f"({'from the last slice back' if reverse else 'slice to slice'})")
    return out
