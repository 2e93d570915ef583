"""The size-threshold splitting pass (eXLA's tensor splitter, on jaxprs).

Matches: a size-reducing equation (``dot_general``, ``reduce_sum``/``max``/
``min``/``prod``/``and``/``or``/``xor``, ``argmax``/``argmin``, ``top_k``, a
cumulative op along another axis, ``triangular_solve``, ``gather``, a
scatter, a slice) with an operand larger than ``config.threshold``, together
with the region that computes that operand from small inputs through the
primitives of :data:`.rules.AXIS_RULES` (elementwise ops, broadcasts,
``iota``, transposes, axis-keeping reshapes, contractions, reductions over
other axes, triangular solves, gathers and scatters, dynamic slices, sorts
along another axis...). Several reducers reading one large value join one
region. At every program level, calls holding a large value (``pjit``,
``closed_call``, ``checkpoint``, ``custom_jvp``/``custom_vjp``) are inlined
first, and the bodies of loops, branches and linear solves are split on
their own (innermost first). A large value read both before and after its
own reduction is recomputed once per stage of its readers
(:mod:`.recompute`), one loop per stage.

Emits: one ``fori_loop`` per region over slices of a split axis (a
remainder step when the chunk does not divide it), each iteration
recomputing the region on ``dynamic_slice`` s of its inputs and writing
(``dynamic_update_slice``) or combining (sum, product, max, min, and, or,
xor, first-index argmax/argmin, running top-k, a scatter's running result)
its results. The chunk keeps the largest value of one iteration within
``config.split_size``, and on CPU within ``step_cache_bytes`` (16 MiB) when the
region is split anyway, which runs faster from the cache; when no single axis
can, one iteration is split again along a second axis (nested loops).

Sharded programs: an axis cut across devices (by an explicit sharding in the
value's type, or by the sharding of a ``jax.jit`` argument) is never split,
so every device loops over its own shard along another axis and the
results keep the shardings jax.jit gives; loop carries take the varying
manual axes and explicit sharding of the values they build; ``shard_map``
bodies are split with their manual axes bound, collectives left in place. The
threshold and the split size bound one device's share of each value
(:mod:`.shares`); a ``shard_map`` reading a large per-device result of the one
before it is joined to it first (:mod:`.fuse`: a gradient's recomputed forward
and transposed bodies), so the split covers the value between them.

Carried state (:mod:`.online`): a region reducing the split axis in two
dependent steps (a maximum, then sums of ``exp(x - max)``: logsumexp, softmax)
is one loop carrying a running maximum and rescaled running sums; a
cumulative op along the split axis carries its running total from slice to
slice (from the end with ``reverse``). The report says what each loop carries.

Leaves alone: what cannot be split (no rule, random numbers, sort along the
axis, a factorisation of a large matrix, cumulative ops along the axis in
both directions, a value not linear in ``exp(-max)``...),
reported with its source line; a region whose loop cannot be built and a
sub-program that cannot be rebuilt are left as they are and reported, the
rest is still split.
"""

from __future__ import annotations

import contextvars
import dataclasses
import math

import jax

from hlopass import internals as jx

from hlopass.config import Config
from hlopass.graph import DataflowGraph
from hlopass.families import INLINABLE
from hlopass.interpreter import Replacement, bind_equation, inline_calls, rewrite
from hlopass.jaxpr_utils import (aval_nbytes, aval_str, has_subjaxprs, iter_eqns, largest_values,
                                 map_subjaxprs, subjaxprs)
from hlopass.memory import footprint as measure_alone, upper_bound
from hlopass.pass_base import Pass
from hlopass.report import PassReport, Rewrite, source_line
from hlopass.sharding import input_shardings
from hlopass.sizes import format_size

from .emit import LoopPlan
from .fuse import fuse_shard_maps
from .recompute import recompute_for_later_stages, staged_values
from .region import Infeasible, SplitRegion, grow_region, seed_labels, seeds
from .rules import SCATTER_MONOIDS
from .shares import device_bytes, sharded_values, top_program
from .unroll import unroll_short_reductions

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
    #: Inside a step, reductions over a last axis this short are unrolled (0: never; see ``unroll.py``)...
    unroll_max_length: int = 16
    #: ...when their result has at least this many elements.
    unroll_min_elements: int = 1024
    #: On CPU, a step's live set is kept within this many bytes (half this machine's 32 MiB L3 cache)
    #: when the region is split anyway, even if the split size allows more: measured 1.2-1.7x faster
    #: on kNN L2 and the kernel mat-vec (README, chunk shapes). 0: the largest chunk that fits.
    step_cache_bytes: int = 16 * 2**20
    #: A step's ``top_k`` over a long row selects among group bests first, then among the chosen
    #: groups' elements: exact, and 4-12x faster than XLA:CPU's ``top_k`` in a kNN (``select.py``).
    grouped_top_k: bool = True
    #: On an accelerator (a GPU), where XLA fuses a step's elementwise work into its reductions, a
    #: step is sized by its largest value alone (not the estimated live set of every value) and a
    #: step's product with a thin operand (a vector, a few columns) is bound as a multiply and a sum,
    #: which XLA fuses with what computes the other operand: the slice is never stored. Measured on
    #: an H200 (README, *GPU*): a kernel mat-vec at 100 MB steps 0.0675 s as one thin dot per 10
    #: rows, 0.018 s written as a sum by hand over 250 rows, plain jax.jit 0.023 s.
    #: ``None``: on any backend but the CPU; ``True``/``False``: always/never.
    accelerator_steps: bool | None = None


class SplitPass(Pass):
    """Rewrite regions that build a tensor over the threshold only to reduce it into loops over slices.

    With a memory limit, the split program is compiled and XLA's footprint checked (only when a
    crude upper bound exceeds the limit); while it is over, the split is redone with half the
    threshold and split size, at most ``options.max_retries`` times, and the report says what remains.
    """

    name = "split"
    Options = SplitOptions
    #: Regions over the threshold, wherever they are written (branch bodies too), become loops.
    provides = frozenset({"split_regions"})

    def run(self, closed: jx.ClosedJaxpr, config: Config) -> tuple[jx.ClosedJaxpr, PassReport]:
        with top_program(closed.jaxpr):  # the jit arguments' shardings are this program's inputs'
            return self._run(closed, config)

    def _run(self, closed: jx.ClosedJaxpr, config: Config) -> tuple[jx.ClosedJaxpr, PassReport]:
        new, report = self.run_once(closed, config)
        limit = config.memory_limit
        if limit is None or config.threshold is None or not report.rewrites or \
                upper_bound(new, device_bytes(new.jaxpr), own_values_only=True) <= limit:  # on one device
            return new, report
        retries: list = []
        shardings = _input_shardings(closed)
        try:
            footprint = measure_alone(new, shardings, typed=False).footprint
        except Exception as err:  # noqa: BLE001 - a diagnostic compile must not lose the split
            report.skip("<memory limit>", "split", f"could not compile the split program alone to check its "
                        f"memory (the whole program is still checked): {_error(err)}")
            return new, report
        current = config
        while footprint > limit and len(retries) < self.options.max_retries and current.split_size > 1:
            smaller = dataclasses.replace(current, threshold=max(1, current.threshold // 2),
                                          split_size=max(1, current.split_size // 2))
            retries.append((current, smaller, footprint))
            new, report = self.run_once(closed, smaller)
            footprint, current = measure_alone(new, shardings, typed=False).footprint, smaller
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

    def run_once(self, closed: jx.ClosedJaxpr, config: Config) -> tuple[jx.ClosedJaxpr, PassReport]:
        """One split of ``closed`` and every sub-program, without the memory-limit loop."""
        report = PassReport(self.name)
        if config.threshold is None or config.split_size is None:
            return closed, report
        with top_program(closed.jaxpr):
            return split_nested(closed, config, report, self.options), report


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


def split_nested(closed: jx.ClosedJaxpr, config: Config, report: PassReport,
                 options: SplitOptions = SplitOptions()) -> jx.ClosedJaxpr:
    """Split ``closed`` and every sub-program (loop and branch bodies, linear-solve programs...).

    At each level, calls (``pjit``, ``closed_call``, ``checkpoint``, ``custom_jvp``/``custom_vjp``)
    that hold a large value are inlined first, so a large value built in one sub-program and
    consumed in another is seen as written inline; then the remaining sub-programs are split
    (innermost first), then the level itself. A sub-program that cannot be rebuilt, or a level
    where the pass fails, is left untouched and named in the report (never the whole function).
    """
    mark = (len(report.rewrites), len(report.skipped))
    try:
        current = inline_calls_holding_large(closed, config.threshold)
    except Exception as err:  # noqa: BLE001 - never crash on an unknown program
        report.skip(_first_location(closed), "call", f"calls left as they are (inlining failed: {_error(err)})")
        current = closed
    joined = 0
    try:
        current, joined = fuse_shard_maps(current, config.threshold)
    except Exception as err:  # noqa: BLE001
        report.skip(_first_location(current), "shard_map", f"shard_maps left apart (joining failed: {_error(err)})")

    def rule(eqn, invals):
        if not has_subjaxprs(eqn) or not _holds_large(eqn, config.threshold):
            return None
        inner = (len(report.rewrites), len(report.skipped))
        try:
            params = map_subjaxprs(eqn, lambda sub: split_nested(sub, config, report, options))
            outs = None if params is None else bind_equation(eqn, invals, params)
        except Exception as err:  # noqa: BLE001
            del report.rewrites[inner[0]:], report.skipped[inner[1]:]
            report.skip(source_line(eqn), eqn.primitive.name,
                        f"left this {eqn.primitive.name} and its sub-programs untouched: {_error(err)}")
            return None
        _tag_inside(report, inner, eqn)
        return outs

    if any(has_subjaxprs(eqn) and _holds_large(eqn, config.threshold) for eqn in current.jaxpr.eqns):
        changed = []
        try:
            candidate = rewrite(current, eqn_rule=lambda e, v: _track(changed, rule(e, v)))
            current = candidate if changed else current
        except Exception as err:  # noqa: BLE001
            report.skip(_first_location(current), "sub-programs", f"sub-programs left untouched: {_error(err)}")
    try:
        new = split_level(current, config, report, options)
    except Exception as err:  # noqa: BLE001
        report.skip(_first_location(current), "split", f"this program level left untouched: {_error(err)}")
        new = current
    if len(report.rewrites) == mark[0]:
        return closed  # inlining or joining alone changes nothing
    if joined:
        anchor = next((e for e in current.jaxpr.eqns if e.primitive.name == "shard_map"), None)
        report.rewrites.insert(mark[0], Rewrite(
            report.name, "join", source_line(anchor) if anchor is not None else "<unknown>",
            f"joined {joined} shard_map(s) to the one before it that computes a per-device value over the "
            f"threshold it reads (a gradient's recomputed forward and transposed bodies), so one body "
            f"computes and reads that value and is split across it", {"joined": joined}))
    return new


def _track(changed: list, outs):
    if outs is not None:
        changed.append(True)
    return outs


def _error(err: Exception) -> str:
    text = str(err).split("\n")[0]
    return f"{type(err).__name__}: {text[:200]}"


def _first_location(closed: jx.ClosedJaxpr) -> str:
    for eqn in closed.jaxpr.eqns:
        where = source_line(eqn)
        if where != "<unknown>":
            return where
    return "<unknown>"


def _tag_inside(report: PassReport, mark: tuple[int, int], eqn) -> None:
    """Say in which sub-program (and at which line) the entries made since ``mark`` were made."""
    where = f" (inside {eqn.primitive.name} at {source_line(eqn)})"
    for entry in report.rewrites[mark[0]:]:
        if "(inside " not in entry.summary:
            entry.summary += where
    for entry in report.skipped[mark[1]:]:
        if "(inside " not in entry.reason:
            entry.reason += where


def _holds_large(eqn, threshold: int) -> bool:
    """Whether ``eqn`` reads, defines or (in a sub-program) computes a value over ``threshold``."""
    if any(aval_nbytes(a.aval) > threshold for a in (*eqn.invars, *eqn.outvars) if hasattr(a, "aval")):
        return True
    return any(aval_nbytes(v.aval) > threshold for sub in subjaxprs(eqn) for e in iter_eqns(sub) for v in e.outvars)


def split_level(closed: jx.ClosedJaxpr, config: Config, report: PassReport,
                options: SplitOptions = SplitOptions()) -> jx.ClosedJaxpr:
    """Split every splittable region of one jaxpr level; ``closed`` itself when nothing applies.

    A region whose loop cannot be built is left as it is and reported with its source line; the
    other regions are still split.
    """
    current = inline_calls_holding_large(closed, config.threshold)
    if not seeds(current.jaxpr, config.threshold):
        return closed
    changed = False
    broken: set = set()
    chunks_of_dots: dict = {}   # the chunk of each product recomputed in a loop (_harmonise_chunks)
    staging_tries = 2  # looking for two-pass values costs re-planning: twice per level at most
    for _ in range(options.max_rounds):
        jaxpr = current.jaxpr
        graph = DataflowGraph(jaxpr)
        plans, failures = _plan_round(jaxpr, graph, config, report, options, broken)
        nested = any(p.candidate.nested for p in plans) and _has_large_max(jaxpr, config.split_size)
        if (failures or nested) and staging_tries:  # a shared large value may need two passes: a copy per stage
            staging_tries -= 1
            current, plans, failures = _recompute_where_it_helps(current, plans, failures, config, report,
                                                                 options, broken)
            jaxpr = current.jaxpr
        if not plans:
            for seed, index, reason in failures:
                _report_skip(report, jaxpr, seed, index, reason)
            break
        _harmonise_chunks(jaxpr, plans, chunks_of_dots)
        built = _rewrite_isolating_failures(current, jaxpr, plans, report, broken)
        if built is None:
            break
        current, changed = built, True
    return current if changed else closed


def _harmonise_chunks(jaxpr, plans, recorded: dict) -> None:
    """Give every loop that recomputes the same ``dot_general`` along the same axis the same chunk:
    the smallest any of them chose, this round or an earlier one of the level (``recorded``).

    XLA:CPU's dot kernels round differently for different widths (one column, five, 32...), so a
    product recomputed in two loops with different chunks differs in its last bits. Where both
    copies meet again through ``exp``, as a softmax normalised in one loop and exponentiated in
    another, the probabilities no longer sum to one: a float32 gradient 25 times its own scale
    off (fresh seed r73655148886). A smaller chunk always fits.
    """
    keys = []
    for plan in plans:
        region = plan.region
        keys.append({(_eqn_key(jaxpr.eqns[i]), region.size, region.var_axis.get(jaxpr.eqns[i].outvars[0]))
                     for i in region.eqns if jaxpr.eqns[i].primitive.name == "dot_general"
                     and region.var_axis.get(jaxpr.eqns[i].outvars[0]) is not None})
    changed = True
    while changed:
        changed = False
        for plan, own in zip(plans, keys):
            if not own or getattr(plan.candidate, "nested", False):
                continue
            chunk = min([plan.chunk, *(recorded[k] for k in own if k in recorded)])
            for k in own:
                if recorded.get(k, chunk + 1) > chunk:
                    recorded[k] = chunk
                    changed = True
            if chunk < plan.chunk:
                plan.chunk = chunk
                changed = True


def _has_large_max(jaxpr, large: int) -> bool:
    """Whether a ``reduce_max`` reads a value over ``large`` bytes (a running maximum may spare a nested split)."""
    share = device_bytes(jaxpr)
    return any(eqn.primitive.name == "reduce_max" and share(eqn.invars[0]) > large for eqn in jaxpr.eqns)


def _score(plans, failures) -> tuple[int, int]:
    """Regions left unsplit, then regions split in nested loops: fewer is better."""
    return len(failures), sum(bool(p.candidate.nested) for p in plans)


def _recompute_where_it_helps(current, plans, failures, config: Config, report: PassReport,
                              options: SplitOptions, broken: set):
    """Give the later stages of readers of a shared large value their own copy, one value at a time,
    keeping each copy that leaves fewer regions unsplit. Stages that one loop carrying a running
    maximum can cover are tried first (the latest value first: its copy takes the earlier ones along)."""
    for online in (True, False):
        current, plans, failures = _recompute_staged(current, plans, failures, config, report, options, broken,
                                                     online)
        if _score(plans, failures) == (0, 0):
            break
    return current, plans, failures


def _recompute_staged(current, plans, failures, config: Config, report: PassReport, options: SplitOptions,
                      broken: set, online: bool):
    def candidates_of(jaxpr):
        found = staged_values(jaxpr, config.split_size, online)
        return found[::-1] if online else found

    tried = 0
    for _ in range(len(current.jaxpr.eqns)):
        candidates = candidates_of(current.jaxpr)
        if tried >= len(candidates) or _score(plans, failures) == (0, 0):
            break
        var = candidates[tried]
        staged = recompute_for_later_stages(current, var, config.split_size, online)
        staged_plans, staged_failures = _plan_round(staged.jaxpr, DataflowGraph(staged.jaxpr), config, report,
                                                    options, broken)
        if _score(staged_plans, staged_failures) < _score(plans, failures):
            current, plans, failures = staged, staged_plans, staged_failures
            tried = 0
        else:
            tried += 1
    if _score(plans, failures) != (0, 0):  # values whose copies only help together (a gradient reading several of them again)
        staged = current
        for _ in range(4 * len(current.jaxpr.eqns)):
            candidates = candidates_of(staged.jaxpr)
            if not candidates:
                break
            copied = recompute_for_later_stages(staged, candidates[0], config.split_size, online)
            if copied is staged:
                break
            staged = copied
        if staged is not current:
            staged_plans, staged_failures = _plan_round(staged.jaxpr, DataflowGraph(staged.jaxpr), config, report,
                                                        options, broken)
            if _score(staged_plans, staged_failures) < _score(plans, failures):
                current, plans, failures = staged, staged_plans, staged_failures
    return current, plans, failures


def _replacement(plan: LoopPlan) -> Replacement:
    return Replacement(sorted(plan.region.eqns), plan.input_vars, plan.outputs, plan.build, anchor=plan.region.seed)


def _rewrite_isolating_failures(current, jaxpr, plans, report: PassReport, broken: set):
    """Rewrite ``current`` with every plan and report the splits; when that fails, find the plans that
    fail on their own, report them and rewrite with the others. ``None`` when none can be built.

    Building a loop may split its steps again (nested), which reports too: attempts whose result is
    dropped leave no entries, and each split is reported before its steps' splits.
    """
    def attempt(chosen, keep):
        mark = (len(report.rewrites), len(report.skipped))
        try:
            new = rewrite(current, [_replacement(p) for p in chosen])
        finally:
            if not keep:
                del report.rewrites[mark[0]:], report.skipped[mark[1]:]
        if not keep:
            return new
        inner = report.rewrites[mark[0]:]
        del report.rewrites[mark[0]:]
        for plan in chosen:
            _report_split(report, jaxpr, plan, plan.candidate)
        report.rewrites.extend(inner)
        return new

    try:
        return attempt(plans, keep=True)
    except Exception:  # noqa: BLE001 - isolated below
        pass
    good = []
    for plan in plans:
        try:
            attempt([plan], keep=False)
            good.append(plan)
        except Exception as err:  # noqa: BLE001 - never crash on an unknown program
            seed = jaxpr.eqns[plan.region.seed]
            broken.add(_eqn_key(seed))
            report.skip(source_line(seed), seed.primitive.name,
                        f"the loop for this region could not be built, left as it is: {_error(err)}")
    if not good:
        return None
    try:
        return attempt(good, keep=True)
    except Exception:  # noqa: BLE001 - each works alone but not together: keep the first
        return attempt(good[:1], keep=True)


def _eqn_key(eqn) -> tuple:
    """Identifies an equation across re-traces (indices change)."""
    return (eqn.primitive.name, source_line(eqn), tuple(str(v.aval) for v in eqn.outvars),
            tuple(str(getattr(a, "aval", a)) for a in eqn.invars))


def _plan_round(jaxpr, graph, config: Config, report: PassReport, options: SplitOptions, broken: set = frozenset()):
    plans: list[LoopPlan] = []
    failures: list[tuple[int, int, str]] = []  # (seed, blocking equation, reason)
    claimed: set[int] = set()
    for seed in reversed(seeds(jaxpr, config.threshold)):  # the last reducer covers the longest chain
        if seed in claimed or _eqn_key(jaxpr.eqns[seed]) in broken:
            continue
        try:
            candidate, why = _best_candidate(jaxpr, graph, seed, config, options)
        except Exception as err:  # noqa: BLE001 - a failure here stays with this region
            failures.append((seed, seed, f"planning failed: {_error(err)}"))
            continue
        if candidate is None:
            failures.append(why)
            continue
        if candidate.region.eqns & claimed or any(_eqn_key(jaxpr.eqns[i]) in broken for i in candidate.region.reducing):
            continue  # overlaps a region split this round; looked at again next round
        claimed |= candidate.region.eqns
        plans.append(_plan(jaxpr, graph, candidate, config, report, options))
    return plans, failures


def _best_candidate(jaxpr, graph, seed: int, config: Config, options: SplitOptions):
    best, why = None, (seed, seed, "no splittable axis on the large operand")
    for label in seed_labels(jaxpr, seed, config.threshold):
        try:
            region = grow_region(jaxpr, graph, seed, label, config.split_size)
        except Infeasible as err:
            why = (seed, err.eqn_index, f"cannot split the reduction at {_where(jaxpr, seed)}: {err.reason}")
            continue
        sharded = _sharded_split_axis(jaxpr, region)
        if sharded is not None:
            why = (seed, seed, f"cannot split the reduction at {_where(jaxpr, seed)} along axis {sharded[1]} of "
                               f"{aval_str(sharded[0].aval)}: that axis is sharded across devices (its loop "
                               f"would gather the shards onto every device)")
            continue
        candidate = _candidate(jaxpr, graph, region, config, options)
        if candidate is None:
            why = (seed, seed, "the large operand is not computed here (an input or a value needed elsewhere)")
            continue
        if best is None or candidate.key() > best.key():
            best = candidate
    return best, why


def _sharded_split_axis(jaxpr, region: SplitRegion):
    """``(value, axis)`` of a region value or input whose split axis is cut across devices, or ``None``.

    A loop over a sharded axis would slice it at offsets that cross devices: XLA gathers the whole
    operand onto every device (and each device then runs every iteration). Another axis keeps the
    shardings jax.jit gives, each device looping over its own shard.
    """
    shards = sharded_values(jaxpr)
    if not shards:
        return None
    for var, axis in [*region.inputs(jaxpr), *region.var_axis.items()]:
        pieces = shards.get(var)
        if axis is not None and pieces is not None and pieces[axis] > 1:
            return var, axis
    return None


def _report_skip(report: PassReport, jaxpr, seed: int, index: int, reason: str) -> None:
    """Name the operation that prevented the split, at its line (the reducer's when it has none)."""
    blocker = jaxpr.eqns[index]
    location = source_line(blocker)
    if location == "<unknown>":
        location = source_line(jaxpr.eqns[seed])
    report.skip(location, blocker.primitive.name, reason)


def _where(jaxpr, index: int) -> str:
    eqn = jaxpr.eqns[index]
    return f"{eqn.primitive.name} ({source_line(eqn)})"


def _candidate(jaxpr, graph, region: SplitRegion, config: Config, options: SplitOptions) -> _Candidate | None:
    outputs = set(region.outputs(jaxpr, graph))
    share = device_bytes(jaxpr)  # the threshold and the split size bound one device's share
    covered = sum(share(v) for v in region.var_axis if v not in outputs and share(v) > config.split_size)
    if not any(share(v) > config.threshold for v in region.var_axis if v not in outputs):
        return None
    seed = jaxpr.eqns[region.seed]
    pos = max(range(len(seed.invars)), key=lambda k: aval_nbytes(seed.invars[k].aval))
    if aval_nbytes(seed.invars[pos].aval) > config.threshold and region.operand_axis.get((region.seed, pos)) is None:
        return None  # the reducer's large operand would be read whole each step (a small threshold's other values)
    per_unit = max(region.per_unit_bytes(jaxpr), 1)
    peak = max(region.peak_per_unit_bytes(jaxpr, graph), 1)
    fits = int(min(config.split_size // per_unit, options.live_budget * config.split_size // peak))
    if _on_accelerator(options):
        fits = int(config.split_size // per_unit)
    need = region.min_chunk(jaxpr)
    if fits >= region.size:
        return None
    nested = fits < need
    cache = _cache_bytes(options)
    if cache and not nested and cache < config.split_size:  # smaller steps run faster from the cache
        fits = max(int(min(cache // per_unit, options.live_budget * cache // peak)), need, 1)
    chunk = need if nested else choose_chunk(region.size, fits, options.even_chunk_fraction)
    if chunk >= region.size:
        return None
    return _Candidate(region, chunk, nested, covered, survives=not region.reducing, step_bytes=chunk * per_unit)


def _on_accelerator(options: SplitOptions) -> bool:
    """Whether steps are shaped for an accelerator: XLA fuses their elementwise work there."""
    if options.accelerator_steps is None:
        return jax.default_backend() != "cpu"
    return options.accelerator_steps


def _cache_bytes(options: SplitOptions) -> int:
    """The step size cap for the cache: measured on CPU only, so accelerators keep the largest chunk."""
    return options.step_cache_bytes if jax.default_backend() == "cpu" else 0


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


#: Loops nested inside one split step at most (a second axis, and a third for a 3-D step). Deeper
#: levels made no progress when each step re-sliced a large loop input (fuzzer seed r884065875121).
MAX_NESTING = 2
_NESTING: contextvars.ContextVar[int] = contextvars.ContextVar("hlopass_split_nesting", default=0)


def _plan(jaxpr, graph, candidate: _Candidate, config: Config, report: PassReport,
          options: SplitOptions) -> LoopPlan:
    region = candidate.region
    plan = LoopPlan(jaxpr, region, region.inputs(jaxpr), region.outputs(jaxpr, graph), candidate.chunk,
                    candidate=candidate, grouped_top_k=options.grouped_top_k,
                    fuse_thin_dots=_on_accelerator(options))
    inner = dataclasses.replace(config, threshold=config.split_size)

    def refine(step: jx.ClosedJaxpr) -> jx.ClosedJaxpr:
        depth = _NESTING.get()
        if candidate.nested and depth < MAX_NESTING:
            token = _NESTING.set(depth + 1)
            try:
                step = split_level(step, inner, report, options)
            finally:
                _NESTING.reset(token)
        if options.unroll_max_length:
            step = unroll_short_reductions(step, report, options.unroll_max_length, options.unroll_min_elements)
        return step
    plan.refine_step = refine
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
               f"{how}; largest tensor {format_size(region.largest_bytes(jaxpr))} -> {format_size(chunk_bytes)}"
               f"{' per device' if any(v in sharded_values(jaxpr) for v in region.var_axis) else ''}"
               f"{' per step, split again inside (nested)' if candidate.nested else ''}")
    carried = carried_state(plan)
    summary += f"; carries {', '.join(carried)}"
    report.rewrite("split", seed, summary, axis=axis, size=region.size, iterations=plan.iterations, carried=carried,
                   chunk=plan.chunk, chunk_bytes=chunk_bytes, largest_before=region.largest_bytes(jaxpr),
                   largest_after=chunk_bytes, equations=len(region.eqns), nested=candidate.nested,
                   reducers=sorted(jaxpr.eqns[i].primitive.name for i in region.reducing),
                   outputs=len(plan.outputs))


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
            name = plan.jaxpr.eqns[plan._producer(var)].primitive.name
            out.append(f"a running {_MONOID_STATE.get(monoid, monoid)} {aval_str(var.aval)}" +
                       (" (scatter)" if name in SCATTER_MONOIDS else ""))
    for i, (monoid, reverse) in sorted(plan.region.scans.items()):
        eqn = plan.jaxpr.eqns[i]
        out.append(f"the running total of {eqn.primitive.name} {aval_str(plan._carry_aval(i))} "
                   f"({'from the last slice back' if reverse else 'slice to slice'})")
    return out


def _input_shardings(closed: jx.ClosedJaxpr) -> tuple | None:
    """The jax.jit arguments' ``NamedSharding`` s of ``closed``'s inputs, when known."""
    shardings = input_shardings()
    return shardings if shardings is not None and len(shardings) == len(closed.in_avals) else None


def inline_calls_holding_large(closed: jx.ClosedJaxpr, threshold: int) -> jx.ClosedJaxpr:
    """Inline, at this level, every call (``pjit``, ``closed_call``, ``checkpoint``, ``custom_jvp_call``,
    ``custom_vjp_call``) that reads, returns or computes a value over ``threshold``, recursively
    through nested calls: their equations become splittable together with the caller's.

    Passes run after differentiation, so a custom-derivative call is its primal computation.
    """
    return inline_calls(closed, INLINABLE, keep=lambda eqn: not _holds_large(eqn, threshold))
