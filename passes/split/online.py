"""Carried-state reductions along the split axis: online softmax and logsumexp.

``logsumexp``, ``softmax(...) @ V`` and their hand-written forms reduce the split
axis in two dependent steps: a maximum ``m``, then sums of ``exp(x - m)``. One
loop does both when it carries the *running* maximum (Milakov & Gimelshein,
2018): each step takes the maximum of the state and the slice, evaluates the
small equations between that maximum and the region again (``jax.nn``'s
``stop_gradient``, ``is_finite`` guard, ``[:, None]``: the *shift program*), and
rescales every running sum of ``exp(x - c)`` by ``exp(c_old - c_new)`` before
adding the slice's part.

:func:`shift_equations` says which equations between a region and itself form
a shift program (small values computed from the results of the region's
``reduce_max`` es, and from values outside the region). :func:`analyse` checks
that everything the region computes from the shift program is linear in
``exp(-c)``: every region value is *free* (independent of ``c``), *constant*
along the split axis (computed from ``c`` alone), *shifted* (``w + L(c)``),
or *scaled* (``w * exp(L(c))``), with ``L`` constant along the split axis,
through ``add``/``sub``/``neg`` (shifted), ``exp`` (shifted -> scaled),
``mul``/``div`` by free values, ``select_n`` against a constant zero or
``-inf``, transposes, broadcasts, ``reduce_sum`` and ``dot_general`` s that
reduce or keep dimensions along which ``L`` is constant. Only sums (``add``
reducers along the split axis) may read a scaled value; a shifted or scaled
value may not leave the loop. Anything else makes the online region
:class:`NotOnline` (the pass then tries a second loop instead).

:class:`Scales` evaluates ``L`` of each running sum on the *thin* shapes (the
split axis of length one) from the shift program's values: the loop keeps
``L`` of its state beside each sum. Inside the loop the shift values are
clamped to finite numbers (``where(isfinite(c), c, 0)``, as ``jax.nn.logsumexp``
does), so a slice whose maximum is still ``-inf`` (masked keys) adds zeros,
not NaN; after the loop each sum is brought from the last clamped ``L`` to the
``L`` of the true final shift values without a guard, so fully masked rows,
``+inf`` and NaN give what the unsplit program gives.

:func:`final_equations` finds the *final program*: small equations computed
from the region's sums and read back as a factor of a scaled value (the
``1 / s`` of ``softmax(x) @ V``). The loop skips that ``mul``/``div`` (the
scaled value passes through) and after the loop multiplies each sum it reached
by the factor mapped to the sum's shape (:class:`Scales` with ``finals``): one
loop carries the running maximum, the running sum and the running weighted sum.
A scaled, shifted or final value that would leave the loop along the split
axis, or a sum along a dimension along which the shift varies, is not online.
"""

from __future__ import annotations

import dataclasses
import heapq

import jax.numpy as jnp
import numpy as np
from jax import lax
from hlopass import internals as jx

from hlopass.families import LAYOUT
from hlopass.interpreter import bind_equation

from .rules import chunk_params

FREE, WHOLE, CONST, SHIFTED, SCALED, FINAL = "free", "whole", "const", "shifted", "scaled", "final"

#: Unary primitives that pass a value's kind (and its ``L``) through unchanged: the layout primitives that
#: keep every element where it is, and the identities. (``transpose`` and ``broadcast_in_dim`` move the
#: elements: the rules below map a scale through them; a reshape is not online.)
PASS_THROUGH = (LAYOUT - {"reshape", "squeeze", "transpose", "broadcast_in_dim"}) | {
    "stop_gradient", "reduce_precision", "optimization_barrier"}


class NotOnline(Exception):
    """A region cannot carry a running maximum; ``eqn_index`` is the equation that prevents it
    (the region grower reports it as infeasible)."""

    def __init__(self, eqn_index: int, reason: str):
        super().__init__(reason)
        self.eqn_index = eqn_index
        self.reason = reason


def _infeasible(i: int, reason: str) -> NotOnline:
    return NotOnline(i, reason)


#: Reductions the shift program may read: the loop combines each slice into the running value first.
RUNNING = ("max", "min", "or", "and")


def running_reducers(jaxpr: jx.Jaxpr, region) -> list[int]:
    """Reductions of ``region`` along the split axis whose running value a shift program may read
    (``max``/``min`` of floats, ``or``/``and``: a maximum with its NaN flag)."""
    eqns = jaxpr.eqns
    return sorted(i for i, monoid in region.reducing.items() if monoid in RUNNING
                  and eqns[i].primitive.name.startswith("reduce_")
                  and (monoid in ("or", "and") or jnp.issubdtype(eqns[i].outvars[0].aval.dtype, jnp.floating)))


def shift_equations(jaxpr: jx.Jaxpr, graph, region, between) -> list[int]:
    """The equations of ``between`` (outside ``region`` on a path from it back into it) that read only
    results of the region's floating ``reduce_max`` es, other such equations, and values computed
    outside the region; in program order. Empty when there are none."""
    maxes = {v for i in running_reducers(jaxpr, region) for v in jaxpr.eqns[i].outvars}
    if not maxes:
        return []  # an equation on a path from the region reads a region value: none is a maximum
    return _reading_only(jaxpr, graph, region, between, maxes)


def final_equations(jaxpr: jx.Jaxpr, graph, region, between, limit: int | None = None) -> list[int]:
    """The equations of ``between`` that read only results of the region's sums (and running
    reductions, shift values, other such equations, values from outside): the *final program*, evaluated
    once after the loop (the ``1 / s`` of ``softmax(x) @ V``); in program order. With ``limit``, at most
    ``limit + 1`` of them (enough to tell that there are more than ``limit``)."""
    eqns = jaxpr.eqns
    sources = {v for i, monoid in region.reducing.items() if monoid in ("add", *RUNNING) for v in eqns[i].outvars}
    sources |= {v for i in region.shift for v in eqns[i].outvars}
    if not sources:
        return []
    return _reading_only(jaxpr, graph, region, between, sources, limit)


def _reading_only(jaxpr: jx.Jaxpr, graph, region, between, sources: set, limit: int | None = None) -> list[int]:
    """The equations of ``between`` without effects whose every operand is in ``sources``, a result of
    another such equation, or computed outside the region and ``between``; in program order.

    Every equation of ``between`` reads the region or ``between`` (it lies on a path from the region),
    so each one found reads ``sources`` or another one found: they are found from the readers of
    ``sources`` forwards, in program order (an equation's producers decided before it), not by a
    sweep over ``between``, which spans the program for a region that does."""
    producer, eqns = graph.producer, jaxpr.eqns
    inside = (between if hasattr(between, "mask") else set(between)).__contains__   # a bit set answers itself
    found: set[int] = set()
    queue = sorted({j for v in sources for j in graph.uses(v) if inside(j)})
    queued = set(queue)
    while queue:
        i = heapq.heappop(queue)
        if eqns[i].effects:
            continue
        if all(not isinstance(atom, jx.Var) or atom in sources or (j := producer.get(atom)) is None or j in found
               or (j not in region.eqns and not inside(j)) for atom in eqns[i].invars):
            found.add(i)
            if limit is not None and len(found) > limit:
                break
            for var in eqns[i].outvars:
                for j in graph.uses(var):
                    if j not in queued and inside(j):
                        queued.add(j)
                        heapq.heappush(queue, j)
    return sorted(found)


@dataclasses.dataclass
class OnlineInfo:
    """What the loop of an online region needs: the running maxima, the shift program, and the kind of
    every value the shift program reaches."""

    maxima: list[int]                 # running reductions (a maximum, its NaN flag) feeding the shift program
    shift: list[int]                  # shift-program equations, in program order
    entries: set                      # shift / maximum results read by the other region equations
    kinds: dict                       # region value -> FREE, CONST, SHIFTED, SCALED or FINAL
    sums: list[int]                   # add reducers of scaled values (rescaled running sums)
    final: list[int] = dataclasses.field(default_factory=list)     # final program, after the loop
    deferred: set = dataclasses.field(default_factory=set)         # mul/div by a final value: skipped in the loop


def analyse(jaxpr: jx.Jaxpr, region) -> OnlineInfo:
    """Check that ``region``'s values computed from its shift program are linear in ``exp(-c)`` and
    say how each is made; raises :class:`NotOnline` naming the equation that is not."""
    shift_outs = {v for i in region.shift for v in jaxpr.eqns[i].outvars}
    readers = {a for j in region.eqns for a in jaxpr.eqns[j].invars if isinstance(a, jx.Var)}
    maxima = [i for i in running_reducers(jaxpr, region) if any(v in readers for v in jaxpr.eqns[i].outvars)]
    if not any(region.reducing[i] == "max" for i in maxima):
        raise _infeasible(region.seed, "a value reduced over the split axis is read again (two passes)")
    max_outs = {v for i in maxima for v in jaxpr.eqns[i].outvars}
    for i, monoid in region.reducing.items():
        if monoid not in ("add", "max", "min", "mul", "and", "or", "xor"):
            raise _infeasible(i, f"a running {monoid} beside a running maximum is not supported")
    kinds: dict = {v: FINAL for i in region.final for v in jaxpr.eqns[i].outvars}
    entries: set = set()
    sums: list[int] = []
    deferred: set = set()
    vary: dict = {}  # dimensions along which a value's shift or deferred factor may vary
    for i in region.ordered():
        if i in region.shift or i in region.final:
            continue
        eqn = jaxpr.eqns[i]
        ins = []
        for pos, atom in enumerate(eqn.invars):
            if isinstance(atom, jx.Var) and (atom in shift_outs or atom in max_outs):
                entries.add(atom)
                ins.append(CONST)
            elif isinstance(atom, jx.Var) and atom in kinds:
                ins.append(kinds[atom])
            else:
                ins.append(WHOLE if region.operand_axis.get((i, pos)) is None else FREE)
        if FINAL in ins:
            out = _final_rule(i, eqn, ins)
            if out == SCALED:
                deferred.add(i)
        else:
            out = _kind_rule(jaxpr, i, eqn, ins)
        if i in maxima and out != FREE:
            raise _infeasible(i, "the running maximum reads a value shifted by itself")
        if i in region.reducing and out != FREE:
            if out == SCALED and region.reducing[i] == "add":
                sums.append(i)
            else:
                raise _infeasible(i, f"{eqn.primitive.name} of a value shifted by the running maximum")
        for var in eqn.outvars:
            kinds[var] = out
        if out not in (FREE, WHOLE):
            vary[eqn.outvars[0]] = _varying(i, eqn, ins, vary)
    for var, kind in kinds.items():
        if kind in (FREE, WHOLE) or var not in region.var_axis or region.var_axis[var] is None:
            continue
        # read after the loop, or a result of the program itself (``softmax(x)`` returned along the split axis)
        if var in jaxpr.outvars or any(j not in region.eqns for j in _readers(jaxpr, var)):
            raise _infeasible(region.seed, f"a {kind} value (from the running maximum or the sums) leaves the loop")
    return OnlineInfo(maxima, sorted(region.shift), entries, kinds, sums, sorted(region.final), deferred)


def _varying(i: int, eqn, ins: list[str], vary: dict) -> frozenset:
    """Dimensions of ``eqn``'s result along which its shift (or deferred factor) may vary; raises
    :class:`NotOnline` when a sum or contraction runs along one of them (then no single factor
    rescales the sum)."""
    name = eqn.primitive.name
    out_rank = len(eqn.outvars[0].aval.shape)

    def of(pos):
        atom = eqn.invars[pos]
        if ins[pos] in (FREE, WHOLE) or not isinstance(atom, jx.Var):
            return frozenset()
        if atom in vary:
            return vary[atom]
        return frozenset(d for d, n in enumerate(atom.aval.shape) if n > 1)  # a shift or final value itself

    if name == "broadcast_in_dim":
        dims = eqn.params["broadcast_dimensions"]
        return frozenset(dims[d] for d in of(0))
    if name == "transpose":
        perm = list(eqn.params["permutation"])
        return frozenset(perm.index(d) for d in of(0))
    if name == "reduce_sum":
        axes = set(eqn.params["axes"])
        if of(0) & axes:
            raise _infeasible(i, "a sum along a dimension along which the running maximum varies")
        kept = [d for d in range(len(eqn.invars[0].aval.shape)) if d not in axes]
        return frozenset(kept.index(d) for d in of(0))
    if name == "dot_general":
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lrank, rrank = (len(a.aval.shape) for a in eqn.invars)
        lfree = [d for d in range(lrank) if d not in lc and d not in lb]
        rfree = [d for d in range(rrank) if d not in rc and d not in rb]
        out: set = set()
        for pos, (contract, batch, free, offset) in enumerate([(lc, lb, lfree, len(lb)),
                                                               (rc, rb, rfree, len(lb) + len(lfree))]):
            dims = of(pos)
            if dims & set(contract):
                raise _infeasible(i, "a contraction along a dimension along which the running maximum varies")
            out |= {list(batch).index(d) for d in dims if d in batch}
            out |= {offset + free.index(d) for d in dims if d in free}
        return frozenset(out)
    if name in ("reshape", "squeeze", "rev", "pad", "slice", "concatenate", "dynamic_slice"):
        raise _infeasible(i, f"{name} of a value shifted by the running maximum")
    out: set = set()
    for pos in range(len(eqn.invars)):
        rank = len(getattr(eqn.invars[pos].aval, "shape", ()))
        out |= {d + out_rank - rank for d in of(pos)}
    return frozenset(out)


def _readers(jaxpr, var) -> list[int]:
    return [j for j, e in enumerate(jaxpr.eqns) if var in e.invars]


def _final_rule(i: int, eqn, ins: list[str]) -> str:
    """A value computed after the loop may scale a scaled value (``exp(x - m) / s``: the division is
    deferred to the sums it reaches) or make more such values (a broadcast of it)."""
    name = eqn.primitive.name
    if all(k in (FINAL, WHOLE, CONST) for k in ins):
        return FINAL
    if name == "mul" and sorted(ins) == [FINAL, SCALED]:
        return SCALED
    if name == "div" and ins == [SCALED, FINAL]:
        return SCALED
    raise _infeasible(i, f"{name} of a value known only after the loop (not a factor of a scaled value)")


def _is_constant(jaxpr, atom, values: tuple) -> bool:
    """Whether ``atom`` is a literal (or a broadcast of one) equal to one of ``values`` everywhere."""
    if isinstance(atom, jx.Literal):
        return _all_in(atom.val, values)
    for eqn in jaxpr.eqns:
        if atom in eqn.outvars and eqn.primitive.name in ("broadcast_in_dim", "convert_element_type") \
                and isinstance(eqn.invars[0], jx.Literal):
            return _all_in(eqn.invars[0].val, values)
    return False


def _all_in(val, values) -> bool:
    arr = np.asarray(val)
    return arr.dtype.kind == "f" and any(np.all(arr == v) for v in values)


def _kind_rule(jaxpr, i: int, eqn, ins: list[str]) -> str:
    name = eqn.primitive.name
    if all(k in (FREE, WHOLE) for k in ins):
        return FREE
    if all(k in (CONST, WHOLE) for k in ins):
        return CONST
    if name in PASS_THROUGH or name in ("transpose", "broadcast_in_dim"):
        if name == "convert_element_type" and not jnp.issubdtype(eqn.params["new_dtype"], jnp.floating):
            raise _infeasible(i, "a value shifted by the running maximum converted to a non-float type")
        return ins[0]
    if name in ("add", "sub", "add_any", "neg"):
        if SCALED in ins:
            raise _infeasible(i, f"{name} of a value scaled by exp(-max) and another")
        return SHIFTED
    if name == "exp":
        if ins[0] == SHIFTED:
            return SCALED
        raise _infeasible(i, "exp of a value scaled by exp(-max)")
    if name in ("mul", "div"):
        if any(k in (SHIFTED, CONST) for k in ins):
            raise _infeasible(i, f"{name} of a value shifted by the running maximum")
        return SCALED
    if name == "select_n" and ins[0] in (FREE, WHOLE):
        cases = list(zip(eqn.invars[1:], ins[1:]))
        moving = [k for _, k in cases if k in (SHIFTED, SCALED)]
        if len(moving) == 1:
            allowed = (0.0,) if moving[0] == SCALED else (-np.inf,)
            if all(k in (SHIFTED, SCALED) or _is_constant(jaxpr, atom, allowed) for atom, k in cases):
                return moving[0]
        raise _infeasible(i, "a selection between a value shifted by the running maximum and one the shift changes")
    if name == "reduce_sum" and ins[0] == SCALED:
        return SCALED
    if name == "dot_general" and sorted(ins) in ([FREE, SCALED], [SCALED, WHOLE]):
        return SCALED
    raise _infeasible(i, f"{name} of a value shifted by the running maximum (not linear in exp(x - max))")


def clamp(value):
    """``value`` with non-finite entries replaced by zero (floating types only)."""
    if not jnp.issubdtype(value.dtype, jnp.floating):
        return value
    return lax.select(jnp.isfinite(value), value, lax.full_like(value, 0))


class Scales:
    """``L`` of each running sum of an online region, from the shift program's values (thin shapes)."""

    def __init__(self, jaxpr: jx.Jaxpr, region, info: OnlineInfo):
        self.jaxpr, self.region, self.info = jaxpr, region, info

    @property
    def dtype(self):
        """float32, or float64 when a running sum is float64."""
        dtypes = [self.jaxpr.eqns[i].outvars[0].aval.dtype for i in self.info.sums]
        return jnp.float64 if any(jnp.dtype(d) == jnp.float64 for d in dtypes) else jnp.float32

    def thin_shape(self, var) -> tuple[int, ...]:
        shape = list(var.aval.shape)
        axis = self.region.var_axis.get(var)
        if axis is not None:
            shape[axis] = 1
        return tuple(shape)

    def __call__(self, entries: dict, whole: dict, finals: dict | None = None) -> list:
        """``L`` (in :attr:`dtype`, broadcast to the sum's shape) of each of ``info.sums``; ``entries`` holds the
        values of ``info.entries``, ``whole`` the region inputs taken whole. With ``finals`` (the values
        of the final program), the deferred factor of each sum instead (``1 / s`` mapped to its shape)."""
        jaxpr, kinds = self.jaxpr, self.info.kinds
        factor = finals is not None
        thin: dict = dict(finals or {})

        def kind_of(i, pos, atom):
            if isinstance(atom, jx.Var) and kinds.get(atom) == FINAL:
                return FINAL
            if isinstance(atom, jx.Var) and atom in entries:
                return CONST
            if isinstance(atom, jx.Var) and atom in kinds:
                return kinds[atom]
            return WHOLE if self.region.operand_axis.get((i, pos)) is None else FREE

        def value(i, pos, atom):
            if not isinstance(atom, jx.Var):
                return atom.val
            if atom in entries:
                return entries[atom]
            if atom in thin:
                return thin[atom]
            return whole.get(atom)

        for i in self.region.ordered():
            if i in self.region.shift or i in self.region.final:
                continue
            eqn = jaxpr.eqns[i]
            out = kinds.get(eqn.outvars[0], FREE)
            if out == FREE or (out == FINAL and not factor):
                continue
            ins = [kind_of(i, p, a) for p, a in enumerate(eqn.invars)]
            vals = [value(i, p, a) for p, a in enumerate(eqn.invars)]
            if factor and out == SCALED:
                thin[eqn.outvars[0]] = self._factor_rule(eqn, ins, vals)
                continue
            if out in (CONST, FINAL):
                shapes = [self.thin_shape(v) for v in eqn.outvars]
                thin.update(zip(eqn.outvars, bind_equation(eqn, vals, chunk_params(eqn, shapes))))
                continue
            scales = [jnp.asarray(v, self.dtype) if k in (SHIFTED, SCALED, CONST) and v is not None
                      else jnp.zeros((), self.dtype) for v, k in zip(vals, ins)]
            thin[eqn.outvars[0]] = self._rule(eqn, ins, scales)
        return [jnp.broadcast_to(thin[jaxpr.eqns[i].outvars[0]], jaxpr.eqns[i].outvars[0].aval.shape)
                for i in self.info.sums]

    def _factor_rule(self, eqn, ins, vals):
        """The deferred factor of a scaled value: final values it was multiplied or divided by."""
        name = eqn.primitive.name
        rank = len(eqn.outvars[0].aval.shape)
        one = jnp.ones((), self.dtype)
        factors = [jnp.asarray(v, self.dtype) if k in (SCALED, FINAL) else one for v, k in zip(vals, ins)]
        if name == "mul":
            return _fit(factors[0] * factors[1], rank)
        if name == "div":
            return _fit(factors[0] / factors[1], rank)
        if name in ("add", "sub", "add_any", "exp") or ins[0] == SHIFTED:
            return one
        return self._rule(eqn, ins, factors)

    def _rule(self, eqn, ins, scales):
        name = eqn.primitive.name
        rank = len(eqn.outvars[0].aval.shape)
        s = scales[0]
        if name in PASS_THROUGH or name == "exp":
            return s
        if name == "transpose":
            return s if s.ndim == 0 else jnp.transpose(s, eqn.params["permutation"])
        if name == "broadcast_in_dim":
            if s.ndim == 0:
                return s
            return bind_equation(eqn, [s], chunk_params(eqn, [self.thin_shape(eqn.outvars[0])]))[0]
        if name == "neg":
            return -s if ins[0] == SHIFTED else s
        if name in ("add", "add_any"):
            return _fit(scales[0] + scales[1], rank)
        if name == "sub":
            return _fit(scales[0] - scales[1], rank)
        if name == "mul":
            return _fit(sum((t for t, k in zip(scales, ins) if k == SCALED), jnp.zeros((), self.dtype)), rank)
        if name == "div":
            return _fit((scales[0] if ins[0] == SCALED else 0) - (scales[1] if ins[1] == SCALED else 0), rank)
        if name == "select_n":
            return next(t for t, k in zip(scales[1:], ins[1:]) if k in (SHIFTED, SCALED))
        if name == "reduce_sum":
            if s.ndim == 0:
                return s
            axes = tuple(eqn.params["axes"])
            if any(s.shape[d] != 1 for d in axes):
                raise ValueError("a running sum over a dimension along which the maximum varies")
            return jnp.squeeze(s, axes)
        if name == "dot_general":
            return self._dot_scale(eqn, ins, scales)
        raise ValueError(f"no scale rule for {name}")

    @staticmethod
    def _dot_scale(eqn, ins, scales):
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lrank, rrank = (len(a.aval.shape) for a in eqn.invars)
        rank = len(eqn.outvars[0].aval.shape)
        side = 0 if ins[0] == SCALED else 1
        s = scales[side]
        if s.ndim == 0:
            return s
        contract, batch, own_rank = (lc, lb, lrank) if side == 0 else (rc, rb, rrank)
        if any(s.shape[d] != 1 for d in contract):
            raise ValueError("a contraction over a dimension along which the maximum varies")
        free = [d for d in range(own_rank) if d not in contract and d not in batch]
        moved = jnp.transpose(s, list(batch) + free + list(contract))
        moved = moved.reshape(moved.shape[:len(batch) + len(free)])
        other_free = (lrank - len(lc) - len(lb)) if side == 1 else (rrank - len(rc) - len(rb))
        if side == 0:
            shape = moved.shape + (1,) * other_free
        else:
            shape = moved.shape[:len(batch)] + (1,) * other_free + moved.shape[len(batch):]
        assert len(shape) == rank
        return moved.reshape(shape)


def _fit(value, rank: int):
    return value if value.ndim in (0, rank) else jnp.reshape(value, (1,) * (rank - value.ndim) + value.shape)


def rescale(acc, delta):
    """``acc * exp(delta)``, keeping exact zeros (a sum of nothing yet, whatever the scale)."""
    scaled = acc * jnp.exp(delta).astype(acc.dtype)
    return jnp.where(acc == 0, acc, scaled)
