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

Where it is done: :mod:`.expansion` expands a root into monomials, :mod:`.match` decides which
roots to rewrite and names the rewrite, :mod:`.guards` rules the inexact ones; :class:`AlgebraicPass`
inlines calls, emits the einsums and reports.
"""

from __future__ import annotations

from hlopass import internals as jx

from hlopass.families import INLINABLE
from hlopass.finite import SPLITS_REGIONS
from hlopass.interpreter import Replacement, inline_calls, rewrite, rewrite_nested
from hlopass.jaxpr_utils import aval_str, trace_flat
from hlopass.pass_base import Pass, exported_lazily
from hlopass.report import PassReport
from hlopass.sizes import format_size

from .options import ExpansionLimits

__all__ = ["AlgebraicPass", "Candidate", "REORDERS_PRODUCTS", "ROOT_PRIMITIVES", "classify", "finite_guard",
           "find_candidate", "inline_calls_everywhere", "keep_effective"]
__getattr__ = exported_lazily(__name__, {name: ".match" for name in (
    "Candidate", "classify", "finite_guard", "find_candidate", "keep_effective")})

#: Equations a rewrite may replace (a platform ``cond``: ``jnp.diagonal``).
ROOT_PRIMITIVES = ("reduce_sum", "dot_general", "cond")
#: The capability of a later pass that takes sums of matrix products off this pass's hands.
REORDERS_PRODUCTS = "reorder_products"


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
        from .bounds import RemovalBounds
        from .expansion import Scope
        from .match import (finite_guard, find_candidate, keep_effective, location, may_save_exactly,
                            reported_however, same_products, touches_large)
        jaxpr = closed.jaxpr
        scope = Scope(jaxpr)
        bounds = None
        later = self.later_provides(REORDERS_PRODUCTS)
        found = []
        for i, eqn in enumerate(jaxpr.eqns):
            if eqn.primitive.name not in ROOT_PRIMITIVES or not (
                    touches_large(eqn, config.threshold) or may_save_exactly(eqn, scope)):
                continue
            bounds = bounds or RemovalBounds(jaxpr)
            if not (reported_however(eqn, config.threshold) or bounds.may_remove(eqn)):
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
                report.skip(location(jaxpr, c.index, c.expander), c.eqn.primitive.name,
                            f"could not be rewritten ({errors[c.index]}); left as written")
            candidates = keep_effective(jaxpr, [c for c in found if c not in failing], report)
            if not candidates:
                return closed
            new = rewrite(closed, [_replacement(c) for c in candidates], name="algebraic")
        for c in candidates:
            summary = _summary(c) + (f"; Inf/NaN {c.caveat}" if c.caveat else "")
            report.rewrite(c.kind, location(jaxpr, c.index, c.expander), summary,
                           removed_type=aval_str(c.removed.var.aval),
                           removed_bytes=c.removed.nbytes, terms=len(c.expansion.monomials), visits=c.expander.visits,
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
    return inline_calls(closed, INLINABLE, deep=True)



def _summary(c: Candidate) -> str:
    what = c.kind.replace("_", " ")
    return (f"{what}: {c.eqn.primitive.name} -> {aval_str(c.eqn.outvars[0].aval)} no longer builds "
            f"{aval_str(c.removed.var.aval)} ({format_size(c.removed.nbytes)}); "
            f"{len(c.expansion.monomials)} einsum term(s){', clamped at zero' if c.clamp else ''}")
