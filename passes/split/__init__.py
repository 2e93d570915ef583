"""The size-threshold splitting pass (eXLA's tensor splitter, on jaxprs).

Matches: a reducing equation (``dot_general``, ``reduce_sum``/``max``/``min``/
``prod``/``and``/``or``/``xor``, ``argmax``/``argmin``, ``top_k``, a
cumulative op along another axis) with an operand larger than
``config.threshold``, together with the region that computes that operand
from small inputs through elementwise ops, broadcasts, ``iota``, transposes,
axis-keeping reshapes, ``dot_general``, reductions over other axes,
``select_n``, ``convert_element_type``, ``integer_pow`` and ``jax.nn``
functions (``custom_jvp_call`` bodies are inlined). Several reducers reading
one large value join one region.

Emits: one ``fori_loop`` per region over slices of a split axis (a
remainder step when the chunk does not divide it), each iteration
recomputing the region on ``dynamic_slice`` s of its inputs and writing
(``dynamic_update_slice``) or combining (sum, product, max, min, and, or,
xor, first-index argmax/argmin, running top-k) its results. The chunk keeps
the largest value of one iteration within ``config.split_size``; when no
single axis can, one iteration is split again along a second axis (nested
loops).

Leaves alone: what cannot be split (no rule, random numbers, sort or a
cumulative op along the axis...), reported with its source line.
"""

from __future__ import annotations

import dataclasses
import math

from jax._src import core

from hlopass.config import Config
from hlopass.graph import DataflowGraph
from hlopass.interpreter import Replacement, evaluate, rewrite
from hlopass.families import CUSTOM_DERIVATIVE_CALLS
from hlopass.interpreter import PLAIN_CALLS
from hlopass.jaxpr_utils import aval_nbytes, aval_str, call_body, iter_eqns, largest_values
from hlopass.pass_base import Pass
from hlopass.report import PassReport
from hlopass.sizes import format_size

from .emit import LoopPlan
from .region import Infeasible, SplitRegion, grow_region, seed_labels, seeds

@dataclasses.dataclass(frozen=True)
class SplitOptions:
    """Tuning of the split pass (``SplitPass(max_rounds=4)``)."""

    #: Rewrite rounds per jaxpr level (each round splits non-overlapping regions).
    max_rounds: int = 16
    #: An even chunk (dividing the axis) is preferred when at least this fraction of the largest that fits.
    even_chunk_fraction: float = 0.8
    #: Times the split is redone with half the sizes while XLA's footprint is over the memory limit.
    max_retries: int = 4
    #: One iteration's values live at once (estimated, fusion-aware) stay within this many split sizes.
    live_budget: float = 1.0


class SplitPass(Pass):
    """Rewrite regions that build a tensor over the threshold only to reduce it into loops over slices.

    With a memory limit, the split program is compiled and XLA's footprint checked (only when a
    crude upper bound exceeds the limit); while it is over, the split is redone with half the
    threshold and split size, at most ``options.max_retries`` times, and the report says what remains.
    """

    name = "split"
    Options = SplitOptions

    def run(self, closed: core.ClosedJaxpr, config: Config) -> tuple[core.ClosedJaxpr, PassReport]:
        new, report = super().run(closed, config)
        limit = config.memory_limit
        if limit is None or config.threshold is None or not report.rewrites or _upper_bound(new) <= limit:
            return new, report
        retries: list = []
        footprint = _footprint(new)
        current = config
        while footprint > limit and len(retries) < self.options.max_retries and current.split_size > 1:
            smaller = dataclasses.replace(current, threshold=max(1, current.threshold // 2),
                                          split_size=max(1, current.split_size // 2))
            retries.append((current, smaller, footprint))
            new, report = super().run(closed, smaller)
            footprint, current = _footprint(new), smaller
        for before, after, seen in retries:
            report.rewrite("retry", "<memory limit>",
                           f"XLA footprint {format_size(seen)} over the limit {format_size(limit)}: "
                           f"split again at threshold {format_size(after.threshold)}, "
                           f"split size {format_size(after.split_size)}",
                           footprint=seen, limit=limit, split_size=after.split_size, threshold=after.threshold)
        if footprint > limit:
            remains = ", ".join(f"{ty} ({format_size(n)}, {where})" for ty, n, where in largest_values(new, 3))
            report.skip("<memory limit>", "split", f"XLA footprint {format_size(footprint)} still over the limit "
                        f"{format_size(limit)} after {len(retries)} retries; largest values: {remains}")
        else:
            report.rewrite("memory_check", "<memory limit>", f"XLA footprint {format_size(footprint)} within "
                           f"the limit {format_size(limit)}", footprint=footprint, limit=limit)
        return new, report

    def run_level(self, closed: core.ClosedJaxpr, config: Config, report: PassReport) -> core.ClosedJaxpr:
        if config.threshold is None or config.split_size is None:
            return closed
        return split_level(closed, config, report, self.options)


@dataclasses.dataclass
class _Candidate:
    region: SplitRegion
    chunk: int
    nested: bool
    covered: int      # bytes of large values the region keeps out of memory
    survives: bool    # the split axis reaches the results (no accumulation)
    step_bytes: int   # the largest value of one iteration

    def key(self):
        # Fitting in one level first; among nested ones the smallest step; then what it covers.
        return (not self.nested, -self.step_bytes if self.nested else 0, self.covered, self.survives,
                self.region.size)


def split_level(closed: core.ClosedJaxpr, config: Config, report: PassReport,
                options: SplitOptions = SplitOptions()) -> core.ClosedJaxpr:
    """Split every splittable region of one jaxpr level; ``closed`` itself when nothing applies."""
    if not seeds(closed.jaxpr, config.threshold):
        return closed
    current = inline_custom_calls(closed)
    changed = False
    for _ in range(options.max_rounds):
        jaxpr = current.jaxpr
        graph = DataflowGraph(jaxpr)
        plans, failures = _plan_round(jaxpr, graph, config, report, options)
        if not plans:
            for seed, index, reason in failures:
                _report_skip(report, jaxpr, seed, index, reason)
            break
        current = rewrite(current, [Replacement(sorted(p.region.eqns), p.input_vars, p.outputs, p.build,
                                                anchor=p.region.seed) for p in plans])
        changed = True
    return current if changed else closed


def _plan_round(jaxpr, graph, config: Config, report: PassReport, options: SplitOptions):
    plans: list[LoopPlan] = []
    failures: list[tuple[int, int, str]] = []  # (seed, blocking equation, reason)
    claimed: set[int] = set()
    for seed in reversed(seeds(jaxpr, config.threshold)):  # the last reducer covers the longest chain
        if seed in claimed:
            continue
        candidate, why = _best_candidate(jaxpr, graph, seed, config, options)
        if candidate is None:
            failures.append(why)
            continue
        if candidate.region.eqns & claimed:
            continue  # overlaps a region split this round; looked at again next round
        claimed |= candidate.region.eqns
        plan = _plan(jaxpr, graph, candidate, config, report, options)
        plans.append(plan)
        _report_split(report, jaxpr, plan, candidate)
    return plans, failures


def _best_candidate(jaxpr, graph, seed: int, config: Config, options: SplitOptions):
    best, why = None, (seed, seed, "no splittable axis on the large operand")
    for label in seed_labels(jaxpr, seed, config.threshold):
        try:
            region = grow_region(jaxpr, graph, seed, label, config.split_size)
        except Infeasible as err:
            why = (seed, err.eqn_index, f"cannot split the reduction at {_where(jaxpr, seed)}: {err.reason}")
            continue
        candidate = _candidate(jaxpr, graph, region, config, options)
        if candidate is None:
            why = (seed, seed, "the large operand is not computed here (an input or a value needed elsewhere)")
            continue
        if best is None or candidate.key() > best.key():
            best = candidate
    return best, why


def _report_skip(report: PassReport, jaxpr, seed: int, index: int, reason: str) -> None:
    """Name the operation that prevented the split, at its line (the reducer's when it has none)."""
    from hlopass.report import source_line
    blocker = jaxpr.eqns[index]
    location = source_line(blocker)
    if location == "<unknown>":
        location = source_line(jaxpr.eqns[seed])
    report.skip(location, blocker.primitive.name, reason)


def _where(jaxpr, index: int) -> str:
    from hlopass.report import source_line
    eqn = jaxpr.eqns[index]
    return f"{eqn.primitive.name} ({source_line(eqn)})"


def _candidate(jaxpr, graph, region: SplitRegion, config: Config, options: SplitOptions) -> _Candidate | None:
    outputs = set(region.outputs(jaxpr, graph))
    covered = sum(aval_nbytes(v.aval) for v in region.var_axis
                  if v not in outputs and aval_nbytes(v.aval) > config.split_size)
    if not any(aval_nbytes(v.aval) > config.threshold for v in region.var_axis if v not in outputs):
        return None
    per_unit = max(region.per_unit_bytes(jaxpr), 1)
    peak = max(region.peak_per_unit_bytes(jaxpr, graph), 1)
    fits = int(min(config.split_size // per_unit, options.live_budget * config.split_size // peak))
    need = region.min_chunk(jaxpr)
    if fits >= region.size:
        return None
    nested = fits < need
    chunk = need if nested else choose_chunk(region.size, fits, options.even_chunk_fraction)
    if chunk >= region.size:
        return None
    return _Candidate(region, chunk, nested, covered, survives=not region.reducing, step_bytes=chunk * per_unit)


def choose_chunk(size: int, fits: int, even_fraction: float = SplitOptions.even_chunk_fraction) -> int:
    """Chunk length along an axis of ``size`` when at most ``fits`` fit: an even divisor of ``size``
    if one is at least ``even_fraction`` of ``fits``, else ``size`` spread over as few
    iterations as possible (the last one shorter)."""
    divisor = max((d for d in _divisors(size) if d <= fits), default=1)
    if divisor >= even_fraction * fits:
        return divisor
    iterations = -(-size // fits)
    return -(-size // iterations)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in small]


def _plan(jaxpr, graph, candidate: _Candidate, config: Config, report: PassReport,
          options: SplitOptions) -> LoopPlan:
    region = candidate.region
    plan = LoopPlan(jaxpr, region, region.inputs(jaxpr), region.outputs(jaxpr, graph), candidate.chunk)
    if candidate.nested:
        inner = dataclasses.replace(config, threshold=config.split_size)
        plan.refine_step = lambda step: split_level(step, inner, report, options)
    return plan


def _report_split(report: PassReport, jaxpr, plan: LoopPlan, candidate: _Candidate) -> None:
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
               f"{f' (last {remainder})' if remainder else ''}, {len(region.eqns)} equations per iteration, "
               f"{how}; largest tensor {format_size(region.largest_bytes())} -> {format_size(chunk_bytes)}"
               f"{' per step, split again inside (nested)' if candidate.nested else ''}")
    report.rewrite("split", seed, summary, axis=axis, size=region.size, iterations=plan.iterations,
                   chunk=plan.chunk, chunk_bytes=chunk_bytes, largest_before=region.largest_bytes(),
                   largest_after=chunk_bytes, equations=len(region.eqns), nested=candidate.nested,
                   reducers=sorted(jaxpr.eqns[i].primitive.name for i in region.reducing),
                   outputs=len(plan.outputs))


def _upper_bound(closed: core.ClosedJaxpr) -> int:
    """Bytes of every value the program defines (loop bodies once) plus its inputs: XLA cannot need more."""
    values = sum(aval_nbytes(v.aval) for eqn in iter_eqns(closed) for v in eqn.outvars)
    return values + sum(aval_nbytes(a) for a in closed.in_avals)


def _footprint(closed: core.ClosedJaxpr) -> int:
    """XLA's footprint (temp + arguments + outputs - aliases) for ``closed`` compiled on its own."""
    import jax
    from hlopass.memory import measure
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in closed.in_avals]
    return measure(jax.jit(core.jaxpr_as_fun(closed)).lower(*args).compile()).footprint


def inline_custom_calls(closed: core.ClosedJaxpr) -> core.ClosedJaxpr:
    """Inline ``custom_jvp_call``/``custom_vjp_call`` bodies (passes run after differentiation, so
    only the primal computation matters) and nested ``pjit`` calls: their equations become splittable."""
    if not any(e.primitive.name in CUSTOM_DERIVATIVE_CALLS | PLAIN_CALLS for e in closed.jaxpr.eqns):
        return closed

    def inline(eqn, invals):
        body = call_body(eqn) if eqn.primitive.name in CUSTOM_DERIVATIVE_CALLS else None
        if body is None:
            return None
        return evaluate(body.jaxpr, body.consts, invals, eqn_rule=inline, inline_calls=True)

    return rewrite(closed, eqn_rule=inline, inline_calls=True)
