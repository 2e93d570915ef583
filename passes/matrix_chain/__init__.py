"""Matrix-chain reordering: evaluate chains of contractions in their cheapest order.

Matches: maximal trees of ``dot_general``, ``transpose``, ``reduce_sum``,
widening ``convert_element_type``, ``mul`` by a scalar and reshapes that
only add or drop axes of size 1, whose intermediates are used only inside the tree
(matrix-matrix, matrix-vector and batched products; a sum over an axis
counts as a product with a ones vector). An intermediate that is returned
or read by anything else is a boundary; one read by several chains only
is recomputed inside each of them when that costs fewer multiply-adds in
total, and is a boundary otherwise.

Emits: the same contraction as ``lax.dot_general`` s in the order with the
fewest multiply-adds (opt_einsum's dynamic programming), with every
intermediate within the size threshold when one is set and some order
allows it. An order replaces the one as written only when it cuts the
multiply-adds by at least ``Config.min_gain`` (``HLOPASS_MIN_GAIN``,
default 1.25), or when the written order breaks the threshold and the new
one does not. Floating types only.

Leaves alone: chains already in their cheapest order, chains whose cheapest
order gains less than ``min_gain`` (reported, with both multiply-add
counts), non-float chains, intermediates read outside the chain
(boundaries), and a chain whose products ask for different precisions or
that cannot be read or emitted (reported with its source line; the level's
other chains are still reordered).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
from hlopass import internals as jx

from hlopass.config import DEFAULT_MIN_GAIN, Config
from hlopass.finite import EMPTY_AXIS, SPLITS_REGIONS, finite_or_written, has_empty_axis, why_unguarded
from hlopass.graph import DataflowGraph
from hlopass.interpreter import Replacement, rewrite, written_between
from hlopass.jaxpr_utils import dce, trace_flat
from hlopass.pass_base import Pass
from hlopass.report import PassReport
from hlopass.sizes import format_size

from .options import ChainOptions


@dataclasses.dataclass(frozen=True)
class Plan:
    """The order chosen for one chain and what it costs, next to the order as written.

    ``rewrite`` says whether to emit it; when it is false, ``why`` says why the order as
    written stays (empty when the written order is already the cheapest).
    """

    path: Path
    flops_before: int
    flops_after: int
    peak_before: int
    peak_after: int
    rewrite: bool = True
    why: str = ""


class MatrixChainPass(Pass):
    """Reorders chains of ``dot_general`` s into their cheapest order (see the module docstring)."""

    name = "matrix_chain"
    provides = frozenset({"reorder_products"})
    Options = ChainOptions

    def run_level(self, closed: jx.ClosedJaxpr, config: Config, report: PassReport) -> jx.ClosedJaxpr:
        from .network import extract_networks, shared_worth_inlining
        live = dce(closed)  # dead readers would otherwise make products look shared
        if len(live.jaxpr.eqns) == len(closed.jaxpr.eqns):
            live = closed
        graph = DataflowGraph(live)
        replacements = []
        options = self.options
        splitter = self.later_provides(SPLITS_REGIONS)
        try:
            inline = shared_worth_inlining(graph, options=options, min_gain=config.min_gain)
        except Exception as err:  # noqa: BLE001 - a failure here must not cost the level's other chains
            report.skip("<unknown>", "dot_general", f"could not weigh recomputing shared products "
                        f"({type(err).__name__}: {err}); each is kept as written")
            inline = frozenset()
        for network in extract_networks(graph, inline):
            root = graph.eqn(network.root)
            if network.unsupported:
                report.skip(root, "dot_general", f"chain {network.original_expression}: {network.unsupported}")
                continue
            if has_empty_axis(a.aval for a in network.atoms):
                report.skip(root, "dot_general", f"chain {network.original_expression}: {EMPTY_AXIS}")
                continue
            if len(network.operands) > options.max_operands:
                report.skip(root, "dot_general", f"chain of {len(network.operands)} operands is longer than "
                                                 f"the pass handles ({options.max_operands})")
                continue
            try:
                # A chain that recomputes a shared product must be rewritten: the
                # product's other readers no longer have it otherwise.
                plan = plan_order(network, config.threshold, force=bool(network.shared_eqns),
                                  search_limit=options.max_exponential_search, min_gain=config.min_gain)
                if plan.rewrite:
                    trace_flat(functools.partial(_emit, network, plan.path), [a.aval for a in network.atoms])
            except Exception as err:  # noqa: BLE001 - one chain's failure must not cost the others
                report.skip(root, "dot_general", f"chain {network.original_expression}: could not be reordered "
                            f"({type(err).__name__}: {err}); left as written")
                continue
            if not plan.rewrite:
                if plan.why:
                    report.skip(root, "dot_general", f"chain {network.original_expression}: {plan.why}")
                continue
            build = functools.partial(_emit, network, plan.path)
            given = set(live.jaxpr.invars) | set(live.jaxpr.constvars)
            caveat = why_unguarded(root.outvars[0].aval, plan.peak_before, config.threshold, splitter,
                                   [a.aval for a in network.atoms],
                                   [a.aval for a in network.atoms if isinstance(a, jx.Var) and a not in given])
            if caveat is None:
                try:
                    build = functools.partial(_guarded, build, written_between(live, network.atoms, [root.outvars[0]]))
                except ValueError as err:
                    caveat = f"no written program to fall back on for non-finite values ({err})"
            replacements.append(Replacement(
                eqns=network.eqns, inputs=network.atoms, outputs=[root.outvars[0]], build=build,
                anchor=network.root))
            _report(report, root, network, plan, caveat)
        if not replacements:
            return closed
        return rewrite(live, replacements, name="matrix_chain")


def plan_order(network: Network, threshold_bytes: int | None, force: bool = False,
               search_limit: int = ChainOptions.max_exponential_search,
               min_gain: float = DEFAULT_MIN_GAIN) -> Plan:
    """The order to emit for ``network`` (``Plan.rewrite`` false when the order as written stays;
    never with ``force``).

    With a threshold, the cheapest order whose intermediates all fit under it
    wins; if the order as written does not fit and another does, that one is
    taken even at a higher multiply-add count. If none fits, the cheapest
    order overall is used. Otherwise an order replaces the written one only when it cuts the
    multiply-adds by at least ``min_gain`` (``Config.min_gain``): a smaller gain is not worth
    the change of rounding.
    """
    from .network import describe_path, fitting_path, optimal_path, path_cost
    itemsize = np.dtype(network.dtype).itemsize
    limit = None if threshold_bytes is None else max(threshold_bytes // itemsize, 1)
    path = None
    if limit is not None:
        try:
            path = optimal_path(network, limit, search_limit)
        except RuntimeError:
            path = None
    if path is None:
        path = optimal_path(network, search_limit=search_limit)
    cost = path_cost(network, path)
    if limit is not None and cost.peak_elements > limit:
        # opt_einsum's limit also bounds the result; search for an order whose intermediates fit.
        fitting = fitting_path(network, limit, search_limit)
        if fitting is not None:
            path, cost = fitting, path_cost(network, fitting)
    peak_after = cost.peak_elements * itemsize
    fits_now = limit is None or network.original_peak_bytes <= threshold_bytes
    fits_after = limit is None or peak_after <= threshold_bytes
    before, after = network.original_multiply_adds, cost.multiply_adds
    cheaper = after < before
    pays = cheaper and after * min_gain <= before
    plan = Plan(path, 2 * before, 2 * after, network.original_peak_bytes, peak_after)
    if force or _better(pays, fits_now, fits_after):
        return plan
    why = ""
    if cheaper and not pays and (fits_after or not fits_now):
        why = (f"left as written: the cheapest order ({describe_path(network, path)}) cuts the multiply-adds "
               f"only {before / after:.3g}x ({before:,} -> {after:,}), less than the minimum gain "
               f"{min_gain:g} (HLOPASS_MIN_GAIN, min_gain=)")
    return dataclasses.replace(plan, rewrite=False, why=why)


def _better(pays: bool, fits_now: bool, fits_after: bool) -> bool:
    if fits_after and not fits_now:
        return True  # the order as written breaks the threshold, the new one does not
    return pays and (fits_after or not fits_now)  # enough fewer multiply-adds, no new breach


def _emit(network: Network, path: Path, *values):
    from .network import contract
    return [contract(network, path, values)]


def _guarded(build, written, *values):
    """The reordered chain where its result is finite, else the chain as written (see
    :mod:`hlopass.finite`): IEEE infinities make ``(A·B)·C`` and ``A·(B·C)`` differ (``Inf·0``)."""
    return finite_or_written(build(*values), written, values)


def _report(report: PassReport, root, network: Network, plan: Plan, caveat: str | None = None) -> None:
    from .network import describe_path
    n_factors = sum(not op.is_ones for op in network.operands)
    shared = ""
    if network.shared_eqns:
        shared = (f" (recomputes {len(network.shared_eqns)} shared equation(s) instead of storing their result;"
                  " FLOPs before count them once, in the first chain that reads them)")
    report.rewrite(
        "reorder", root,
        f"chain of {n_factors} factors {network.original_expression} -> {describe_path(network, plan.path)}: "
        f"{plan.flops_before:.3g} -> {plan.flops_after:.3g} FLOPs, peak intermediate "
        f"{format_size(plan.peak_before)} -> {format_size(plan.peak_after)}{shared}"
        + (f"; Inf/NaN {caveat}" if caveat else ""),
        shared_equations=len(network.shared_eqns), finite_guard=caveat is None,
        flops_before=plan.flops_before, flops_after=plan.flops_after,
        peak_intermediate_before=plan.peak_before, peak_intermediate_after=plan.peak_after,
        einsum=network.subscripts, order=describe_path(network, plan.path),
        written=network.original_expression, path=[list(step) for step in plan.path])
