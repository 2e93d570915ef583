"""The algebraic pass's matcher: which roots an expansion may replace, and how.

:func:`find_candidate` expands one root (a ``reduce_sum`` or ``dot_general``) through
:mod:`.expansion`, names the rewrite (:func:`classify`: a contraction, a diagonal, trace or sum of a
product, a squared distance, an expanded product), checks that it removes a value larger than what
it reads and writes, leaves plain sums of products to a later pass that reorders them, and puts an
inexact expansion under the rules of :mod:`.guards`. :func:`keep_effective` drops the candidates
whose removed value something else keeps alive; :func:`finite_guard` gives each the written program
to fall back on where its value is not finite. :func:`may_save_exactly` and :func:`touches_large`
are the cheap filters that keep the expansion off roots that cannot gain.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import jax.numpy as jnp
from hlopass import internals as jx

from hlopass.families import CHAIN, LAYOUT
from hlopass.finite import EMPTY_AXIS, finite_or_written, has_empty_axis, why_unguarded
from hlopass.interpreter import written_between
from hlopass.jaxpr_utils import aval_nbytes, aval_str
from hlopass.report import source_line

from . import guards
from .expansion import (EXPANSION_RULES, Expander, Expansion, ExpansionLimits, Internal, NoMatch, Scope, unify,
                        check_emittable, emit)


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
            total = guards.emit_planned(self.plan, self.expansion, list(values), self.output_labels,
                                        self.expander.label_sizes, tuple(out.shape), out.dtype)
        else:
            total = emit(self.expansion, list(values), self.output_labels, self.expander.label_sizes,
                         tuple(out.shape), out.dtype, clamp_at_zero=self.clamp)
        if len(self.expansion.monomials) > 1 and not self.clamp:
            total = positive_zero(total)
        return [total]



def positive_zero(total):
    """``total`` with every zero made ``+0``.

    The written sum is ``-0`` only where every summand is (IEEE addition of a ``+0``, or of values
    that cancel, gives ``+0`` in any order), which a sum over many products almost never is; a sum
    of several einsum terms (``0·a − 0·b``) is ``-0`` where its first term is ``-0`` and the
    others ``+0``. They compare equal, but XLA's ``top_k`` ranks ``-0`` below ``+0``, and a
    gradient through it then follows another of the tied entries (fresh seed s802314916978).
    """
    return jnp.where(total == 0, jnp.zeros((), total.dtype), total)



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



#: Primitives of a plain chain of products and sums (what the matrix-chain pass reorders): its links but
#: ``mul`` and ``broadcast_in_dim``, which it takes only by a scalar and to add axes of size 1, where here
#: they are a broadcast product.
CHAIN_PRIMITIVES = CHAIN - {"mul", "broadcast_in_dim"}



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
            report.skip(location(jaxpr, index, expander), eqn.primitive.name, str(reason))
        return None
    worth_telling = _is_large(eqn, threshold) and (expander.notes or _reads_computed_operand_sized(expander, eqn))
    kept = max([aval_nbytes(out.aval)] + [aval_nbytes(v.aval) for v in expander.sources])
    internal = list(expander.internal.values())
    if not internal:
        if worth_telling:
            report.skip(location(jaxpr, index, expander), eqn.primitive.name, _why_not(expander))
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
            report.skip(location(jaxpr, index, expander), eqn.primitive.name, reason)
        return None
    if kind == "sum_of_product" and products_reordered_by:
        if threshold is None or removed.nbytes > threshold:
            report.skip(location(jaxpr, index, expander), eqn.primitive.name,
                        f"a sum of a matrix product: left to the {products_reordered_by} pass, which reorders products")
        return None
    if has_empty_axis(v.aval for v in expander.sources):
        report.skip(location(jaxpr, index, expander), eqn.primitive.name,
                    f"the {kind.replace('_', ' ')}: {EMPTY_AXIS}")
        return None
    candidate = Candidate(index, eqn, expander, expansion, labels, removed, kind, written)
    if expansion.exact:
        return candidate
    what = kind.replace("_", " ")
    if np.dtype(out.aval.dtype).itemsize < 4:
        report.skip(location(jaxpr, index, expander), eqn.primitive.name,
                    f"the {what} in {np.dtype(out.aval.dtype).name}: expanded, it would cancel and overflow")
        return None
    sensitive = guards.zero_sensitive_use(jaxpr, out)
    if sensitive is not None:
        use, description = sensitive
        report.skip(location(jaxpr, index, expander), eqn.primitive.name,
                    f"the {what} feeds {description} ({_named(use)}): its expanded "
                    "form is not exactly zero for equal points, so that use is sensitive to it")
        return None
    plan = guards.plan(written, expansion, expander, labels, squared=expansion.depth == 2)
    if isinstance(plan, str):
        report.skip(location(jaxpr, index, expander), eqn.primitive.name,
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



def reported_however(eqn, threshold) -> bool:
    """Whether :func:`find_candidate` may name root ``eqn`` in the report even where its expansion
    removes nothing (a sum of a tensor larger than its result and than the threshold)."""
    return _is_large(eqn, threshold)



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



#: Producers whose large result an exact rewrite can skip: a broadcast product, a matrix product.
EXACT_PRODUCERS = frozenset({"mul", "dot_general"})
#: What may stand between such a producer and the root (relabelling, selection).
LOOKED_THROUGH = LAYOUT | {"select_n", "neg"}


def may_save_exactly(eqn, scope: Scope, depth: int = 4) -> bool:
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



def touches_large(eqn, threshold: int | None) -> bool:
    """Whether a root reads or writes a value over the threshold: a cheap filter for inexact
    rewrites, since one must remove such a value and it is read by the root (or is the root's own
    result); the expansion walk itself is linear in the program, which made the pass quadratic."""
    if threshold is None:
        return True
    values = [v for v in (*eqn.invars, *eqn.outvars) if isinstance(v, jx.Var)]
    return any(aval_nbytes(v.aval) > threshold for v in values)



def location(jaxpr: jx.Jaxpr, index: int, expander: Expander) -> str:
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
