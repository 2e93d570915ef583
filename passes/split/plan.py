"""Planning the split pass's loops: for every reducer of a large value, the region to loop over,
the axis and the chunk (:func:`plan_round`), one round of non-overlapping regions at a time.

Each seed's region is grown along each axis it can be split on (:mod:`.region`); a region whose
split axis is cut across devices is refused; among the rest the pass prefers one that fits in one
level, then the smallest nested step, then what it keeps out of memory (:class:`Candidate`). The
chunk keeps one step within the split size (and the cache on CPU, :func:`choose_chunk`); a step
still too large is split again inside (at most :data:`MAX_NESTING` levels). Loops that recompute
one product get one chunk (:func:`harmonise_chunks`), and a large value read before and after its
own reduction may be recomputed per stage of its readers when that leaves fewer regions unsplit
(:func:`recompute_where_it_helps`).
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
from typing import Callable

import jax

from hlopass import internals as jx

from hlopass.config import Config
from hlopass.graph import DataflowGraph
from hlopass.jaxpr_utils import aval_nbytes, aval_str
from hlopass.report import PassReport, source_line

from .emit import LoopPlan, can_overlap, fusible_dot
from .options import SplitOptions
from .recompute import Staging
from .region import FUSIBLE_PRODUCERS, FUSING_CONSUMERS, Infeasible, SplitRegion, grow_region, seed_labels, seeds
from .report import error_text, named_at
from .shares import device_bytes, sharded_values
from .unroll import unroll_short_reductions, unrolled_lengths

#: How a nested step's program is split again: the driver's ``split_level(closed, config, report, options)``.
SplitLevel = Callable[[jx.ClosedJaxpr, Config, PassReport, SplitOptions], jx.ClosedJaxpr]


@dataclasses.dataclass
class Candidate:
    """One way to split a seed's region: along which axis (``region``), in which chunks, whether a step is
    split again inside (``nested``), and what it gains; :meth:`key` orders the ways."""

    region: SplitRegion
    chunk: int
    nested: bool
    covered: int      # bytes of large values the region keeps out of memory
    survives: bool    # the split axis reaches the results (no accumulation)
    step_bytes: int   # the largest value of one iteration
    per_iteration: int = 1  # steps per loop iteration (accelerators, where steps fuse)

    def key(self):
        # Fitting in one level first; among nested ones the smallest step; then what it covers.
        return (not self.nested, -self.step_bytes if self.nested else 0, self.covered, self.survives,
                self.region.size)


def plan_round(jaxpr, graph, config: Config, report: PassReport, options: SplitOptions, broken: set = frozenset(),
               *, split_level: SplitLevel, dot_axes: dict | None = None, below: tuple[int, int] | None = None):
    """Plan a loop for every region of this round: ``(plans, failures)``, regions that overlap one
    planned this round left to the next. ``split_level`` splits a nested step's program (the driver's).
    With ``below`` (a :func:`_score`), ``None`` as soon as the round's score cannot end below it:
    failures and nested plans only accumulate, so the rest of the round cannot change that answer.

    A region that recomputes a ``dot_general`` another loop computes (this round, or an earlier one
    recorded in ``dot_axes``, see :func:`record_dot_axes`) is cut along the same axis of the product
    where it can be: XLA:CPU's dot rounds differently for differently shaped pieces.
    """
    axes = dict(dot_axes or {})
    plans: list[LoopPlan] = []
    failures: list[tuple[int, int, str]] = []  # (seed, blocking equation, reason)
    claimed: set[int] = set()
    unrolled = unrolled_lengths(jaxpr, graph, options.unroll_max_length, options.unroll_min_elements) \
        if _on_accelerator(options) and options.unroll_max_length else {}
    for seed in reversed(seeds(jaxpr, config.threshold, graph)):  # the last reducer covers the longest chain
        if seed in claimed or (broken and eqn_key(jaxpr.eqns[seed]) in broken):
            continue
        try:
            candidate, why = _best_candidate(jaxpr, graph, seed, config, options, unrolled, axes)
        except Exception as err:  # noqa: BLE001 - a failure here stays with this region
            failures.append((seed, seed, f"planning failed: {error_text(err)}"))
            if below is not None and _score(plans, failures) >= below:
                return None
            continue
        if candidate is None:
            failures.append(why)
            if below is not None and _score(plans, failures) >= below:
                return None
            continue
        if candidate.region.eqns & claimed or (broken and any(eqn_key(jaxpr.eqns[i]) in broken
                                                              for i in candidate.region.reducing)):
            continue  # overlaps a region split this round; looked at again next round
        claimed |= candidate.region.eqns
        axes.update(_dot_axes(jaxpr, candidate.region))
        plans.append(_plan(jaxpr, graph, candidate, config, report, options, split_level))
        if below is not None and candidate.nested and _score(plans, failures) >= below:
            return None
    return plans, failures


def _dot_axes(jaxpr, region: SplitRegion) -> dict:
    """The axis a region cuts each product it computes along: ``eqn_key`` -> axis of its result."""
    found = {}
    for i in region.eqns:
        eqn = jaxpr.eqns[i]
        if eqn.primitive.name == "dot_general" and region.var_axis.get(eqn.outvars[0]) is not None:
            found[eqn_key(eqn)] = region.var_axis[eqn.outvars[0]]
    return found


def record_dot_axes(jaxpr, plans, recorded: dict) -> None:
    """Remember the axis each planned loop cuts its products along, for the level's later rounds."""
    for plan in plans:
        for key, axis in _dot_axes(jaxpr, plan.region).items():
            recorded.setdefault(key, axis)


def _best_candidate(jaxpr, graph, seed: int, config: Config, options: SplitOptions, unrolled: dict,
                    axes: dict):
    """The preferred way to split ``seed``'s region (:meth:`Candidate.key`; among those that fit alike,
    after what it keeps out of memory, one cutting the products other loops compute along the same
    axes), or ``(None, why not)``."""
    def rank(candidate):
        key = candidate.key()
        agrees = all(axes.get(k, axis) == axis for k, axis in _dot_axes(jaxpr, candidate.region).items())
        return (*key[:3], agrees, *key[3:])

    best, why = None, (seed, seed, "no splittable axis on the large operand")
    for label in seed_labels(jaxpr, seed, config.threshold, graph):
        try:
            region = grow_region(jaxpr, graph, seed, label, config.split_size)
        except Infeasible as err:
            why = (seed, err.eqn_index, f"cannot split the reduction at {named_at(jaxpr, seed)}: {err.reason}")
            continue
        sharded = _sharded_split_axis(jaxpr, region)
        if sharded is not None:
            why = (seed, seed, f"cannot split the reduction at {named_at(jaxpr, seed)} along axis {sharded[1]} of "
                               f"{aval_str(sharded[0].aval)}: that axis is sharded across devices (its loop "
                               f"would gather the shards onto every device)")
            continue
        candidate = _candidate(jaxpr, graph, region, config, options, unrolled)
        if candidate is None:
            why = (seed, seed, "the large operand is not computed here (an input or a value needed elsewhere)")
            continue
        if best is None or rank(candidate) > rank(best):
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


def _candidate(jaxpr, graph, region: SplitRegion, config: Config, options: SplitOptions,
               unrolled: dict) -> Candidate | None:
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
    if _on_accelerator(options):  # sized by the largest value a step builds (short reductions unrolled)
        fits = int(config.split_size // max(region.per_unit_bytes(jaxpr, unrolled), 1))
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
    per_iteration = 1
    if _on_accelerator(options) and not nested:
        stored = region.peak_per_unit_bytes(jaxpr, graph, fuses=_AcceleratorFusion) * chunk
        per_iteration = max(1, min(options.accelerator_steps_per_iteration, config.split_size // max(stored, 1)))
    return Candidate(region, chunk, nested, covered, survives=not region.reducing, step_bytes=chunk * per_unit,
                     per_iteration=per_iteration)


class _AcceleratorFusion:
    """What an accelerator's XLA fuses in a step: elementwise work into the reductions and into the
    products bound as elementwise work (thin and short ones, :func:`~.emit.fusible_dot`)."""

    @staticmethod
    def _dot_kind(eqn):
        return fusible_dot(eqn.invars[0].aval.shape, eqn.invars[1].aval.shape, eqn.params["dimension_numbers"])

    @classmethod
    def produces(cls, eqn) -> bool:
        if eqn.primitive.name == "dot_general":
            return cls._dot_kind(eqn) == "short"
        return eqn.primitive.name in FUSIBLE_PRODUCERS

    @classmethod
    def consume_together(cls, eqns) -> bool:
        """Readers bound as one product: thin products (:meth:`~.emit.LoopPlan.sibling_thin_dots`)."""
        return all(e.primitive.name == "dot_general" and cls._dot_kind(e) == "thin" for e in eqns)

    @classmethod
    def consumes(cls, eqn) -> bool:
        if eqn.primitive.name == "dot_general":
            return cls._dot_kind(eqn) is not None
        return eqn.primitive.name in FUSING_CONSUMERS


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


def _plan(jaxpr, graph, candidate: Candidate, config: Config, report: PassReport,
          options: SplitOptions, split_level: SplitLevel) -> LoopPlan:
    """The loop for ``candidate``; a nested one's steps are split again by ``split_level`` (one level deeper)."""
    region = candidate.region
    plan = LoopPlan(jaxpr, region, region.inputs(jaxpr), region.outputs(jaxpr, graph), candidate.chunk,
                    candidate=candidate, grouped_top_k=options.grouped_top_k,
                    fuse_thin_dots=_on_accelerator(options), upcast_16_bit_dots=jax.default_backend() == "cpu",
                    steps_per_iteration=candidate.per_iteration)
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


def harmonise_chunks(jaxpr, plans, recorded: dict) -> None:
    """Give every loop that recomputes the same ``dot_general`` along the same axis the same chunk:
    the smallest any of them chose, this round or an earlier one of the level (``recorded``).

    XLA:CPU's dot kernels round differently for different widths (one column, five, 32...), so a
    product recomputed in two loops with different chunks differs in its last bits. Where both
    copies meet again through ``exp``, as a softmax normalised in one loop and exponentiated in
    another, the probabilities no longer sum to one: a float32 gradient 25 times its own scale
    off (fresh seed r73655148886). A smaller chunk always fits.
    """
    keys = [_dot_keys(jaxpr, plan) for plan in plans]
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


def _dot_keys(jaxpr, plan) -> set:
    """The products ``plan``'s loop computes along its axis: (product, axis length, axis)."""
    region = plan.region
    return {(eqn_key(jaxpr.eqns[i]), region.size, region.var_axis.get(jaxpr.eqns[i].outvars[0]))
            for i in region.eqns if jaxpr.eqns[i].primitive.name == "dot_general"
            and region.var_axis.get(jaxpr.eqns[i].outvars[0]) is not None}


def harmonise_tails(jaxpr, plans, recorded: dict, allowed: bool = True) -> None:
    """End every loop that can (:func:`.emit.can_overlap`) with an overlapping whole step instead of a
    short one, which XLA compiles as a second copy of the step, except a loop that recomputes a product
    that a loop ending short recomputes too, this round or an earlier one of the level (``recorded``:
    each product's choice): the two would round the product's last rows differently (see
    :func:`harmonise_chunks`). A step split again keeps its short step, as its chunk is its own. Not
    ``allowed`` (``SplitOptions.overlap_last_step``): every loop ends short."""
    plans = [plan for plan in plans if not getattr(plan.candidate, "nested", False)]
    keys = [_dot_keys(jaxpr, plan) for plan in plans]
    overlapping = [allowed and can_overlap(plan) for plan in plans]
    short = {k for k, overlaps in recorded.items() if not overlaps}
    short |= {k for own, overlaps in zip(keys, overlapping) if not overlaps for k in own}
    changed = True
    while changed:
        changed = False
        for n, own in enumerate(keys):
            if overlapping[n] and own & short:
                overlapping[n], changed = False, True
                short |= own
    for plan, own, overlaps in zip(plans, keys, overlapping):
        plan.overlap_tail = overlaps
        for k in own:
            recorded[k] = recorded.get(k, overlaps) and overlaps


def has_large_max(jaxpr, large: int) -> bool:
    """Whether a ``reduce_max`` reads a value over ``large`` bytes (a running maximum may spare a nested split)."""
    share = device_bytes(jaxpr)
    return any(eqn.primitive.name == "reduce_max" and share(eqn.invars[0]) > large for eqn in jaxpr.eqns)


def _score(plans, failures) -> tuple[int, int]:
    """Regions left unsplit, then regions split in nested loops: fewer is better."""
    return len(failures), sum(bool(p.candidate.nested) for p in plans)


def recompute_where_it_helps(current, plans, failures, config: Config, report: PassReport,
                             options: SplitOptions, broken: set, *, split_level: SplitLevel):
    """Give the later stages of readers of a shared large value their own copy, one value at a time,
    keeping each copy that leaves fewer regions unsplit. Stages that one loop carrying a running
    maximum can cover are tried first (the latest value first: its copy takes the earlier ones along).
    Each value is tried with coarse stages first (:meth:`.Staging.recompute`): two stacked attention
    blocks' gradient then splits into 3 loops instead of 5, one per pass it needs.

    When every region splits and only nesting is left to remove, only those stages are tried: the others
    separate what one loop could not do in one pass, which is not what nests a loop (on the split and remat
    tests they never removed one; on a Transformer step they were 0.4 s of the split's 1.25 s); and the
    search spends at most ``SplitOptions.max_unnesting_plannings``."""
    sweeps = (True, False) if failures else (True,)
    if failures:
        setting, plannings = "max_recompute_plannings", options.max_recompute_plannings
    else:
        setting, plannings = "max_unnesting_plannings", min(options.max_recompute_plannings,
                                                             options.max_unnesting_plannings)
    budget = _Budget(plannings)
    for online in sweeps:
        current, plans, failures = _recompute_staged(current, plans, failures, config, report, options, broken,
                                                     online, split_level, budget)
        if _score(plans, failures) == (0, 0) or budget.spent:
            break
    unsplit, nested = _score(plans, failures)
    if budget.spent and (unsplit or nested):
        report.skip("<recomputation search>", "split",
                    f"the search for values to recompute stopped after {budget.plannings} plannings "
                    f"(SplitOptions.{setting}), {unsplit} regions left unsplit and {nested} "
                    f"split in nested loops: what it found so far is kept")
    return current, plans, failures


class _Budget:
    """Plannings left to one recomputation search."""

    def __init__(self, plannings: int):
        self.plannings, self.left = plannings, plannings

    @property
    def spent(self) -> bool:
        return self.left <= 0

    def plan(self, jaxpr, config, report, options, broken, split_level, below):
        """A planning round of ``jaxpr``, or ``None`` once its score cannot end below ``below``."""
        self.left -= 1
        return plan_round(jaxpr, DataflowGraph(jaxpr), config, report, options, broken, split_level=split_level,
                          below=below)


def _recompute_staged(current, plans, failures, config: Config, report: PassReport, options: SplitOptions,
                      broken: set, online: bool, split_level: SplitLevel, budget: _Budget):
    memo: list = [None, None, None]   # the last jaxpr asked about (kept alive), its staging and candidates

    def staging_of(jaxpr) -> Staging:
        if memo[0] is not jaxpr:
            staging = Staging(jaxpr, config.split_size, online)
            found = staging.values()
            memo[:] = [jaxpr, staging, found[::-1] if online else found]
        return memo[1]

    def candidates_of(jaxpr):
        staging_of(jaxpr)
        return memo[2]

    origins: dict = {}   # each copied value -> the value it copies (see _copies_round_alike)

    def trial(staged):
        """The staged program's plans, or ``None`` where they do not score better than the current ones."""
        now = _score(plans, failures)
        planned = budget.plan(staged.jaxpr, config, report, options, broken, split_level, now)
        if planned is None or _score(*planned) >= now or not _copies_round_alike(staged.jaxpr, planned[0], origins):
            return None
        return planned

    # A worklist: a value whose copy did not help is tried again only after a sweep over the others
    # has kept some copy (re-trying every earlier value after each kept copy was most of the pass's time).
    # Values of the program as written only: a copy's own copy was tried after each kept copy of a
    # softmax's exponentials on the Transformer blocks under their memory limit, 2 of the search's 20
    # plannings, and never kept there nor on 30 plannings of the compile and remat benches' programs
    # (two thresholds or limits each; a scratch comparison of the reports).
    failed: set = set()
    improved = False
    for _ in range(len(current.jaxpr.eqns)):
        if _score(plans, failures) == (0, 0) or budget.spent:
            break
        pending = [v for v in candidates_of(current.jaxpr) if v not in failed and origins.get(v, v) is v]
        if not pending:
            if not improved:
                break
            failed.clear()
            improved = False
            continue
        var = pending[0]
        staging = staging_of(current.jaxpr)
        # Coarse stages first (readers one level apart share a copy, and a copy made earlier is read
        # again): one loop for what one pass can do. Stage by stage where that does not help.
        tries = [staging.recompute(current, var, origins)]
        coarse = staging.recompute(current, var, origins, coarse=True)
        if coarse is not current and len(coarse.jaxpr.eqns) < len(tries[0].jaxpr.eqns):
            tries.insert(0, coarse)
        for staged in tries:
            planned = trial(staged)
            if planned is not None:
                break
        if planned is not None:
            current, (plans, failures) = staged, planned
            improved = True
        else:
            failed.add(var)
    if _score(plans, failures) != (0, 0) and not budget.spent:  # values whose copies only help together (a gradient reading several of them again)
        # each value of the program as written copied once: copies of copies grew a gradient of 525
        # equations past 10,000 and its planning past minutes (fresh seed s720060993994)
        staged, copied_once = current, set()
        for _ in range(4 * len(current.jaxpr.eqns)):
            candidates = [v for v in candidates_of(staged.jaxpr) if origins.get(v, v) not in copied_once]
            if not candidates:
                break
            copied = staging_of(staged.jaxpr).recompute(staged, candidates[0], origins)
            if copied is staged:
                break
            copied_once.add(origins.get(candidates[0], candidates[0]))
            staged = copied
        planned = trial(staged) if staged is not current else None
        if planned is not None:
            current, (plans, failures) = staged, planned
    return current, plans, failures


def _copies_round_alike(jaxpr, plans, origins: dict) -> bool:
    """Whether every reduction of a recomputed value (a copy and the equation it copies) is computed
    the same way each time: whole in each, or accumulated by loops of the same length and chunk.

    A sum accumulated over one loop's chunks rounds otherwise than the same sum taken whole, and
    where the copies meet again the difference is no longer rounding: a softmax's shift ``max(k)``
    taken from one copy of ``k`` and subtracted from another gives ``exp(k - max k) != 1`` at the
    maximum, a float32 gradient 0.4% of its scale off (fresh seed s1040642467927)."""
    way = {}
    for plan in plans:
        for i in plan.region.reducing:
            way[i] = (plan.region.size, plan.chunk, bool(getattr(plan.candidate, "nested", False)))
    ways: dict = {}
    for i, eqn in enumerate(jaxpr.eqns):
        out = eqn.outvars[0] if eqn.outvars else None
        if out is not None and not isinstance(out, jx.DropVar):
            ways.setdefault(origins.get(out, out), set()).add(way.get(i))
    return all(len(w) == 1 for w in ways.values())


def eqn_key(eqn) -> tuple:
    """Identifies an equation across re-traces (indices change)."""
    return (eqn.primitive.name, source_line(eqn), tuple(str(v.aval) for v in eqn.outvars),
            tuple(str(getattr(a, "aval", a)) for a in eqn.invars))
