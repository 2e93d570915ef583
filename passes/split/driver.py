"""The split pass's driver: every program level, sub-programs first.

:func:`split_nested` inlines the calls holding a large value, joins the ``shard_map`` s a large
value runs between (:mod:`.fuse`), splits every sub-program (loop, branch and solve bodies,
innermost first) and then the level itself; :func:`split_level` runs rounds of plan
(:mod:`.plan`) and rewrite, each round's loops built together, a loop that cannot be built left
out and reported (:mod:`.report`). A failure stays with its sub-program or level, named in the
report; the rest is still split.
"""

from __future__ import annotations

from hlopass import internals as jx

from hlopass.config import Config
from hlopass.graph import DataflowGraph
from hlopass.families import INLINABLE
from hlopass.interpreter import Replacement, bind_equation, inline_calls, rewrite
from hlopass.jaxpr_utils import aval_nbytes, has_subjaxprs, iter_eqns, map_subjaxprs, subjaxprs
from hlopass.report import PassReport, Rewrite, source_line

from .emit import LoopPlan
from .fuse import fuse_shard_maps
from .narrow import narrow_slices
from .options import SplitOptions
from .plan import (eqn_key, harmonise_chunks, harmonise_tails, has_large_max, plan_round, recompute_where_it_helps,
                   record_dot_axes)
from .region import seeds
from .report import error_text, first_location, report_skip, report_split, tag_inside


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
        report.skip(first_location(closed), "call", f"calls left as they are (inlining failed: {error_text(err)})")
        current = closed
    joined = 0
    try:
        current, joined = fuse_shard_maps(current, config.threshold)
    except Exception as err:  # noqa: BLE001
        report.skip(first_location(current), "shard_map", f"shard_maps left apart (joining failed: {error_text(err)})")

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
                        f"left this {eqn.primitive.name} and its sub-programs untouched: {error_text(err)}")
            return None
        tag_inside(report, inner, eqn)
        return outs

    if any(has_subjaxprs(eqn) and _holds_large(eqn, config.threshold) for eqn in current.jaxpr.eqns):
        changed = []
        try:
            candidate = rewrite(current, eqn_rule=lambda e, v: _track(changed, rule(e, v)))
            current = candidate if changed else current
        except Exception as err:  # noqa: BLE001
            report.skip(first_location(current), "sub-programs", f"sub-programs left untouched: {error_text(err)}")
    try:
        new = split_level(current, config, report, options)
    except Exception as err:  # noqa: BLE001
        report.skip(first_location(current), "split", f"this program level left untouched: {error_text(err)}")
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
    narrowed = narrow_slices(current, config, report)
    changed = narrowed is not current
    current = narrowed
    broken: set = set()
    chunks_of_dots: dict = {}   # the chunk of each product recomputed in a loop (harmonise_chunks)
    tails_of_dots: dict = {}    # whether its loops end with an overlapping step (harmonise_tails)
    dot_axes: dict = {}         # the axis each product is cut along (plan_round)
    staging_tries = 2  # looking for two-pass values costs re-planning: twice per level at most
    for _ in range(options.max_rounds):
        jaxpr = current.jaxpr
        graph = DataflowGraph(jaxpr)
        plans, failures = plan_round(jaxpr, graph, config, report, options, broken, split_level=split_level,
                                     dot_axes=dot_axes)
        nested = any(p.candidate.nested for p in plans) and has_large_max(jaxpr, config.split_size)
        if (failures or nested) and staging_tries:  # a shared large value may need two passes: a copy per stage
            staging_tries -= 1
            current, plans, failures = recompute_where_it_helps(current, plans, failures, config, report,
                                                                options, broken, split_level=split_level)
            jaxpr = current.jaxpr
        if not plans:
            for seed, index, reason in failures:
                report_skip(report, jaxpr, seed, index, reason)
            break
        harmonise_chunks(jaxpr, plans, chunks_of_dots)
        harmonise_tails(jaxpr, plans, tails_of_dots, options.overlap_last_step)
        record_dot_axes(jaxpr, plans, dot_axes)
        built = _rewrite_isolating_failures(current, jaxpr, plans, report, broken)
        if built is None:
            break
        current, changed = built, True
    return current if changed else closed


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
            report_split(report, jaxpr, plan, plan.candidate)
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
            broken.add(eqn_key(seed))
            report.skip(source_line(seed), seed.primitive.name,
                        f"the loop for this region could not be built, left as it is: {error_text(err)}")
    if not good:
        return None
    try:
        return attempt(good, keep=True)
    except Exception:  # noqa: BLE001 - each works alone but not together: keep the first
        return attempt(good[:1], keep=True)


def inline_calls_holding_large(closed: jx.ClosedJaxpr, threshold: int) -> jx.ClosedJaxpr:
    """Inline, at this level, every call (``pjit``, ``closed_call``, ``checkpoint``, ``custom_jvp_call``,
    ``custom_vjp_call``) that reads, returns or computes a value over ``threshold``, recursively
    through nested calls: their equations become splittable together with the caller's.

    Passes run after differentiation, so a custom-derivative call is its primal computation.
    """
    return inline_calls(closed, INLINABLE, keep=lambda eqn: not _holds_large(eqn, threshold))
