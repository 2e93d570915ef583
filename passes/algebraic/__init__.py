"""The algebraic pass: match-and-replace of sums whose expansion never builds the big tensor.

Matches: every ``reduce_sum`` and ``dot_general`` whose operand, expanded by
:mod:`.expansion` into a sum of einsum monomials over smaller tensors,
looks through a value larger than everything it reads and writes (or through
a matrix product whose result is only partly used).

Emits: one ``jnp.einsum`` per monomial. What that covers:

* squared Euclidean distances ``Σ_d (x_nd − y_md)²`` in any spelling (powers,
  squares, ``e*e``, either subtraction order, feature axis anywhere, batch
  axes, per-feature scales, under ``sqrt``/``norm``) become
  ``Σx² + Σy² − 2·x·yᵀ``, clamped at zero (kind ``squared_distance``);
* broadcast-multiply-reduce ``(x[:,None,:] * y[None]).sum(-1)`` becomes a
  ``dot_general`` (kind ``contraction``);
* ``diag(A @ B)``, ``trace(A @ B)`` (kinds ``diagonal_of_product``,
  ``trace_of_product``) and ``sum(A @ B, axis)`` (``sum_of_product``; left to
  a later pass that provides ``reorder_products``, matrix_chain, when one
  runs) skip the full product;
* the derivatives of the above (``Σ_m g·(x − y)``, kind ``expanded_product``).

When: an *exact* rewrite (the same products summed in another order: a
contraction, ``diag``/``trace``/``sum`` of a product) fires whatever the
threshold, as soon as it removes a value larger than everything it reads
and writes or skips part of a product. An *inexact* one (it multiplies a sum
out and cancels: the squared distance, its gradients) fires only for a
removed value above the size threshold (``config.threshold``; ``None`` means
always), and only under the rules of :mod:`.guards`: never where the value
feeds a comparison, a square root, a division or a logarithm (anything
sensitive to exact zeros); centred; an exact zero on a self-distance's
diagonal; Inf/NaN as plain JAX gives them.

Calls (``pjit``, ``custom_jvp``/``custom_vjp``, ``checkpoint``) are inlined
first, at every level, so that values inside them and their readers are
seen as if written inline (the passes run after differentiation, so a custom
rule's body is the primal computation); the program comes back unchanged, the
same object, when nothing is rewritten.

Leaves alone: where the maths differs (``abs``, ``max``, a cube, another
reduction, a difference of full-size tensors), a ``where`` on data (it guards
what it drops), a product with an identity mask (``jnp.eye(n) * M``: plain
JAX keeps 0·Inf = NaN off the diagonal), an inexact rewrite below the
threshold or against the rules above, and a removed value that stays alive
because something else reads it. A root whose analysis or emission fails is
reported with its source line; the others are still rewritten.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from hlopass import internals as jx

from hlopass.families import INLINABLE
from hlopass.finite import SPLITS_REGIONS, finite_or_written, why_unguarded
from hlopass.interpreter import Replacement, inline_calls, rewrite, rewrite_nested, written_between
from hlopass.jaxpr_utils import aval_nbytes, aval_str, trace_flat
from hlopass.pass_base import Pass
from hlopass.report import PassReport, source_line
from hlopass.sizes import format_size

from . import guards
from .expansion import (EXPANSION_RULES, Expander, Expansion, ExpansionLimits, Internal, NoMatch, Scope, unify,
                        check_emittable, emit)

ROOT_PRIMITIVES = ("reduce_sum", "dot_general", "cond")
#: The capability of a later pass that takes sums of matrix products off this pass's hands.
REORDERS_PRODUCTS = "reorder_products"


@dataclasses.dataclass
class Candidate:
    """One root equation whose expansion may replace it."""

    index: int
    eqn: jx.JaxprEqn
    expander: Expander
    expansion: Expansion
    output_labels: tuple
    removed: Internal
    kind: str
    #: the expansion as written (differences kept whole), which :mod:`.guards` reads
    written: Expansion | None = None
    #: how an inexact expansion is emitted (``None`` for an exact one)
    plan: guards.Plan | None = None
    #: the written program, re-run when the rewritten value is not finite (``None``: no guard)
    written_program: object = None
    #: why there is no such guard where one would matter (said in the report)
    caveat: str | None = None

    @property
    def exact(self) -> bool:
        return self.expansion.exact

    @property
    def clamp(self) -> bool:
        return self.kind == "squared_distance" if self.plan is None else self.plan.sign != 0

    def build(self, *values):
        fast = self.build_rewritten(*values)
        if self.written_program is None:
            return fast
        return finite_or_written(fast, self.written_program, values)

    def build_rewritten(self, *values):
        out = self.eqn.outvars[0].aval
        if self.plan is not None:
            return [guards.emit_planned(self.plan, self.expansion, list(values), self.output_labels,
                                        self.expander.label_sizes, tuple(out.shape), out.dtype)]
        return [emit(self.expansion, list(values), self.output_labels, self.expander.label_sizes,
                     tuple(out.shape), out.dtype, clamp_at_zero=self.clamp)]


def same_products(expansion: Expansion, output_labels: tuple) -> bool:
    """Whether the emitted einsum forms the products the written program forms (one monomial, every
    summed label, after the diagonals' deltas, in every factor): then Inf and NaN land where they
    land in the written program, in any summation order. Otherwise sums are multiplied out or
    factored (``Σa·Σb``), which IEEE arithmetic does not do alike for infinities (``Inf·0``)."""
    if len(expansion.monomials) != 1:
        return False
    (m,) = expansion.monomials
    rep, summed = unify(m, {lab for lab in output_labels if lab is not None})
    return all(all(label in {rep.get(lab, lab) for lab in f.labels} for f in m.factors) for label in summed)


def finite_guard(closed: jx.ClosedJaxpr, c: Candidate, threshold: int | None, splitter: str | None):
    """The written program ``c`` falls back to when its value is not finite (see :mod:`hlopass.finite`),
    or a reason there is none: its products are the written ones, its result is over the threshold
    (a branch around it would hide it from the split pass), or nothing would bound the written
    program in its branch."""
    if same_products(c.expansion, c.output_labels) or (c.plan is not None and c.plan.squares):
        return None, None  # the written products, or a pairwise distance emitted with plain's Inf/NaN
    given = set(closed.jaxpr.invars) | set(closed.jaxpr.constvars)
    caveat = why_unguarded(c.eqn.outvars[0].aval, c.removed.nbytes, threshold, splitter,
                           [v.aval for v in c.expander.sources],
                           [v.aval for v in c.expander.sources if isinstance(v, jx.Var) and v not in given])
    if caveat:
        return None, caveat
    return written_between(closed, list(c.expander.sources), list(c.eqn.outvars)), None


#: Primitives of a plain chain of products and sums (what the matrix-chain pass reorders).
CHAIN_PRIMITIVES = frozenset({"dot_general", "reduce_sum", "transpose", "convert_element_type", "reshape",
                              "squeeze", "expand_dims"})


def classify(expansion: Expansion, candidate_internal: list[Internal], output_labels: tuple) -> str:
    """Name the rewrite for the report from the shape of the expansion."""
    has_dot = any(i.primitive == "dot_general" for i in candidate_internal)
    has_delta = any(m.deltas for m in expansion.monomials)
    if has_dot and has_delta:
        return "trace_of_product" if all(lab is None for lab in output_labels) else "diagonal_of_product"
    if expansion.nonneg and expansion.depth == 2:
        return "squared_distance"
    if has_dot and all(i.primitive in CHAIN_PRIMITIVES for i in candidate_internal):
        return "sum_of_product"
    if expansion.depth == 0:
        return "contraction"
    return "expanded_product"


def find_candidate(jaxpr: jx.Jaxpr, index: int, threshold: int | None, report,
                   products_reordered_by: str | None = None, scope: Scope | None = None,
                   limits: ExpansionLimits = ExpansionLimits()) -> Candidate | None:
    """The candidate rooted at equation ``index``, or ``None`` (recording why when it matters).

    Plain sums of matrix products are left to the pass named ``products_reordered_by``
    (a later pass that reorders products), if any.
    """
    eqn = jaxpr.eqns[index]
    out = eqn.outvars[0]
    if len(eqn.outvars) != 1 or np.dtype(out.aval.dtype).kind != "f":
        return None
    expander = Expander(jaxpr, scope, limits)
    labels = expander.fresh_labels(out.aval.shape)
    try:
        written = EXPANSION_RULES[eqn.primitive.name](expander, eqn, expander.top, 0, labels)
        expansion = expander.substitute(written)
        check_emittable(expansion, labels)
    except NoMatch as reason:
        if _is_large(eqn, threshold):
            report.skip(_location(jaxpr, index, expander), eqn.primitive.name, str(reason))
        return None
    worth_telling = _is_large(eqn, threshold) and (expander.notes or _reads_computed_operand_sized(expander, eqn))
    kept = max([aval_nbytes(out.aval)] + [aval_nbytes(v.aval) for v in expander.sources])
    internal = list(expander.internal.values())
    if not internal:
        if worth_telling:
            report.skip(_location(jaxpr, index, expander), eqn.primitive.name, _why_not(expander))
        return None
    removed = max(internal, key=lambda i: i.nbytes)
    if not expansion.exact and threshold is not None and removed.nbytes <= threshold:
        return None  # inexact rewrites only where memory asks for them
    if expansion.exact and not any(len(m.factors) > 1 or m.deltas for m in expansion.monomials):
        return None  # a sum of one tensor, relabelled: nothing a rewrite could skip
    kind = classify(expansion, internal, labels)
    partly_used_product = kind in ("trace_of_product", "diagonal_of_product", "sum_of_product") and any(
        i.primitive == "dot_general" and i.nbytes >= kept for i in internal)
    if removed.nbytes <= kept and not partly_used_product:
        if worth_telling:
            reason = _why_not(expander) if expander.notes else (
                f"the expansion would read tensors as large as the {aval_str(removed.var.aval)} it removes")
            report.skip(_location(jaxpr, index, expander), eqn.primitive.name, reason)
        return None
    if kind == "sum_of_product" and products_reordered_by:
        if threshold is None or removed.nbytes > threshold:
            report.skip(_location(jaxpr, index, expander), eqn.primitive.name,
                        f"a sum of a matrix product: left to the {products_reordered_by} pass, which reorders products")
        return None
    candidate = Candidate(index, eqn, expander, expansion, labels, removed, kind, written)
    if expansion.exact:
        return candidate
    what = kind.replace("_", " ")
    if np.dtype(out.aval.dtype).itemsize < 4:
        report.skip(_location(jaxpr, index, expander), eqn.primitive.name,
                    f"the {what} in {np.dtype(out.aval.dtype).name}: expanded, it would cancel and overflow")
        return None
    sensitive = guards.zero_sensitive_use(jaxpr, out)
    if sensitive is not None:
        use, description = sensitive
        report.skip(_location(jaxpr, index, expander), eqn.primitive.name,
                    f"the {what} feeds {description} ({_named(use)}): its expanded "
                    "form is not exactly zero for equal points, so that use is sensitive to it")
        return None
    plan = guards.plan(written, expansion, expander, labels, squared=expansion.depth == 2)
    if isinstance(plan, str):
        report.skip(_location(jaxpr, index, expander), eqn.primitive.name,
                    f"the {what} cannot keep plain JAX's Inf/NaN semantics: {plan}")
        return None
    candidate.plan = plan
    return candidate


def _is_large(eqn, threshold) -> bool:
    """Worth a line in the report: a sum of a tensor larger than its result (and than the threshold)."""
    if eqn.primitive.name != "reduce_sum":
        return False
    operand = aval_nbytes(eqn.invars[0].aval)
    return operand > aval_nbytes(eqn.outvars[0].aval) and (threshold is None or operand > threshold)


def _reads_computed_operand_sized(expander: Expander, eqn) -> bool:
    """The expansion stopped at a computed value as large as the root's operand (an ``abs``, say)."""
    size = aval_nbytes(eqn.invars[0].aval)
    return any(expander.top.defining(v) is not None and aval_nbytes(v.aval) >= size for v in expander.sources)


def _why_not(expander: Expander) -> str:
    if expander.notes:
        return "; ".join(dict.fromkeys(expander.notes))
    leaves = [f"{_producer_name(expander, v)} {aval_str(v.aval)}" for v in expander.sources]
    return "its operand is not a polynomial in smaller tensors (reads " + ", ".join(leaves) + ")"


def _producer_name(expander: Expander, var) -> str:
    found = expander.top.defining(var)
    return found[2].primitive.name if found else "input"


def live_vars(jaxpr: jx.Jaxpr, replaced: dict[int, list]) -> set:
    """Variables still needed once the equations in ``replaced`` read only the given inputs."""
    needed = {v for v in jaxpr.outvars if isinstance(v, jx.Var)}
    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        if not eqn.effects and not any(v in needed for v in eqn.outvars):
            continue
        reads = replaced[i] if i in replaced else eqn.invars
        needed.update(v for v in reads if isinstance(v, jx.Var))
    return needed


def keep_effective(jaxpr: jx.Jaxpr, candidates: list[Candidate], report) -> list[Candidate]:
    """Drop candidates whose removed tensor would stay alive (read elsewhere), until none does."""
    accepted = list(candidates)
    while True:
        live = live_vars(jaxpr, {c.index: c.expander.sources for c in accepted})
        stuck = [c for c in accepted if c.removed.var in live]
        if not stuck:
            return [c for c in accepted if any(v in live for v in c.eqn.outvars)]  # others end up dead
        for c in stuck:
            report.skip(c.eqn, c.eqn.primitive.name,
                        f"{aval_str(c.removed.var.aval)} would stay alive: something else reads it")
        accepted = [c for c in accepted if c not in stuck]


class AlgebraicPass(Pass):
    """Match-and-replace: expand sums of broadcast products into einsums over the small tensors.

    Matches ``reduce_sum``/``dot_general`` equations (see the module docstring
    for the covered forms and when each fires); emits ``jnp.einsum`` s
    (``dot_general`` s) over the original small inputs.
    """

    name = "algebraic"
    Options = ExpansionLimits

    def run(self, closed: jx.ClosedJaxpr, config) -> tuple[jx.ClosedJaxpr, PassReport]:
        """Inline calls everywhere, rewrite every level; ``closed`` itself when nothing is rewritten."""
        report = PassReport(self.name)
        try:
            flat = inline_calls_everywhere(closed)
        except Exception as err:  # noqa: BLE001 - then the calls stay closed to the matcher
            report.skip("<unknown>", "pjit", f"could not inline calls ({type(err).__name__}: {err})")
            flat = closed
        new = rewrite_nested(flat, lambda level: self.run_level(level, config, report))
        return (new if report.rewrites else closed), report

    def run_level(self, closed: jx.ClosedJaxpr, config, report) -> jx.ClosedJaxpr:
        jaxpr = closed.jaxpr
        scope = Scope(jaxpr)
        later = self.later_provides(REORDERS_PRODUCTS)
        found = []
        for i, eqn in enumerate(jaxpr.eqns):
            if eqn.primitive.name not in ROOT_PRIMITIVES or not (
                    _touches_large(eqn, config.threshold) or _may_save_exactly(eqn, scope)):
                continue
            try:
                candidate = find_candidate(jaxpr, i, config.threshold, report, later, scope, self.options)
            except Exception as err:  # noqa: BLE001 - never lose the level's other rewrites for one
                report.skip(eqn, eqn.primitive.name,
                            f"could not be analysed ({type(err).__name__}: {err}); left as written")
                continue
            if candidate is not None:
                found.append(candidate)
        candidates = keep_effective(jaxpr, found, report)
        if not candidates:
            return closed
        splitter = self.later_provides(SPLITS_REGIONS)
        for c in candidates:
            try:
                c.written_program, caveat = finite_guard(closed, c, config.threshold, splitter)
            except Exception as err:  # noqa: BLE001 - the rewrite stands, without the guard
                caveat = f"no written program to fall back on for non-finite values ({type(err).__name__}: {err})"
            c.caveat = caveat
        try:
            new = rewrite(closed, [_replacement(c) for c in candidates], name="algebraic")
        except Exception:  # noqa: BLE001 - find the roots whose emission fails; rewrite the others
            errors = {c.index: _emission_error(c) for c in candidates}
            failing = [c for c in candidates if errors[c.index] is not None]
            for c in failing:
                report.skip(_location(jaxpr, c.index, c.expander), c.eqn.primitive.name,
                            f"could not be rewritten ({errors[c.index]}); left as written")
            candidates = keep_effective(jaxpr, [c for c in found if c not in failing], report)
            if not candidates:
                return closed
            new = rewrite(closed, [_replacement(c) for c in candidates], name="algebraic")
        for c in candidates:
            summary = _summary(c) + (f"; Inf/NaN {c.caveat}" if c.caveat else "")
            report.rewrite(c.kind, _location(jaxpr, c.index, c.expander), summary,
                           removed_type=aval_str(c.removed.var.aval),
                           removed_bytes=c.removed.nbytes, terms=len(c.expansion.monomials),
                           clamped=c.clamp, exact=c.exact, centred=bool(c.plan and c.plan.shifts),
                           plain_inf_nan=(c.written_program is not None or same_products(c.expansion, c.output_labels)
                                          or bool(c.plan and c.plan.squares)),
                           exact_diagonal=bool(c.plan and c.plan.diagonal),
                           finite_guard=c.written_program is not None)
        return new


def _replacement(c: Candidate) -> Replacement:
    return Replacement([c.index], list(c.expander.sources), list(c.eqn.outvars), c.build, anchor=c.index)


def _emission_error(c: Candidate) -> str | None:
    """Why emitting ``c`` on its own fails (``None`` if it does not)."""
    try:
        trace_flat(c.build, [v.aval for v in c.expander.sources])
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    return None


def inline_calls_everywhere(closed: jx.ClosedJaxpr) -> jx.ClosedJaxpr:
    """``closed`` with every call (``pjit``, ``custom_jvp``/``custom_vjp``, ``checkpoint``) replaced by
    its body, at every level (loop and cond bodies too); the same object when there is none.

    The passes run after JAX has differentiated the program, so a custom rule's body is the
    computation; inlining lets the matcher read values inside it and see who reads its results.
    """
    return inline_calls(closed, INLINABLE, deep=True, name="algebraic")


#: Producers whose large result an exact rewrite can skip: a broadcast product, a matrix product.
EXACT_PRODUCERS = frozenset({"mul", "dot_general"})
#: What may stand between such a producer and the root (relabelling, selection).
LOOKED_THROUGH = frozenset({"convert_element_type", "transpose", "reshape", "squeeze", "expand_dims", "copy",
                            "select_n", "neg", "broadcast_in_dim"})


def _may_save_exactly(eqn, scope: Scope, depth: int = 4) -> bool:
    """A cheap test for roots that an exact rewrite might improve whatever the threshold: a root
    reading a value larger than its result that a product builds (within ``depth`` relabelling
    steps), or a platform cond (``jnp.diagonal``). The full expansion is linear in the program; this
    keeps the pass from expanding every sum of a long program."""
    if eqn.primitive.name == "cond":
        return bool(eqn.params.get("branches_platforms"))
    result = aval_nbytes(eqn.outvars[0].aval)
    frontier = [a for a in eqn.invars if isinstance(a, jx.Var) and aval_nbytes(a.aval) > result]
    for _ in range(depth):
        following = []
        for atom in frontier:
            found = scope.defining(atom)
            if found is None:
                continue
            name = found[2].primitive.name
            if name in EXACT_PRODUCERS:
                return True
            if name in LOOKED_THROUGH:
                following.extend(a for a in found[2].invars if isinstance(a, jx.Var))
        frontier = following
    return False


def _touches_large(eqn, threshold: int | None) -> bool:
    """Whether a root reads or writes a value over the threshold: a cheap filter for inexact
    rewrites, since one must remove such a value and it is read by the root (or is the root's own
    result); the expansion walk itself is linear in the program, which made the pass quadratic."""
    if threshold is None:
        return True
    values = [v for v in (*eqn.invars, *eqn.outvars) if isinstance(v, jx.Var)]
    return any(aval_nbytes(v.aval) > threshold for v in values)


def _location(jaxpr: jx.Jaxpr, index: int, expander: Expander) -> str:
    """The user's source line: the root's, else that of the latest looked-through equation that has one."""
    indices = [index] + sorted((i.eqn_index for i in expander.internal.values()), reverse=True)
    for i in indices:
        where = source_line(jaxpr.eqns[i])
        if where != "<unknown>":
            return where
    return "<unknown>"


def _named(eqn) -> str:
    """``sqrt at file.py:12 (f)``, or the primitive alone when the line is unknown."""
    where = source_line(eqn)
    return eqn.primitive.name if where == "<unknown>" else f"{eqn.primitive.name} at {where}"


def _summary(c: Candidate) -> str:
    what = c.kind.replace("_", " ")
    return (f"{what}: {c.eqn.primitive.name} -> {aval_str(c.eqn.outvars[0].aval)} no longer builds "
            f"{aval_str(c.removed.var.aval)} ({format_size(c.removed.nbytes)}); "
            f"{len(c.expansion.monomials)} einsum term(s){', clamped at zero' if c.clamp else ''}")
