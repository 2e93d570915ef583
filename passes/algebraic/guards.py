"""When an inexact expansion may replace the written sum, and how it is emitted so that it keeps the
written program's exact zeros and its Inf/NaN semantics.

An *exact* expansion (``Expansion.exact``: a contraction, a diagonal or trace of a product, the same
products summed in another order) may always replace the written code. An *inexact* one multiplies a
sum out: the squared distance ``Σ(x − y)²`` becomes ``Σx² + Σy² − 2·x·y`` and its gradient
``Σ_m g·(x − y)`` becomes ``x·Σg − g·y``. Those cancel, so the pass uses them only under these rules:

1. **Never where exact zeros matter** (:func:`zero_sensitive_use`): the value must not reach a
   comparison (a ``where``/``select`` that tests it, a mask), a square root, a logarithm, a division
   by it, or a negative or fractional power, through the element-wise and layout operations that
   keep a zero a zero. The expanded distance of two nearly equal points is a rounding error of the
   order eps·|x|², not their distance, and ``sqrt`` makes that sqrt(eps)·|x| with an infinite slope.
2. **Centred** (:func:`plan`): sources that enter only through differences ``x − y`` are shifted by
   a common centre (the mean of their points' finite coordinates, rounded to a power of two not above
   their spread, so that points on a grid stay on it): every difference is unchanged, the
   cancellation of points far from the origin is gone, and integer coordinates give exact distances
   (ties stay ties for a ``top_k``/``sort``/``argmin`` reading them).
3. **An exact zero on the diagonal** of a self-distance (``x`` against ``x``).
4. **Plain JAX's Inf/NaN semantics** for the pairwise squared distance (:func:`emit_planned`): a
   pair of points with a NaN coordinate, or with an infinite coordinate of the same sign in both
   (Inf − Inf), gives NaN, any other infinite coordinate +Inf, as the written form does. Other
   inexact forms (the gradients ``Σ_m g·(x − y)``, ``Σ_nm g·(x − y)²``, sums over pairs) have
   their non-finite entries where plain has them, but may give NaN where plain gives ±Inf (see
   the README's limitations). A square of a sum other than a difference of points is left as
   written (no centre removes its cancellation), and so is any inexact expansion in a 16-bit type
   (it would cancel and overflow).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
from jax import lax
from hlopass import internals as jx

from hlopass.families import CUSTOM_DERIVATIVE_CALLS, INLINABLE, LAYOUT
from hlopass.jaxpr_utils import call_body

from .expansion import (Difference, Expander, Expansion, Factor, Monomial, add_terms, difference_index, emit_terms,
                        is_difference)

# -- 1. where exact zeros matter ------------------------------------------------------------------

#: Primitives for which a zero differs from a rounding error next to it, and how to name them.
ZERO_SENSITIVE = {
    **{name: "a comparison (a where/select that tests it, a mask)" for name in ("eq", "ne", "lt", "le", "gt", "ge")},
    "sqrt": "a square root", "rsqrt": "a reciprocal square root", "cbrt": "a cube root", "pow": "a power",
    "log": "a logarithm", "sign": "sign", "atan2": "atan2", "rem": "a remainder",
}

#: Element-wise and layout primitives through which a zero stays a zero (the walk follows them).
ZERO_KEEPING = LAYOUT | frozenset("""
    neg add add_any sub mul reduce_precision max min abs square select_n reduce_sum reduce_max reduce_min
    slice dynamic_slice gather concatenate pad clamp stop_gradient optimization_barrier cumsum cummax cummin
""".split())


def zero_sensitive_use(jaxpr: jx.Jaxpr, var) -> tuple[jx.JaxprEqn, str] | None:
    """The first equation sensitive to exact zeros that ``var`` reaches through zero-keeping
    operations (into loop, cond and call bodies too, following loop carries), with a description;
    ``None`` if none."""
    return _walk(jaxpr, [var])[0]


def _walk(jaxpr: jx.Jaxpr, start) -> tuple[tuple | None, set]:
    """``(first sensitive use or None, the variables of jaxpr that carry the value)``."""
    uses: dict = {}
    for eqn in jaxpr.eqns:
        for k, atom in enumerate(eqn.invars):
            if isinstance(atom, jx.Var):
                uses.setdefault(atom, []).append((eqn, k))
    tainted: set = set()
    todo = [v for v in start if isinstance(v, jx.Var)]
    while todo:
        var = todo.pop()
        if var in tainted:
            continue
        tainted.add(var)
        for eqn, k in uses.get(var, ()):
            name = eqn.primitive.name
            if name in ZERO_SENSITIVE:
                return (eqn, ZERO_SENSITIVE[name]), tainted
            if name == "div" and k == 1:
                return (eqn, "a division by it"), tainted
            if name == "integer_pow" and int(eqn.params["y"]) < 0:
                return (eqn, "a negative power"), tainted
            if name == "integer_pow" or name == "div" or name in ZERO_KEEPING:
                todo.extend(eqn.outvars)
            elif any(True for _ in _sub_jaxprs(eqn)):
                hit, outputs = _through(eqn, k)
                if hit is not None:
                    return hit, tainted
                todo.extend(eqn.outvars[i] for i in outputs)
    return None, tainted


def _carried(body: jx.Jaxpr, start: set, carry_in, carry_out) -> tuple[tuple | None, set]:
    """Walk a loop body to a fixpoint: an output carry that carries the value is an input carry of
    the next step. ``carry_in(c)``/``carry_out(c)``: body input/output position of carry ``c``."""
    start = set(start)
    while True:
        hit, tainted = _walk(body, [body.invars[p] for p in sorted(start)])
        if hit is not None:
            return hit, tainted
        carries = {c for c in range(len(body.outvars)) if carry_out(c) is not None
                   and body.outvars[carry_out(c)] in tainted}
        more = {carry_in(c) for c in carries} - start
        if not more:
            return None, tainted
        start |= more


def _through(eqn, k: int) -> tuple[tuple | None, list[int]]:
    """What operand ``k`` of an equation with sub-jaxprs reaches: ``(sensitive use, eqn outputs)``."""
    name = eqn.primitive.name
    if name in INLINABLE or name in CUSTOM_DERIVATIVE_CALLS:
        body = call_body(eqn)
        if body is not None:
            hit, tainted = _walk(body.jaxpr, [body.jaxpr.invars[k]])
            return hit, [i for i, v in enumerate(body.jaxpr.outvars) if v in tainted]
    elif name == "cond":
        outputs: set = set()
        for branch in eqn.params["branches"] if k > 0 else ():
            hit, tainted = _walk(_open(branch), [_open(branch).invars[k - 1]])
            if hit is not None:
                return hit, []
            outputs |= {i for i, v in enumerate(_open(branch).outvars) if v in tainted}
        return None, sorted(outputs)
    elif name == "scan":
        body = _open(eqn.params["jaxpr"])
        consts, n_carry = jx.scan_num_consts(eqn.params), jx.scan_num_carry(eqn.params)
        hit, tainted = _carried(body, {k}, lambda c: consts + c, lambda c: c if c < n_carry else None)
        return hit, [i for i, v in enumerate(body.outvars) if v in tainted]
    elif name == "while":
        cond_n, body_n = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        body, cond = _open(eqn.params["body_jaxpr"]), _open(eqn.params["cond_jaxpr"])
        if k < cond_n:
            return _walk(cond, [cond.invars[k]])[0], []
        start = {k - cond_n}
        hit, tainted = _carried(body, start, lambda c: body_n + c, lambda c: c)
        if hit is not None:
            return hit, []
        carries = [c for c, v in enumerate(body.outvars) if v in tainted]
        if k >= cond_n + body_n:
            carries.append(k - cond_n - body_n)
        hit, _ = _walk(cond, [cond.invars[cond_n + c] for c in carries])
        return hit, sorted(set(carries))
    return (eqn, f"a {name} (a sub-program the pass does not follow)"), []


def _open(body) -> jx.Jaxpr:
    return body.jaxpr if isinstance(body, jx.ClosedJaxpr) else body


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        items = value if isinstance(value, (tuple, list)) else (value,)
        for item in items:
            if isinstance(item, (jx.ClosedJaxpr, jx.Jaxpr)):
                yield item


# -- 2-4. how to emit it ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Square:
    """One term ``coeff · Σ_summed Π weights · (a − b)²`` of a squared distance, the weights of even
    power and indexed by the difference's shared (feature or batch) axes only."""

    coeff: float
    difference: Difference
    summed: frozenset
    weights: tuple[Factor, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    """How to emit an inexact expansion (see the module docstring).

    ``shifts``: groups of ``(source, feature axes)`` centred by one common centre. ``squares``: for
    a pairwise squared distance, its terms (emitted as norms of the points and one cross product
    each, with plain JAX's Inf/NaN semantics, see :func:`emit_planned`), ``rest`` the monomials
    that read no point set; otherwise the expansion is emitted as it is (centred), and its
    non-finite entries are where plain has them, NaN where plain may have ±Inf. ``diagonal``:
    pairs of output axes equal on a self-distance's diagonal, where the value is the sum of the
    monomials ``diagonal_terms`` of the expansion emitted.
    """

    shifts: tuple = ()
    squares: tuple = ()
    rest: tuple = ()
    diagonal: tuple = ()
    diagonal_terms: tuple = ()
    sign: float = 0.0  # clamp the result at zero from below (1) or above (-1); 0: no clamp


def plan(written: Expansion, expanded: Expansion, expander: Expander, output_labels: tuple,
         squared: bool) -> Plan | str:
    """The :class:`Plan` for an inexact expansion, or why it must not be used (a string).
    ``squared``: the expansion multiplies two sums (depth 2), so it must be a squared distance
    the pass can lay out with plain JAX's Inf/NaN semantics."""
    outputs = {lab: pos for pos, lab in enumerate(output_labels) if lab is not None}
    used = sorted({difference_index(f) for m in written.monomials for f in m.factors if is_difference(f)})
    plain = {f.source for m in written.monomials for f in m.factors if not is_difference(f)}
    differences = [expander.differences[k] for k in used]
    sources = expander.sources

    features: dict[int, tuple] = {}
    parent: dict[int, int] = {}
    broken: set[int] = set()

    def find(s):
        while parent.setdefault(s, s) != s:
            s = parent[s]
        return s

    for d in differences:
        shared = d.shared
        a_feat = tuple(i for i, lab in enumerate(d.a_labels) if lab in shared)
        b_feat = tuple(i for i, lab in enumerate(d.b_labels) if lab in shared)
        parent[find(d.a)] = find(d.b)
        for s, feat in ((d.a, a_feat), (d.b, b_feat)):
            if features.setdefault(s, feat) != feat:
                broken.add(s)
        if [d.a_labels[i] for i in a_feat] != [d.b_labels[i] for i in b_feat]:
            broken.update((d.a, d.b))
    groups: dict[int, list[int]] = {}
    for s in features:
        groups.setdefault(find(s), []).append(s)
    shifts = []
    for members in groups.values():
        shapes = {tuple(int(sources[s].aval.shape[i]) for i in features[s]) for s in members}
        if len(shapes) == 1 and not (set(members) & (plain | broken)):
            shifts.append(tuple((s, features[s]) for s in sorted(members)))
    centred = {s for group in shifts for s, _ in group}

    diagonal, self_source = (), None
    if len(differences) == 1 and differences[0].a == differences[0].b and differences[0].a in centred:
        d = differences[0]
        a_points = [i for i, lab in enumerate(d.a_labels) if lab is not None and lab not in d.shared]
        b_points = [i for i, lab in enumerate(d.b_labels) if lab is not None and lab not in d.shared]
        if a_points == b_points and all(d.a_labels[i] in outputs and d.b_labels[i] in outputs for i in a_points):
            diagonal, self_source = tuple((outputs[d.a_labels[i]], outputs[d.b_labels[i]]) for i in a_points), d.a

    if squared and written.spread:
        return "a sum other than a difference of points is multiplied out (no centre removes its cancellation)"
    found = _squares(written, expander, outputs, centred) if squared else None
    if not isinstance(found, tuple):  # emitted as expanded: non-finite entries where plain has them
        terms = () if self_source is None else tuple(
            j for j, m in enumerate(expanded.monomials) if all(f.source != self_source for f in m.factors))
        sign = 1.0 if squared and written.nonneg else 0.0
        return Plan(shifts=tuple(shifts), diagonal=diagonal, diagonal_terms=terms, sign=sign)
    squares, sign = found
    rest = tuple(m for m in written.monomials if not any(is_difference(f) for f in m.factors))
    # the emitted monomials are the squares' (three each) and then ``rest``: the diagonal's value
    return Plan(shifts=tuple(shifts), squares=squares, rest=rest, diagonal=diagonal,
                diagonal_terms=tuple(range(3 * len(squares), 3 * len(squares) + len(rest))), sign=sign)


def _squares(written: Expansion, expander: Expander, outputs: dict, centred: set):
    """``(squares, sign)`` when the expansion is a pairwise squared distance: every difference enters
    squared, with weights of even power on its shared axes and one sign, its points' axes kept in
    the output and its shared axes kept or summed; else why not (a string)."""
    signs, squares = set(), []
    for m in written.monomials:
        diffs = [f for f in m.factors if is_difference(f)]
        if not diffs:
            continue
        if len(diffs) != 1 or diffs[0].power != 2 or m.deltas:
            return "a product of different differences is not a squared distance the pass can guard"
        d = expander.differences[difference_index(diffs[0])]
        weights = tuple(f for f in m.factors if not is_difference(f))
        if any(f.power % 2 for f in weights):
            return "a weight of odd power: the sign of the squares is not known"
        if any(lab is not None and lab not in d.shared for f in weights for lab in f.labels):
            return "a weight that depends on the points, not only on their features"
        if not {d.a, d.b} <= centred:
            return "a point set also read outside its differences"
        summed = d.shared & m.summed
        if any(lab not in outputs for lab in d.labels if lab not in summed) or m.summed - d.shared:
            return "a sum over pairs of points (it would cancel at the scale of the whole sum)"
        signs.add(float(np.sign(m.coeff)))
        squares.append(Square(m.coeff, d, summed, weights))
    if len(signs) > 1:
        return "squares of differences with both signs"
    return tuple(squares), (signs.pop() if signs else 1.0)


def _finite_mean(value, feats):
    finite = jnp.where(jnp.isfinite(value), value, jnp.zeros((), value.dtype))
    points = tuple(ax for ax in range(value.ndim) if ax not in feats)
    return jnp.mean(finite, axis=points) if points else finite


def _finite_extremes(value, feats):
    """Per feature: the largest and smallest finite coordinate (-Inf and +Inf when there is none)."""
    finite = jnp.isfinite(value)
    points = tuple(ax for ax in range(value.ndim) if ax not in feats)
    hi = jnp.where(finite, value, jnp.array(-jnp.inf, value.dtype))
    lo = jnp.where(finite, value, jnp.array(jnp.inf, value.dtype))
    return (jnp.max(hi, axis=points), jnp.min(lo, axis=points)) if points else (hi, lo)


def _round_to_spread(centre, hi, lo):
    """``centre`` rounded to a multiple of the largest power of two not above the points' spread.

    Differences are unchanged by any centre; a rounded one keeps points on a grid on it (integer
    coordinates stay integers, so their expanded distances stay exact and ties stay ties, as in the
    written form), while staying within half the spread of the mean (the cancellation stays small).
    """
    spread = hi - lo
    usable = jnp.isfinite(spread) & (spread > 0)
    step = jnp.exp2(jnp.floor(jnp.log2(jnp.where(usable, spread, jnp.ones((), spread.dtype)))))
    return jnp.where(usable, jnp.round(centre / step) * step, centre)


def emit_planned(p: Plan, expansion: Expansion, values: list, output_labels: tuple, label_sizes: dict,
                 out_shape: tuple, dtype):
    """Emit ``expansion`` (as :func:`~.expansion.emit` does) under the plan ``p``.

    A squared distance is emitted term by term as ``c·(Σ a² + Σ b² − 2·Σ â·b̂)``, the weights'
    square roots folded into the points: the norms read the points as they are (an infinite or NaN
    coordinate makes them Inf or NaN, as in ``Σ (a − b)²``), the cross product reads them with
    ±Inf replaced by ±H (H = 2^72 in float32, 2^520 in float64) and NaN by 0. H·H overflows, so
    two points infinite in the same coordinate with the same sign make ``Inf − Inf = NaN`` in the
    sum, with opposite signs ``+Inf``, exactly as the written form; ``H·y`` stays finite for
    coordinates below 2^56 (float32).
    """
    values = list(values)
    for group in p.shifts:
        for s, _ in group:
            values[s] = jnp.asarray(values[s]).astype(dtype)
        means = [_finite_mean(values[s], feats) for s, feats in group]
        extremes = [_finite_extremes(values[s], feats) for s, feats in group]
        hi = functools.reduce(jnp.maximum, [e[0] for e in extremes])
        lo = functools.reduce(jnp.minimum, [e[1] for e in extremes])
        centre = lax.stop_gradient(_round_to_spread(sum(means[1:], means[0]) / len(means), hi, lo))
        for s, feats in group:
            values[s] = values[s] - lax.broadcast_in_dim(centre, values[s].shape, feats)
    zero = jnp.zeros((), dtype)
    if p.squares:
        monomials = []
        for sq in p.squares:
            d = sq.difference
            (a, a_hat), (b, b_hat) = (_scaled(values, s, labels, sq.weights, dtype) for s, labels in
                                       ((d.a, d.a_labels), (d.b, d.b_labels)))
            ia = len(values)
            values.extend([a, a_hat, b, b_hat])
            monomials += [Monomial(sq.coeff, (Factor(ia, d.a_labels, 2),), (), sq.summed),
                          Monomial(sq.coeff, (Factor(ia + 2, d.b_labels, 2),), (), sq.summed),
                          Monomial(-2.0 * sq.coeff, (Factor(ia + 1, d.a_labels), Factor(ia + 3, d.b_labels)), (),
                                   sq.summed)]
        expansion = Expansion(tuple(monomials) + p.rest)
    terms = emit_terms(expansion, values, output_labels, label_sizes, out_shape, dtype)
    # only the squares have a known sign: the other terms (``rest``: a tanh of the distance added to it,
    # say) are added after the clamp, as written (fresh seed s779685538234)
    signed = 3 * len(p.squares) if p.squares else len(terms)
    total = add_terms(terms[:signed], out_shape, dtype)
    # t + max(-t, 0), not max(t, 0): XLA:CPU's fused maximum before a large sum can drop a NaN, the
    # addition keeps it (and the result is exact: t, or t - t = 0)
    if p.sign > 0:
        total = total + jnp.maximum(-total, zero)
    elif p.sign < 0:
        total = total + jnp.minimum(-total, zero)
    if terms[signed:]:
        total = total + add_terms(terms[signed:], out_shape, dtype)
    if p.diagonal:
        on_diagonal = None
        for i, j in p.diagonal:
            same = lax.broadcasted_iota(np.int32, out_shape, i) == lax.broadcasted_iota(np.int32, out_shape, j)
            on_diagonal = same if on_diagonal is None else on_diagonal & same
        value = add_terms([terms[j] for j in p.diagonal_terms], out_shape, dtype)
        # x - x is NaN for a point with an infinite or NaN coordinate: the sum is NaN there already
        total = jnp.where(on_diagonal & ~jnp.isnan(total), value, total)
    return total


def _scaled(values, source: int, labels: tuple, weights, dtype):
    """A point set times the square roots of the weights (laid on its axes by label), as it is and
    with ±Inf -> ±H, NaN -> 0 (see :func:`emit_planned`)."""
    value = values[source]
    for w in weights:
        weight = jnp.asarray(values[w.source]).astype(dtype)
        keep = [i for i, lab in enumerate(w.labels) if lab is not None]
        weight = weight.reshape([weight.shape[i] for i in keep])
        own = [labels.index(w.labels[i]) for i in keep]
        order = sorted(range(len(own)), key=own.__getitem__)
        weight = lax.integer_pow(jnp.transpose(weight, order), w.power // 2) if w.power // 2 != 1 else \
            jnp.transpose(weight, order)
        value = value * lax.broadcast_in_dim(weight, value.shape, tuple(sorted(own)))
    finfo = jnp.finfo(dtype)
    big = jnp.asarray(2.0 ** ((int(finfo.maxexp) // 2) + 8), dtype)
    hat = jnp.where(jnp.isnan(value), jnp.zeros((), dtype), jnp.clip(value, -big, big))
    return value, hat
