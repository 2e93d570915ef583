"""Matching algebra in jaxprs by normalisation: einsum polynomials over small tensors.

Every spelling of a squared distance, a broadcast product or a trace is the
same polynomial once written with explicit indices::

    Σ_d (x[n,d] − y[m,d])²   =   Σ_d x[n,d]² − 2 Σ_d x[n,d] y[m,d] + Σ_d y[m,d]²

So instead of listing spellings, :class:`Expander` walks backwards from a
value and rewrites it into an :class:`Expansion`: a sum of :class:`Monomial`
s, each a coefficient times a product of *factors* (small tensors read from
the jaxpr, indexed by integer labels), Kronecker deltas between labels, and
a set of labels summed over. Broadcasts, reshapes that add or drop unit axes,
transposes and ``convert_element_type`` only relabel; ``add``/``sub``/``neg``
/``mul``/``div`` by a monomial, ``integer_pow``/``square``/``pow(·, 2.0)``
are polynomial arithmetic (so commutativity and the operand order of a
subtraction under a square disappear); ``reduce_sum`` and ``dot_general``
add summed labels; an identity mask (``iota == iota``, as ``jnp.eye``,
``jnp.trace`` and ``jnp.diagonal`` build it) is a delta. ``pjit``,
``custom_jvp_call``/``custom_vjp_call`` and platform-dependent ``cond`` s are
entered (the passes run after JAX has differentiated the program, so custom
derivative rules no longer matter). Anything else (``abs``, ``exp``,
``max``...) is a *leaf*: an opaque factor with the shape it has.

Per-primitive knowledge lives in the ``EXPANSION_RULES`` table; a new identity is one
small function registered with :func:`rule`. A rewrite then reads the
expansion (:class:`Expansion`) and emits it with :func:`emit`, one
``jnp.einsum`` per monomial, none of which materialises the broadcast
product.

``Expansion.depth`` counts how many sums were multiplied together: 1 for
``g·(x − y)``, 2 for ``(x − y)²``. Expansions deeper than 2 (a cube of a
difference) are refused: expanding them cancels catastrophically.
``Expansion.exact`` says that no product or sum was distributed over a sum:
the expansion computes the same products as the written code and only sums
them in another order (a contraction, a diagonal or trace of a product); an
inexact one (a squared distance) cancels and is used only where
:mod:`.guards` allows it.

A difference of two tensors that differ only in one factor (``x[:,None] −
y[None]``, ``x/ℓ − y/ℓ``) is kept as one :class:`Difference` factor while
walking (the *written* form, which :mod:`.guards` reads: which sources enter
only through differences, whether the value is a square of them); and
:meth:`Expander.substitute` multiplies it out into the expansion that is
emitted.

A ``where``/``select`` is expanded only when its predicate is an identity
mask and its other case is zero: the selection keeps reading only the
selected values. A data-dependent ``where`` is a leaf: expanding it into
``f + mask·(t − f)`` would read the values it drops (an Inf or NaN it guards
would come back). A product with an identity mask (``jnp.eye(n) * M``) is a
selection too: XLA itself simplifies it to one (``jax.jit`` gives the
diagonal's value where eager JAX gives 0·Inf = NaN for an Inf off the
diagonal), so the rewrite matches ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, NamedTuple

import numpy as np
import opt_einsum
import jax.numpy as jnp
from jax import lax
from hlopass import internals as jx

from hlopass.einsum_order import einsum_order
from hlopass.families import INLINABLE, dot_general_operand_labels
from hlopass.jaxpr_utils import aval_nbytes

from .options import ExpansionLimits

#: The most sums multiplied together that an expansion may hold (2: a square). Not a tuning
#: knob: deeper expansions cancel catastrophically.
MAX_DEPTH = 2


class NoMatch(Exception):
    """The value cannot be expanded; the message says why (it ends up in the pass report)."""


# --------------------------------------------------------------------------------------------
# Polynomials over indexed factors
# --------------------------------------------------------------------------------------------

class Factor(NamedTuple):
    """``source`` (an index into :attr:`Expander.sources`) raised to ``power``.

    ``labels`` has one entry per axis of the source: an index label, or
    ``None`` for an axis of size 1 (squeezed away when emitted). (Factors and monomials are named
    tuples, not dataclasses: an expansion builds thousands, and tuples are several times faster to
    make, compare and hash.)
    """

    source: int
    labels: tuple
    power: int = 1


class Monomial(NamedTuple):
    """``coeff · Π factors · Π δ(a, b)``, summed over the labels in ``summed``."""

    coeff: float
    factors: tuple[Factor, ...] = ()
    deltas: tuple[tuple[int, int], ...] = ()
    summed: frozenset = frozenset()

    @property
    def key(self):
        return self.factors, self.deltas, self.summed


@dataclasses.dataclass(frozen=True)
class Expansion:
    """A sum of monomials; ``depth`` = sums multiplied together, ``nonneg`` = a sum of even powers,
    ``exact`` = nothing was distributed over a sum (the same products, summed in another order),
    ``spread`` = a sum other than a :class:`Difference` factor was multiplied out."""

    monomials: tuple[Monomial, ...]
    depth: int = 0
    nonneg: bool = False
    exact: bool = True
    spread: bool = False

    @property
    def is_monomial(self) -> bool:
        return len(self.monomials) == 1 and self.depth == 0


def constant(value: float) -> Expansion:
    """The constant ``value`` (the empty sum when it is zero)."""
    return Expansion((Monomial(float(value)),) if value != 0 else (), 0, value >= 0)


def constant_value(a: Expansion) -> float | None:
    """The value of a constant expansion (``sub 2.0 1.0``, say), else ``None``."""
    if not a.monomials:
        return 0.0
    if len(a.monomials) == 1 and not a.monomials[0].factors and not a.monomials[0].deltas \
            and not a.monomials[0].summed:
        return a.monomials[0].coeff
    return None


def _merge_factors(factors) -> tuple[Factor, ...]:
    powers: dict[tuple, int] = {}
    for f in factors:
        powers[(f.source, f.labels)] = powers.get((f.source, f.labels), 0) + f.power
    return tuple(sorted(Factor(s, labels, p) for (s, labels), p in powers.items() if p != 0))


def _collect(monomials) -> tuple[Monomial, ...]:
    """Combine like monomials, drop zeros, refuse blow-ups."""
    coeffs: dict[tuple, float] = {}
    for m in monomials:
        coeffs[m.key] = coeffs.get(m.key, 0.0) + m.coeff
    return tuple(Monomial(c, *key) for key, c in coeffs.items() if c != 0)


def add(a: Expansion, b: Expansion, sign: float = 1.0) -> Expansion:
    """``a + sign·b``."""
    monomials = _collect(a.monomials + tuple(m._replace(coeff=sign * m.coeff) for m in b.monomials))
    depth = max(a.depth, b.depth, 1 if len(monomials) > 1 else 0)
    return Expansion(monomials, depth, a.nonneg and b.nonneg and sign > 0, a.exact and b.exact,
                     a.spread or b.spread)


def scale(a: Expansion, c: float) -> Expansion:
    """``c·a``."""
    return Expansion(_collect(m._replace(coeff=c * m.coeff) for m in a.monomials),
                     a.depth, a.nonneg and c >= 0, a.exact, a.spread)


def is_mask(a: Expansion) -> bool:
    """Whether ``a`` is an identity mask: Kronecker deltas without factors (``iota == iota``)."""
    return bool(a.monomials) and all(not m.factors and not m.summed and abs(m.coeff) == 1 for m in a.monomials) \
        and any(m.deltas for m in a.monomials)


def _plain(e: Expansion) -> bool:
    return is_mask(e) or (constant_value(e) is not None and abs(constant_value(e)) == 1)


def _distributes(a: Expansion, b: Expansion) -> bool:
    """Whether ``a·b`` multiplies a sum (a difference factor too) by something other than ±1 or a
    mask (a selection)."""
    return (a.depth > 0 and not _plain(b)) or (b.depth > 0 and not _plain(a))


def _spreads(a: Expansion, b: Expansion) -> bool:
    """Whether ``a·b`` multiplies out a sum of several monomials."""
    return (len(a.monomials) > 1 and not _plain(b)) or (len(b.monomials) > 1 and not _plain(a))


def multiply(a: Expansion, b: Expansion, square: bool = False) -> Expansion:
    """``a·b`` expanded; ``square`` says ``b`` is ``a`` again (the product is non-negative)."""
    depth = a.depth + b.depth
    if depth > MAX_DEPTH:
        raise NoMatch(f"a product of {depth} sums (e.g. a cube of a difference) would cancel catastrophically")
    products = (Monomial(x.coeff * y.coeff, _merge_factors(x.factors + y.factors),
                         tuple(sorted(x.deltas + y.deltas)), x.summed | y.summed)
                for x, y in itertools.product(a.monomials, b.monomials))
    return Expansion(_collect(products), depth, square or (a.nonneg and b.nonneg),
                     a.exact and b.exact and not _distributes(a, b), a.spread or b.spread or _spreads(a, b))


def sum_over(a: Expansion, labels) -> Expansion:
    """``Σ_labels a``."""
    extra = frozenset(label for label in labels if label is not None)
    return Expansion(_collect(m._replace(summed=m.summed | extra) for m in a.monomials),
                     a.depth, a.nonneg, a.exact and (a.depth == 0 or not extra), a.spread)


def reciprocal(a: Expansion) -> Expansion:
    """``1/a`` for a single monomial without sums or deltas."""
    if not a.is_monomial or any(is_difference(f) for m in a.monomials for f in m.factors):
        raise NoMatch("division by a sum is not a polynomial")
    (m,) = a.monomials
    if m.deltas or m.summed:
        raise NoMatch("division by a reduction or a mask is not a polynomial")
    factors = tuple(f._replace(power=-f.power) for f in m.factors)
    return Expansion((Monomial(1.0 / m.coeff, factors),), 0, a.nonneg, a.exact, a.spread)


# --------------------------------------------------------------------------------------------
# Differences: kept whole while walking, multiplied out when emitted
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Difference:
    """``a[a_labels] − b[b_labels]``: two sources (indices into :attr:`Expander.sources`) subtracted
    elementwise, as in ``x[:, None] − y[None]``. A :class:`Factor` whose ``source`` is negative,
    ``-(k + 1)``, stands for difference ``k`` of :attr:`Expander.differences`, its ``labels`` being
    :attr:`labels`."""

    a: int
    a_labels: tuple
    b: int
    b_labels: tuple

    @property
    def labels(self) -> tuple:
        """Every label of the difference: ``a`` 's, then those only ``b`` has."""
        own = tuple(lab for lab in self.a_labels if lab is not None)
        return own + tuple(lab for lab in self.b_labels if lab is not None and lab not in own)

    @property
    def shared(self) -> frozenset:
        """Labels both sides carry (the feature axes, batch axes)."""
        return (frozenset(self.a_labels) & frozenset(self.b_labels)) - {None}

    def expansion(self) -> Expansion:
        """``a − b`` as two monomials."""
        return Expansion((Monomial(1.0, (Factor(self.a, self.a_labels),)),
                          Monomial(-1.0, (Factor(self.b, self.b_labels),))), 1, False)


def _order_key(factor: Factor) -> tuple:
    return factor.source, tuple(-1 if lab is None else lab for lab in factor.labels)


def is_difference(factor: Factor) -> bool:
    return factor.source < 0


def difference_index(factor: Factor) -> int:
    return -factor.source - 1


# --------------------------------------------------------------------------------------------
# Scopes: seeing through call-like equations
# --------------------------------------------------------------------------------------------

class Scope:
    """One jaxpr level: who defines each variable, and what its inputs are bound to outside."""

    def __init__(self, jaxpr: jx.Jaxpr, parent: "Scope | None" = None, bindings=None, consts=()):
        self.jaxpr = jaxpr
        self.parent = parent
        self.bindings: dict[jx.Var, tuple[Any, Scope]] = dict(bindings or {})
        self.producer: dict[jx.Var, tuple[int, int]] = {}
        for i, eqn in enumerate(jaxpr.eqns):
            for k, var in enumerate(eqn.outvars):
                self.producer[var] = (i, k)
        self.consts = dict(zip(jaxpr.constvars, consts)) if parent is not None else {}
        #: top-level values whose expansion failed, shared by the expanders of a level (:class:`Failure`)
        self.failures: dict[tuple, Failure] = {}

    @property
    def is_top(self) -> bool:
        return self.parent is None

    def resolve(self, atom) -> tuple[Any, "Scope"]:
        """Follow sub-jaxpr inputs out to the atom that feeds them."""
        scope = self
        while isinstance(atom, jx.Var) and atom in scope.bindings:
            atom, scope = scope.bindings[atom]
        return atom, scope

    def defining(self, atom):
        """``(index, output position, eqn)`` of the equation defining ``atom``, or ``None``."""
        found = self.producer.get(atom) if isinstance(atom, jx.Var) else None
        if found is None:
            return None
        return found[0], found[1], self.jaxpr.eqns[found[0]]


def _body(eqn: jx.JaxprEqn):
    """The sub-jaxpr a call-like equation runs on its inputs (and how many leading inputs it skips)."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        body = eqn.params.get(key)
        if isinstance(body, jx.ClosedJaxpr):
            return body.jaxpr, body.consts
        if isinstance(body, jx.Jaxpr):
            return body, ()
    return None


# --------------------------------------------------------------------------------------------
# The expander and its per-primitive rules
# --------------------------------------------------------------------------------------------

Rule = Callable[["Expander", jx.JaxprEqn, Scope, int, tuple], Expansion]
EXPANSION_RULES: dict[str, Rule] = {}


def rule(*names: str):
    """Register an expansion rule for primitives ``names``: ``fn(expander, eqn, scope, out_index, labels)``."""
    def register(fn: Rule) -> Rule:
        for name in names:
            EXPANSION_RULES[name] = fn
        return fn
    return register


@dataclasses.dataclass(frozen=True)
class Failure:
    """What one failed attempt at expanding a top-level value did, to be replayed instead of redone.

    Expanding a value is a function of the value, the pattern of its labels (which axes are
    unlabelled, which share a label) and the limits, as long as the visit budget is not what stopped
    it; the roots of one level share most of what they read (a backward pass adds each cotangent
    into many), so the same attempts recur: 38 roots of a Transformer training step made 13,633.
    """

    visits: int                 # the visits the attempt spent
    labels: int                 # the fresh labels it drew
    notes: tuple[str, ...]      # why it (and the values under it) became leaves
    sources: tuple              # the leaves it read, in order (they stay sources, as they did)
    hidden: bool                # whether it met a value hidden inside a call


def _label_pattern(labels: tuple) -> tuple:
    """``labels`` up to renaming: ``None`` stays, each label becomes the position of its first use."""
    first: dict = {}
    return tuple(None if lab is None else first.setdefault(lab, k) for k, lab in enumerate(labels))


@dataclasses.dataclass
class Internal:
    """A value the expansion looks through (it disappears if nothing else reads it)."""

    var: jx.Var
    eqn_index: int
    nbytes: int
    primitive: str


class Expander:
    """Expands values of one jaxpr level (the *top* scope) into :class:`Expansion` s.

    ``sources`` are the top-level variables the factors read; ``label_sizes``
    maps every label to its extent; ``internal`` lists the top-level values
    looked through; ``notes`` says why sub-expressions became leaves;
    ``differences`` are the :class:`Difference` s the written form keeps whole;
    ``hidden`` says that some value could not be read because it lives inside a
    call's body (inlining the call would show it).
    """

    def __init__(self, jaxpr: jx.Jaxpr, top: Scope | None = None, limits: ExpansionLimits = ExpansionLimits()):
        self.top = top if top is not None else Scope(jaxpr)  # share one Scope across expanders of a level
        self.limits = limits
        self.sources: list[jx.Var] = []
        self._source_index: dict[jx.Var, int] = {}
        self.label_sizes: dict[int, int] = {}
        self.internal: dict[jx.Var, Internal] = {}
        self.notes: list[str] = []
        self.differences: list[Difference] = []
        self._difference_index: dict[Difference, int] = {}
        self.hidden = False
        self._next_label = 0
        self._visits = 0
        self._limit_hits = 0

    @property
    def visits(self) -> int:
        """Equations this expansion has visited so far (replayed failures counted), against ``limits.max_visits``."""
        return self._visits

    # -- the written form and the expanded one -------------------------------------------------
    def difference(self, a: Expansion, b: Expansion, sign: float) -> Expansion | None:
        """``a + sign·b`` as one :class:`Difference` factor when ``a = α·F·x`` and ``b = β·F·y``
        differ in one source factor ``x``/``y`` and ``α + sign·β = 0``; else ``None``."""
        if len(a.monomials) != 1 or len(b.monomials) != 1 or a.depth or b.depth:
            return None
        (ma,), (mb,) = a.monomials, b.monomials
        if ma.deltas or mb.deltas or ma.summed or mb.summed or ma.coeff + sign * mb.coeff != 0:
            return None
        for fa in ma.factors:
            for fb in mb.factors:
                if fa.power != 1 or fb.power != 1 or is_difference(fa) or is_difference(fb) or fa == fb:
                    continue
                rest_a, rest_b = list(ma.factors), list(mb.factors)
                rest_a.remove(fa)
                rest_b.remove(fb)
                if rest_a != rest_b:
                    continue
                coeff = ma.coeff
                if _order_key(fb) < _order_key(fa):  # one spelling per difference
                    fa, fb, coeff = fb, fa, -coeff
                diff = Difference(fa.source, fa.labels, fb.source, fb.labels)
                k = self._difference_index.setdefault(diff, len(self.differences))
                if k == len(self.differences):
                    self.differences.append(diff)
                factor = Factor(-(k + 1), diff.labels)
                return Expansion((Monomial(coeff, _merge_factors(tuple(rest_a) + (factor,))),), 1, False,
                                 a.exact and b.exact, a.spread or b.spread)
        return None

    def substitute(self, written: Expansion) -> Expansion:
        """The written form with every :class:`Difference` multiplied out: what is emitted."""
        if not any(is_difference(f) for m in written.monomials for f in m.factors):
            return written
        total = Expansion(())
        for m in written.monomials:
            plain = tuple(f for f in m.factors if not is_difference(f))
            term = Expansion((Monomial(m.coeff, plain, m.deltas, m.summed),))
            for f in m.factors:
                if is_difference(f):
                    for _ in range(f.power):
                        term = multiply(term, self.differences[difference_index(f)].expansion())
            total = add(total, term)
        if len(total.monomials) > self.limits.max_terms:
            raise NoMatch(f"expansion has more than {self.limits.max_terms} terms")
        return Expansion(total.monomials, written.depth, written.nonneg, False, True)

    def fresh(self, size: int) -> int | None:
        """A new label of extent ``size`` (``None`` for size 1)."""
        if size == 1:
            return None
        label = self._next_label
        self._next_label += 1
        self.label_sizes[label] = size
        return label

    def fresh_labels(self, shape) -> tuple:
        return tuple(self.fresh(int(s)) for s in shape)

    # -- the walk ------------------------------------------------------------------------------
    def expand(self, atom, scope: Scope, labels: tuple) -> Expansion:
        """Expansion of ``atom`` (in ``scope``) with its axes indexed by ``labels``."""
        atom, scope = scope.resolve(atom)
        if isinstance(atom, jx.Literal):
            return self._literal(atom.val)
        if atom in scope.consts:
            return self._literal(scope.consts[atom])
        key = (atom, _label_pattern(labels), self.limits) if scope.is_top else None
        failure = scope.failures.get(key) if key is not None else None
        if failure is not None and self._visits + failure.visits <= self.limits.max_visits:
            return self._replay(failure, atom, scope, labels)
        before = (self._visits, self._next_label, len(self.notes), len(self.sources), self._limit_hits)
        self._visits += 1
        if self._visits > self.limits.max_visits:
            self._limit_hits += 1
            raise NoMatch("expression too large to expand")
        found = scope.defining(atom)
        if found is not None:
            index, position, eqn = found
            fn = EXPANSION_RULES.get(eqn.primitive.name)
            if fn is not None:
                looked_through = set(self.internal)
                hidden = self.hidden
                self.hidden = False
                try:
                    result = fn(self, eqn, scope, position, labels)
                    if len(result.monomials) > self.limits.max_terms:
                        raise NoMatch(f"expansion has more than {self.limits.max_terms} terms")
                    if scope.is_top and len(result.monomials) > 1 and self._reads_full_size(result, labels):
                        raise NoMatch("a sum whose every term reads a tensor of its own size: nothing to expand")
                except NoMatch as reason:
                    if not scope.is_top:
                        raise
                    self.notes.append(f"{eqn.primitive.name}: {reason}")
                    for var in set(self.internal) - looked_through:  # the value below is a leaf after all
                        del self.internal[var]
                    visits, next_label, notes, sources, limit_hits = before
                    if self._limit_hits == limit_hits:  # not the budget's doing: the same next time
                        scope.failures[key] = Failure(self._visits - visits, self._next_label - next_label,
                                                      tuple(self.notes[notes:]), tuple(self.sources[sources:]),
                                                      self.hidden)
                else:
                    if scope.is_top:
                        self.internal.setdefault(atom, Internal(atom, index, aval_nbytes(atom.aval), eqn.primitive.name))
                    return result
                finally:
                    self.hidden = self.hidden or hidden
        return self._leaf(atom, scope, labels)

    def _replay(self, failure: Failure, atom, scope: Scope, labels: tuple) -> Expansion:
        """The leaf a failed expansion of ``atom`` ends in, with the attempt's traces, not redone."""
        self._visits += failure.visits
        self._next_label += failure.labels
        self.notes.extend(failure.notes)
        self.hidden = self.hidden or failure.hidden
        for source in failure.sources:
            if source not in self._source_index:
                self._source_index[source] = len(self.sources)
                self.sources.append(source)
        return self._leaf(atom, scope, labels)

    def _reads_full_size(self, e: Expansion, labels: tuple) -> bool:
        """Whether every monomial of ``e`` (the value at ``labels``) has a factor indexed by all of
        ``labels``: then the value is no smaller than what its expansion reads, and expanding it
        only distributes (a leaf is as good and exact)."""
        own = {lab for lab in labels if lab is not None}

        def full(f: Factor) -> bool:
            if is_difference(f):
                d = self.differences[difference_index(f)]
                return own <= set(d.a_labels) or own <= set(d.b_labels)
            return own <= set(f.labels)

        return bool(own) and all(any(full(f) for f in m.factors) for m in e.monomials)

    def operand(self, eqn, scope, k: int, labels: tuple) -> Expansion:
        """Expansion of ``eqn.invars[k]`` for an elementwise ``eqn`` whose output axes carry ``labels``.

        Operands of lower rank are scalars; axes of size 1 against a larger
        output are implicit broadcasts and get no label.
        """
        atom = eqn.invars[k]
        shape = tuple(atom.aval.shape)
        out_shape = tuple(eqn.outvars[0].aval.shape)
        if not shape:
            return self.expand(atom, scope, ())
        if len(shape) != len(out_shape):
            raise NoMatch(f"{eqn.primitive.name} with operands of different ranks")
        return self.expand(atom, scope, tuple(lab if s == o else None for lab, s, o in zip(labels, shape, out_shape)))

    def _literal(self, value) -> Expansion:
        array = np.asarray(value)
        if array.ndim == 0 and array.dtype.kind in "biuf":
            return constant(float(array))
        if array.size and np.all(array == array.flat[0]) and array.dtype.kind in "biuf":
            return constant(float(array.flat[0]))
        raise NoMatch("non-uniform constant array")

    def _leaf(self, atom, scope: Scope, labels: tuple) -> Expansion:
        if not scope.is_top:
            self.hidden = True
            raise NoMatch(f"a value inside a sub-jaxpr ({atom.aval.str_short()}) is not readable outside it")
        if atom not in self._source_index:
            self._source_index[atom] = len(self.sources)
            self.sources.append(atom)
        labels = tuple(lab if int(s) != 1 else None for lab, s in zip(labels, atom.aval.shape))
        return Expansion((Monomial(1.0, (Factor(self._source_index[atom], labels),)),), 0, False)


# -- relabelling ------------------------------------------------------------------------------

@rule("convert_element_type")
def _convert(ex, eqn, scope, _k, labels):
    """A cast to a real floating type keeps the value (booleans become a 0/1 mask); the einsums
    compute in the result's type."""
    source, target = np.dtype(eqn.invars[0].aval.dtype), np.dtype(eqn.params["new_dtype"])
    if target.kind != "f" or source.kind not in "biuf":
        raise NoMatch(f"conversion from {source} to {target} is not a real-number identity")
    return ex.expand(eqn.invars[0], scope, labels)


@rule("copy")
def _identity(ex, eqn, scope, _k, labels):
    return ex.expand(eqn.invars[0], scope, labels)


@rule("broadcast_in_dim")
def _broadcast(ex, eqn, scope, _k, labels):
    (operand,) = eqn.invars[:1]
    out_shape = eqn.params["shape"]
    in_labels = tuple(labels[d] if int(s) == int(out_shape[d]) else None
                      for s, d in zip(operand.aval.shape, eqn.params["broadcast_dimensions"]))
    return ex.expand(operand, scope, in_labels)


@rule("transpose")
def _transpose(ex, eqn, scope, _k, labels):
    in_labels = [None] * len(labels)
    for out_axis, in_axis in enumerate(eqn.params["permutation"]):
        in_labels[in_axis] = labels[out_axis]
    return ex.expand(eqn.invars[0], scope, tuple(in_labels))


@rule("reshape", "squeeze")
def _unit_reshape(ex, eqn, scope, _k, labels):
    """Reshapes that only add or drop axes of size 1."""
    operand = eqn.invars[0]
    in_shape, out_shape = tuple(operand.aval.shape), tuple(eqn.outvars[0].aval.shape)
    if eqn.params.get("dimensions") not in (None, ()) and eqn.primitive.name == "reshape":
        raise NoMatch("reshape with a dimension order")
    kept_out = [lab for lab, s in zip(labels, out_shape) if int(s) != 1]
    if [int(s) for s in in_shape if int(s) != 1] != [int(s) for s in out_shape if int(s) != 1]:
        raise NoMatch("reshape that merges or splits axes")
    it = iter(kept_out)
    return ex.expand(operand, scope, tuple(next(it) if int(s) != 1 else None for s in in_shape))


# -- arithmetic -------------------------------------------------------------------------------

def _sum_of_two(ex, eqn, scope, labels, sign: float) -> Expansion:
    a, b = ex.operand(eqn, scope, 0, labels), ex.operand(eqn, scope, 1, labels)
    found = ex.difference(a, b, sign)
    return found if found is not None else add(a, b, sign)


@rule("add", "add_any")
def _add(ex, eqn, scope, _k, labels):
    return _sum_of_two(ex, eqn, scope, labels, 1.0)


@rule("sub")
def _sub(ex, eqn, scope, _k, labels):
    return _sum_of_two(ex, eqn, scope, labels, -1.0)


@rule("neg")
def _neg(ex, eqn, scope, _k, labels):
    return scale(ex.operand(eqn, scope, 0, labels), -1.0)


@rule("mul")
def _mul(ex, eqn, scope, _k, labels):
    same = scope.resolve(eqn.invars[0]) == scope.resolve(eqn.invars[1])
    return multiply(ex.operand(eqn, scope, 0, labels), ex.operand(eqn, scope, 1, labels), square=same)


@rule("div")
def _div(ex, eqn, scope, _k, labels):
    return multiply(ex.operand(eqn, scope, 0, labels), reciprocal(ex.operand(eqn, scope, 1, labels)))


def _power(ex, eqn, scope, labels, y: int) -> Expansion:
    if y == 0:
        return constant(1.0)
    if y < 0:
        return reciprocal(_power(ex, eqn, scope, labels, -y))
    result = ex.operand(eqn, scope, 0, labels)
    for _ in range(y - 1):  # expand each copy afresh: summed labels must not be shared
        result = multiply(result, ex.operand(eqn, scope, 0, labels))
    return dataclasses.replace(result, nonneg=result.nonneg or y % 2 == 0)


@rule("integer_pow")
def _integer_pow(ex, eqn, scope, _k, labels):
    return _power(ex, eqn, scope, labels, int(eqn.params["y"]))


@rule("square")
def _square(ex, eqn, scope, _k, labels):
    return _power(ex, eqn, scope, labels, 2)


@rule("pow")
def _pow(ex, eqn, scope, _k, labels):
    value = constant_value(ex.operand(eqn, scope, 1, labels))
    if value is None or value != round(value) or abs(value) > 4:
        raise NoMatch("pow with an exponent that is not a small integer constant")
    return _power(ex, eqn, scope, labels, int(round(value)))


# -- sums and contractions --------------------------------------------------------------------

@rule("reduce_sum")
def _reduce_sum(ex, eqn, scope, _k, labels):
    operand = eqn.invars[0]
    axes = set(int(a) for a in eqn.params["axes"])
    it = iter(labels)
    in_labels = tuple(ex.fresh(int(s)) if i in axes else next(it) for i, s in enumerate(operand.aval.shape))
    return sum_over(ex.expand(operand, scope, in_labels), [in_labels[a] for a in axes])


def dot_general_labels(ex: Expander, eqn, labels: tuple) -> tuple[tuple, tuple, list]:
    """Labels of a ``dot_general`` 's two operands given its output's, and the contracted labels."""
    lhs, rhs, contracted = dot_general_operand_labels(
        eqn.params["dimension_numbers"], eqn.invars[0].aval.shape, eqn.invars[1].aval.shape, labels, ex.fresh)
    return tuple(lhs), tuple(rhs), contracted


@rule("dot_general")
def _dot_general(ex, eqn, scope, _k, labels):
    lhs, rhs, contracted = dot_general_labels(ex, eqn, labels)
    product = multiply(ex.expand(eqn.invars[0], scope, lhs), ex.expand(eqn.invars[1], scope, rhs))
    return sum_over(product, contracted)


# -- masks ------------------------------------------------------------------------------------

def _iota_axis(atom, scope: Scope, shape) -> tuple[int, float] | None:
    """``(axis, offset)`` when ``atom`` is ``iota(axis) + offset`` of the given shape."""
    atom, scope = scope.resolve(atom)
    found = scope.defining(atom)
    if found is None:
        return None
    _, _, eqn = found
    if eqn.primitive.name == "iota" and tuple(eqn.params["shape"]) == tuple(shape):
        return int(eqn.params["dimension"]), 0.0
    if eqn.primitive.name in ("add", "sub"):
        for k in (0, 1):
            other, _ = scope.resolve(eqn.invars[1 - k])
            if isinstance(other, jx.Literal) and np.asarray(other.val).ndim == 0:
                inner = _iota_axis(eqn.invars[k], scope, shape)
                if inner is not None and (k == 0 or eqn.primitive.name == "add"):
                    sign = -1.0 if eqn.primitive.name == "sub" else 1.0
                    return inner[0], inner[1] + sign * float(np.asarray(other.val))
    return None


@rule("eq")
def _eq(ex, eqn, scope, _k, labels):
    """``iota(a) == iota(b)``: the identity mask δ(a, b)."""
    shape = eqn.outvars[0].aval.shape
    left, right = (_iota_axis(v, scope, shape) for v in eqn.invars)
    if left is None or right is None or left[0] == right[0] or left[1] != right[1]:
        raise NoMatch("a comparison that is not an identity mask")
    a, b = labels[left[0]], labels[right[0]]
    if a is None or b is None:
        return constant(1.0)
    return Expansion((Monomial(1.0, (), ((min(a, b), max(a, b)),)),), 0, True)


@rule("select_n")
def _select_n(ex, eqn, scope, _k, labels):
    """``where(δ, t, 0)`` for an identity mask δ: a selection (``jnp.trace`` builds it).

    Any other ``where`` guards the values it drops (an Inf or NaN): expanding it as
    ``f + mask·(t − f)`` would read them, so it stays a leaf.
    """
    if len(eqn.invars) != 3:
        raise NoMatch("select_n with more than two cases")
    mask = ex.operand(eqn, scope, 0, labels)
    if not is_mask(mask):
        raise NoMatch("a where/select on data guards the values it drops (an Inf or NaN): they stay behind it")
    on_false, on_true = ex.operand(eqn, scope, 1, labels), ex.operand(eqn, scope, 2, labels)
    if on_false.monomials:
        raise NoMatch("a where/select off an identity mask reads the values it drops when expanded")
    return multiply(mask, on_true)


# -- calls ------------------------------------------------------------------------------------

def _enter(ex, eqn, scope, position, labels, body, consts, invars) -> Expansion:
    inner = Scope(body, scope, {v: (a, scope) for v, a in zip(body.invars, invars)}, consts)
    return ex.expand(body.outvars[position], inner, labels)


@rule(*sorted(INLINABLE))
def _call(ex, eqn, scope, position, labels):
    found = _body(eqn)
    if found is None:
        raise NoMatch(f"{eqn.primitive.name} without a readable body")
    body, consts = found
    if len(body.invars) != len(eqn.invars):
        raise NoMatch(f"{eqn.primitive.name} whose body takes other inputs than the call")
    return _enter(ex, eqn, scope, position, labels, body, consts, eqn.invars)


@rule("cond")
def _platform_cond(ex, eqn, scope, position, labels):
    """A platform-dependent ``cond`` computes the same function in every branch: expand any that expands."""
    if not eqn.params.get("branches_platforms"):
        raise NoMatch("a data-dependent cond")
    reasons = []
    for branch in eqn.params["branches"]:
        try:
            return _enter(ex, eqn, scope, position, labels, branch.jaxpr, branch.consts, eqn.invars[1:])
        except NoMatch as reason:
            reasons.append(str(reason))
    raise NoMatch("no branch of the platform cond expands: " + "; ".join(reasons))


# --------------------------------------------------------------------------------------------
# Emitting an expansion
# --------------------------------------------------------------------------------------------

def unify(monomial: Monomial, output_labels: set) -> tuple[dict, frozenset]:
    """Apply the deltas: ``(label -> representative, summed labels left)``; refuses δ between two outputs."""
    parent: dict[int, int] = {}

    def find(label):
        while parent.get(label, label) != label:
            label = parent[label]
        return label

    summed = set(monomial.summed)
    for a, b in monomial.deltas:
        ra, rb = find(a), find(b)
        if ra == rb:
            continue
        if ra in output_labels and rb in output_labels:
            raise NoMatch("a mask that keeps a diagonal matrix (δ between two output axes)")
        keep, drop = (ra, rb) if (ra in output_labels or rb not in output_labels) else (rb, ra)
        parent[drop] = keep
        summed.discard(drop)
    return {label: find(label) for label in parent}, frozenset(summed)


def check_emittable(expansion: Expansion, output_labels: tuple) -> None:
    """Raise :class:`NoMatch` when :func:`emit` could not write ``expansion`` as einsums."""
    outputs = {lab for lab in output_labels if lab is not None}
    for m in expansion.monomials:
        mapping, summed = unify(m, outputs)
        for f in m.factors:
            for lab in f.labels:
                lab = mapping.get(lab, lab)
                if lab is not None and lab not in outputs and lab not in summed:
                    raise NoMatch("a factor indexed by a label that is neither kept nor summed")


def emit(expansion: Expansion, values: list, output_labels: tuple, label_sizes: dict,
         out_shape: tuple, dtype, clamp_at_zero: bool = False):
    """Compute ``expansion`` from the source ``values`` with one einsum per monomial.

    ``output_labels`` gives the label of each output axis (``None`` for size 1).
    """
    total = add_terms(emit_terms(expansion, values, output_labels, label_sizes, out_shape, dtype), out_shape, dtype)
    if clamp_at_zero:  # t + max(-t, 0) keeps a NaN that XLA:CPU's fused max(t, 0) can drop
        total = total + jnp.maximum(-total, jnp.zeros((), dtype))
    return total


def emit_terms(expansion: Expansion, values: list, output_labels: tuple, label_sizes: dict, out_shape: tuple,
               dtype) -> list:
    """One array of the output's shape per monomial of ``expansion`` (see :func:`emit`)."""
    outputs = {lab for lab in output_labels if lab is not None}
    return [_emit_monomial(m, values, output_labels, outputs, label_sizes, out_shape, dtype)
            for m in expansion.monomials]


def add_terms(terms: list, out_shape: tuple, dtype):
    """The sum of ``terms`` in order (zeros for none)."""
    total = terms[0] if terms else jnp.zeros(out_shape, dtype)
    for term in terms[1:]:
        total = total + term
    return total


def _emit_monomial(m: Monomial, values, output_labels, outputs, label_sizes, out_shape, dtype):
    mapping, summed = unify(m, outputs)
    operands, subscripts, scalar = [], [], jnp.asarray(m.coeff, dtype)
    unit = m.coeff == 1.0
    used: set[int] = set()
    for f in m.factors:
        value = values[f.source].astype(dtype)
        keep = [i for i, lab in enumerate(f.labels) if lab is not None]
        value = value.reshape([value.shape[i] for i in keep])
        value = _raise(value, f.power)
        labels = [mapping.get(f.labels[i], f.labels[i]) for i in keep]
        if not labels:
            scalar, unit = scalar * value, False
            continue
        operands.append(value)
        subscripts.append(labels)
        used.update(labels)
    for lab in summed - used:
        scalar, unit = scalar * label_sizes[lab], False
    kept = [lab for lab in output_labels if lab is not None and lab in used]
    if operands:
        result_size = int(np.prod([label_sizes[lab] for lab in kept], dtype=np.int64))
        smallest = min(range(len(operands)), key=lambda k: operands[k].size)
        scale_first = not unit and operands[smallest].size < result_size
        if scale_first:  # scale the smallest operand, not the (larger) result: one pass less over it
            operands[smallest] = operands[smallest] * scalar
        names = {lab: opt_einsum.get_symbol(i) for i, lab in enumerate(sorted(used))}
        spec = ",".join("".join(names[lab] for lab in s) for s in subscripts) + "->" + "".join(names[lab] for lab in kept)
        result = einsum(spec, operands)
        if not unit and not scale_first:
            result = result * scalar
    else:
        result = scalar
    positions = [i for i, lab in enumerate(output_labels) if lab is not None and lab in used]
    return lax.broadcast_in_dim(jnp.asarray(result, dtype), out_shape, positions)


def einsum(spec: str, operands: list):
    """``jnp.einsum(spec, *operands)`` in the order of :func:`contraction_path`, at the highest
    precision. (``jnp.einsum`` itself builds a new ``jit`` per call: tens of milliseconds each when
    a pass emits hundreds of terms, so its implementation is called directly.)"""
    path = contraction_path(spec, [o.shape for o in operands])
    _, contractions = opt_einsum.contract_path(spec, *operands, einsum_call=True, use_blas=True, optimize=path,
                                               shapes=False)
    contractions = tuple((a, frozenset(b), c) for a, b, c, *_ in contractions)
    return jx.jnp_einsum(list(operands), contractions, lax.Precision.HIGHEST, None)


def contraction_path(spec: str, shapes) -> list:
    """A pairwise einsum order whose intermediates are no larger than its largest operand or result
    when one exists (it keeps away from the n x m x d outer products the rewrite exists to avoid),
    else the cheapest order."""
    out = spec.split("->")[1]
    sizes = {c: int(n) for term, shape in zip(spec.split("->")[0].split(","), shapes) for c, n in zip(term, shape)}
    limit = max([int(np.prod(s, dtype=np.int64)) for s in shapes] + [int(np.prod([sizes[c] for c in out], dtype=np.int64))])
    return einsum_order(spec, shapes, limit)


def _raise(value, power: int):
    if power == 1:
        return value
    if power > 0:
        return lax.integer_pow(value, power)
    return 1 / lax.integer_pow(value, -power)
