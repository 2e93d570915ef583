"""Liveness over a jaxpr: how many bytes are live at each equation.

A value is live from the equation that defines it until the last equation
that reads it (the program's outputs until the end; its arguments for the
whole program, as XLA keeps them). While an equation runs, its inputs and
outputs are live together, and an equation holding a sub-jaxpr (a ``while``
or ``scan`` loop, a ``cond``, a call) also holds that body's own peak.

This is the program-order view of the jaxpr, not XLA's schedule: XLA fuses
elementwise chains and may reorder, so its ``temp`` figure is usually lower.
The two are drawn side by side in the dump's memory timeline.
"""

from __future__ import annotations

import dataclasses

from hlopass import internals as jx

from hlopass.jaxpr_utils import aval_nbytes, aval_str, last_uses, subjaxprs
from hlopass.report import source_line


@dataclasses.dataclass(frozen=True)
class LivePoint:
    """The bytes live while one top-level equation runs."""

    index: int
    primitive: str
    location: str
    outputs: str
    live_bytes: int
    inner_bytes: int = 0  # the peak of its sub-jaxprs beyond their inputs (loops, calls)


@dataclasses.dataclass
class Timeline:
    """Bytes live along a program, one :class:`LivePoint` per top-level equation."""

    points: list[LivePoint]
    argument_bytes: int
    output_bytes: int

    @property
    def peak_bytes(self) -> int:
        """The most bytes live at once (the arguments alone if there are no equations)."""
        return max((p.live_bytes for p in self.points), default=self.argument_bytes)

    @property
    def peak_point(self) -> LivePoint | None:
        """The equation at which the peak is reached."""
        return max(self.points, key=lambda p: p.live_bytes, default=None)

    def to_dict(self) -> dict:
        return {"argument_bytes": self.argument_bytes, "output_bytes": self.output_bytes,
                "peak_bytes": self.peak_bytes, "points": [dataclasses.asdict(p) for p in self.points]}


def _var_bytes(atom) -> int:
    return aval_nbytes(atom.aval) if isinstance(atom, jx.Var) else 0


def inner_peak_bytes(eqn) -> int:
    """What ``eqn``'s sub-jaxprs hold at their peak beyond their own inputs (0 without sub-jaxprs)."""
    extra = 0
    for sub in subjaxprs(eqn):
        inputs = sum(_var_bytes(v) for v in (*sub.constvars, *sub.invars))
        extra = max(extra, peak_live_bytes(sub) - inputs)
    return max(extra, 0)


def peak_live_bytes(jaxpr) -> int:
    """The most bytes live at once in ``jaxpr`` (a ``Jaxpr`` or ``ClosedJaxpr``), sub-jaxprs included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return timeline(jaxpr).peak_bytes


def timeline(closed) -> Timeline:
    """The :class:`Timeline` of ``closed`` (a ``ClosedJaxpr`` or ``Jaxpr``), in program order."""
    jaxpr = getattr(closed, "jaxpr", closed)
    last = last_uses(jaxpr)
    arguments = {v for v in (*jaxpr.constvars, *jaxpr.invars)}
    argument_bytes = sum(_var_bytes(v) for v in arguments)
    output_bytes = sum(_var_bytes(v) for v in jaxpr.outvars)
    live = argument_bytes  # arguments stay live for the whole program
    points = []
    for i, eqn in enumerate(jaxpr.eqns):
        out_bytes = sum(_var_bytes(v) for v in eqn.outvars)
        inner = inner_peak_bytes(eqn)
        points.append(LivePoint(index=i, primitive=eqn.primitive.name, location=source_line(eqn),
                                outputs=", ".join(aval_str(v.aval) for v in eqn.outvars),
                                live_bytes=live + out_bytes + inner, inner_bytes=inner))
        live += sum(_var_bytes(v) for v in eqn.outvars if last.get(v, i) > i)
        freed = {v for v in eqn.invars if isinstance(v, jx.Var) and last.get(v) == i and v not in arguments}
        live -= sum(_var_bytes(v) for v in freed)
    return Timeline(points=points, argument_bytes=argument_bytes, output_bytes=output_bytes)
