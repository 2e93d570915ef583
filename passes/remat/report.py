"""What the remat pass tells the user: what it recomputes (with source lines), the predicted and
measured footprint, the predicted extra time, or what remains when nothing fits."""

from __future__ import annotations

from typing import Callable

from hlopass.report import source_line
from hlopass.sizes import format_size

from .chain import stage_lines
from .scans import segments
from .schedule import Block


def _lines(lines: list[str], limit: int = 6) -> str:
    if len(lines) <= limit:
        return ", ".join(lines)
    return ", ".join(lines[:limit]) + f" and {len(lines) - limit} more"


def _seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def blocks(items, depth: int = 0):
    """``(block, nesting depth)`` for every block of a schedule, outermost first."""
    for item in items:
        if isinstance(item, Block):
            yield item, depth
            yield from blocks(item.inner, depth + 1)


def flat_entries(flat, items, eqn_of: Callable[[int], object], chain) -> list[dict]:
    """One entry per top-level recomputed block of a flat chain."""
    out = []
    for item in items:
        if not isinstance(item, Block):
            continue
        eqns = [eqn_of(q) for l in range(item.start, item.end) for q in flat.stages[l]]
        dropped = sum(chain.residual[item.start:item.end])
        seconds = sum(chain.time[item.start:item.end])
        nested = max((d for _, d in blocks(item.inner, 1)), default=0)
        out.append(dict(eqn=eqns[0], lines=stage_lines(eqns), stages=(item.start, item.end), equations=len(eqns),
                        dropped=dropped, seconds=seconds, nested=nested))
    return out


def describe_outcome(report, outcome, names, analysis, footprint0: int, limit: int, machine) -> None:
    """Fill ``report`` from a :class:`.loop.Outcome` of the program of ``analysis``."""
    jaxpr = analysis.closed.jaxpr
    chosen = outcome.chosen
    if chosen is None:
        report.skip("<memory limit>", "remat", f"XLA footprint {format_size(footprint0)} over the limit "
                    f"{format_size(limit)}; no recomputation schedule could be built")
        return
    if outcome.fits or chosen.footprint < footprint0:
        for (kind, pair), sol in zip(names, chosen.plan.solutions):
            if kind == "flat":
                for e in flat_entries(analysis.flat, sol.items, lambda q: jaxpr.eqns[q], analysis.flat.chain):
                    nested = f", recomputed again {e['nested']} level(s) deeper inside" if e["nested"] else ""
                    report.rewrite("recompute", e["eqn"],
                                   f"forward stages {e['stages'][0]}..{e['stages'][1] - 1} ({e['equations']} equations: "
                                   f"{_lines(e['lines'])}) recomputed in the backward pass from the values at their "
                                   f"entry; {format_size(e['dropped'])} of residuals not kept, predicted "
                                   f"{_seconds(e['seconds'])} extra{nested}",
                                   stages=e["stages"], lines=e["lines"], dropped=e["dropped"], seconds=e["seconds"])
            else:
                eqn = jaxpr.eqns[pair.forward]
                describe_scan(report, sol, pair.length(jaxpr), source_line(eqn))
    extra = chosen.plan.extra_seconds
    summary = (f"XLA footprint {format_size(footprint0)} over the limit {format_size(limit)}: "
               f"predicted {format_size(chosen.predicted)}, measured {format_size(chosen.footprint)} "
               f"after {len(outcome.attempts)} compilation(s); predicted extra time {_seconds(extra)}")
    details = dict(footprint_before=footprint0, predicted=chosen.predicted, measured=chosen.footprint,
                   limit=limit, extra_seconds=extra, compilations=len(outcome.attempts),
                   flops_per_second=machine.flops_per_second, bytes_per_second=machine.bytes_per_second)
    if outcome.fits:
        report.rewrite("memory", "<memory limit>", summary + ", within the limit", **details)
    elif chosen.footprint < footprint0:
        report.rewrite("memory", "<memory limit>", summary, **details)
        report.skip("<memory limit>", "remat", f"no recomputation schedule fits the limit {format_size(limit)}: "
                    f"the smallest footprint found is {format_size(chosen.footprint)} (kept)")
    else:
        report.skip("<memory limit>", "remat", f"no recomputation schedule fits the limit {format_size(limit)}: "
                    f"the smallest footprint found is {format_size(chosen.footprint)}, not below the original "
                    f"{format_size(footprint0)}; the program is left as it was")


def describe_scan(report, sol, n: int, where: str) -> None:
    """The report entry of a checkpointed scan (``sol``: a :class:`.loop.Choice`)."""
    segs = segments(sol.items, sol.group, n)
    kept = sum(s.stop - s.start for s in segs if not s.block)
    blocked = [s for s in segs if s.block]
    if not blocked:
        return
    parts = [f"{s.count} block(s) of {s.block} step(s)" for s in blocked]
    recomputed = sum(s.stop - s.start for s in blocked)
    report.rewrite("checkpointed_scan", where,
                   f"scan of {n} steps: carry kept at the entry of {', '.join(parts)} and recomputed from it in "
                   f"the backward pass; {kept} step(s) keep their residuals; {recomputed} step(s) run twice, "
                   f"predicted {_seconds(sol.extra_compute)} extra",
                   length=n, blocks=[(s.count, s.block) for s in blocked], kept_steps=kept, recomputed_steps=recomputed,
                   seconds=sol.extra_compute)

