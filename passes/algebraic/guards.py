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
   a common centre (the mean of their points' finite coordinates): every difference is unchanged,
   and the cancellation of points far from the origin is gone.
3. **An exact zero on the diagonal** of a self-distance (``x`` against ``x``).
4. **Plain JAX's Inf/NaN semantics** for the squared distance: it is computed from the finite parts
   of the points; a pair of points with a NaN coordinate, or with an infinite coordinate of the same
   sign in both (Inf − Inf), gives NaN, any other infinite coordinate +Inf, as the written form does.
   A squared distance the pass cannot lay out this way (a difference that is not squared, a weight
   of odd power) is left as written. The gradient form keeps the pattern of non-finite entries, but
   may give NaN where plain gives ±Inf (documented in the README's limitations).
"""

from __future__ import annotations

import dataclasses
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core

from hlopass.families import CUSTOM_DERIVATIVE_CALLS, INLINABLE
from hlopass.jaxpr_utils import call_body

from .expansion import Expansion, Expander, add_terms, difference_index, emit_terms, is_difference

# -- 1. where exact zeros matter ------------------------------------------------------------------

#: Primitives for which a zero differs from a rounding error next to it, and how to name them.
ZERO_SENSITIVE = {
    **{name: "a comparison (a where/select that tests it, a mask)" for name in ("eq", "ne", "lt", "le", "gt", "ge")},
    "sqrt": "a square root", "rsqrt": "a reciprocal square root", "cbrt": "a cube root", "pow": "a power",
    "log": "a logarithm", "sign": "sign", "atan2": "atan2", "rem": "a remainder",
}

#: Element-wise and layout primitives through which a zero stays a zero (the walk follows them).
ZERO_KEEPING = frozenset("""
    convert_element_type broadcast_in_dim reshape squeeze expand_dims transpose copy copy_p neg add add_any
    sub mul reduce_precision max min abs square select_n reduce_sum reduce_max reduce_min slice dynamic_slice
    gather concatenate pad clamp stop_gradient optimization_barrier cumsum cummax cummin
""".split())


def zero_sensitive_use(jaxpr: core.Jaxpr, var) -> tuple[core.JaxprEqn, str] | None:
    """The first equation sensitive to exact zeros that ``var`` reaches through zero-keeping
    operations (into loop, cond and call bodies too, following loop carries), with a description;
    ``None`` if none."""
    return _walk(jaxpr, [var])[0]


def _walk(jaxpr: core.Jaxpr, start) -> tuple[tuple | None, set]:
    """``(first sensitive use or None, the variables of jaxpr that carry the value)``."""
    uses: dict = {}
    for eqn in jaxpr.eqns:
        for k, atom in enumerate(eqn.invars):
            if isinstance(atom, core.Var):
                uses.setdefault(atom, []).append((eqn, k))
    tainted: set = set()
    todo = [v for v in start if isinstance(v, core.Var)]
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


def _carried(body: core.Jaxpr, start: set, carry_in, carry_out) -> tuple[tuple | None, set]:
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
        consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
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


def _open(body) -> core.Jaxpr:
    return body.jaxpr if isinstance(body, core.ClosedJaxpr) else body


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        items = value if isinstance(value, (tuple, list)) else (value,)
        for item in items:
            if isinstance(item, (core.ClosedJaxpr, core.Jaxpr)):
                yield item


# -- 2-4. how to emit it ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Side:
    """One source of a difference laid on the output: its axes summed in the square (``reduce``),
    its other labelled axes (``keep``) and their positions in the output."""

    source: int
    reduce: tuple[int, ...]
    keep: tuple[int, ...]
    positions: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    """How to emit an inexact expansion (see the module docstring).

    ``shifts``: groups of ``(source, feature axes)`` centred by one common centre; ``finite``: the
    sources read through their finite parts; ``pairs``: for each squared difference, its two sides,
    whose Inf/NaN flags are laid on the output with ``sign`` (the sign of the squares);
    ``diagonal``: pairs of output axes equal on a self-distance's diagonal, where the value is the sum
    of the expanded monomials ``diagonal_terms``.
    """

    shifts: tuple = ()
    finite: frozenset = frozenset()
    pairs: tuple = ()
    sign: float = 1.0
    diagonal: tuple = ()
    diagonal_terms: tuple = ()
    clamp: bool = False


def plan(written: Expansion, expanded: Expansion, expander: Expander, output_labels: tuple,
         squared_distance: bool) -> Plan | str:
    """The :class:`Plan` for an inexact expansion, or why it must not be used (a string)."""
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

    diagonal, diagonal_terms = (), ()
    if len(differences) == 1 and differences[0].a == differences[0].b and differences[0].a in centred:
        d = differences[0]
        a_points = [i for i, lab in enumerate(d.a_labels) if lab is not None and lab not in d.shared]
        b_points = [i for i, lab in enumerate(d.b_labels) if lab is not None and lab not in d.shared]
        if a_points == b_points and all(d.a_labels[i] in outputs and d.b_labels[i] in outputs for i in a_points):
            diagonal = tuple((outputs[d.a_labels[i]], outputs[d.b_labels[i]]) for i in a_points)
            diagonal_terms = tuple(j for j, m in enumerate(expanded.monomials)
                                   if all(f.source != d.a for f in m.factors))

    if not squared_distance:
        return Plan(shifts=tuple(shifts), diagonal=diagonal, diagonal_terms=diagonal_terms)
    found = _square_layout(written, expander, outputs, centred)
    if isinstance(found, str):
        return found
    pairs, sign = found
    return Plan(shifts=tuple(shifts), finite=frozenset(centred), pairs=pairs, sign=sign, diagonal=diagonal,
                diagonal_terms=diagonal_terms, clamp=True)


def _square_layout(written: Expansion, expander: Expander, outputs: dict, centred: set):
    """``(pairs, sign)`` when every difference enters squared, with weights of even power and one
    sign, its points' axes kept in the output and its feature axes kept or summed; else the reason."""
    if written.spread:
        return "a sum other than a difference of points is multiplied out"
    signs, summed_of = set(), {}
    for m in written.monomials:
        diffs = [f for f in m.factors if is_difference(f)]
        if not diffs:
            continue
        if len(diffs) != 1 or diffs[0].power != 2 or m.deltas:
            return "a product of different differences is not a squared distance the pass can guard"
        if any(f.power % 2 for f in m.factors if not is_difference(f)):
            return "a weight of odd power: the sign of the squares is not known"
        k = difference_index(diffs[0])
        d = expander.differences[k]
        if not {d.a, d.b} <= centred:
            return "a point set also read outside its differences"
        feature_sum = d.shared & m.summed
        if summed_of.setdefault(k, feature_sum) != feature_sum:
            return "a difference summed over different axes in different terms"
        if any(lab not in outputs for lab in d.labels if lab not in feature_sum):
            return "a sum over pairs of points (it would cancel at the scale of the whole sum)"
        signs.add(np.sign(m.coeff))
    if len(signs) > 1:
        return "squares of differences with both signs"
    pairs = []
    for k, feature_sum in summed_of.items():
        d = expander.differences[k]
        pairs.append(tuple(_side(s, labels, feature_sum, outputs) for s, labels in ((d.a, d.a_labels), (d.b, d.b_labels))))
    return tuple(pairs), float(signs.pop()) if signs else 1.0


def _side(source: int, labels: tuple, feature_sum: frozenset, outputs: dict) -> Side:
    reduce = tuple(i for i, lab in enumerate(labels) if lab in feature_sum)
    keep = tuple(i for i, lab in enumerate(labels) if lab is not None and lab not in feature_sum)
    return Side(source, reduce, keep, tuple(outputs[labels[i]] for i in keep))


def emit_planned(p: Plan, expansion: Expansion, values: list, output_labels: tuple, label_sizes: dict,
                 out_shape: tuple, dtype):
    """Emit ``expansion`` (as :func:`~.expansion.emit` does) under the plan ``p``."""
    values = list(values)
    touched = {s for group in p.shifts for s, _ in group} | set(p.finite)
    for s in touched:
        values[s] = jnp.asarray(values[s]).astype(dtype)
    raw = {s: values[s] for s in touched}
    zero = jnp.zeros((), dtype)
    for s in p.finite:
        values[s] = jnp.where(jnp.isfinite(values[s]), values[s], zero)
    for group in p.shifts:
        means = []
        for s, feats in group:
            finite = values[s] if s in p.finite else jnp.where(jnp.isfinite(values[s]), values[s], zero)
            points = tuple(ax for ax in range(finite.ndim) if ax not in feats)
            means.append(jnp.mean(finite, axis=points) if points else finite)
        centre = lax.stop_gradient(sum(means[1:], means[0]) / len(means))
        for s, feats in group:
            values[s] = values[s] - lax.broadcast_in_dim(centre, values[s].shape, feats)
    terms = emit_terms(expansion, values, output_labels, label_sizes, out_shape, dtype)
    total = add_terms(terms, out_shape, dtype)
    if p.clamp:
        total = jnp.maximum(total, zero)
    if p.diagonal:
        on_diagonal = None
        for a, b in p.diagonal:
            same = lax.broadcasted_iota(np.int32, out_shape, a) == lax.broadcasted_iota(np.int32, out_shape, b)
            on_diagonal = same if on_diagonal is None else on_diagonal & same
        total = jnp.where(on_diagonal, add_terms([terms[j] for j in p.diagonal_terms], out_shape, dtype), total)
    if p.pairs:
        nan, inf = None, None
        for a, b in p.pairs:
            nan_a, inf_a, words_a = _flags(raw[a.source], a, out_shape)
            nan_b, inf_b, words_b = _flags(raw[b.source], b, out_shape)
            pair_nan = nan_a | nan_b
            for wa, wb in zip(words_a, words_b):
                pair_nan = pair_nan | ((wa & wb) != 0)
            nan = pair_nan if nan is None else nan | pair_nan
            inf = inf_a | inf_b if inf is None else inf | inf_a | inf_b
        total = total + jnp.where(nan, jnp.asarray(np.nan, dtype),
                                  jnp.where(inf, jnp.asarray(p.sign * np.inf, dtype), zero))
    return total


#: Features per 32-bit word: two bits each (an infinite coordinate of either sign).
FEATURES_PER_WORD = 16


def _flags(value, side: Side, out_shape: tuple):
    """NaN and Inf flags of each point of one side over its summed features, and its pattern of
    infinite coordinates packed into 32-bit words (bit 2f: +Inf at feature f, 2f+1: -Inf), all laid
    on the output; two points with a common bit meet Inf - Inf."""
    others = tuple(ax for ax in range(value.ndim) if ax not in side.keep and ax not in side.reduce)
    arranged = jnp.transpose(value, side.keep + side.reduce + others)
    kept_shape = tuple(int(value.shape[ax]) for ax in side.keep)
    features = int(np.prod([value.shape[ax] for ax in side.reduce + others], dtype=np.int64))
    flat = arranged.reshape(kept_shape + (features,))
    nan, inf = jnp.any(jnp.isnan(flat), -1), jnp.any(jnp.isinf(flat), -1)
    code = (flat == np.inf).astype(np.uint32) + (flat == -np.inf).astype(np.uint32) * np.uint32(2)
    n_words = -(-features // FEATURES_PER_WORD)
    code = jnp.pad(code, [(0, 0)] * len(kept_shape) + [(0, n_words * FEATURES_PER_WORD - features)])
    code = code.reshape(kept_shape + (n_words, FEATURES_PER_WORD))
    shifts = (2 * np.arange(FEATURES_PER_WORD)).astype(np.uint32)
    words = jnp.sum(jnp.left_shift(code, shifts), axis=-1, dtype=np.uint32)  # distinct bits: the sum is an OR
    order = sorted(range(len(side.keep)), key=lambda i: side.positions[i])
    positions = tuple(side.positions[i] for i in order)

    def lay(x):
        return lax.broadcast_in_dim(jnp.transpose(x, order), out_shape, positions)

    return lay(nan), lay(inf), [lay(words[..., w]) for w in range(n_words)]
