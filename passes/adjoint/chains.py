"""Python loops unrolled into chains of steps, rolled back into ``lax.scan``.

A recurrence written as a Python loop::

    for t in range(T):
        h = a[t] * h + b[t] @ x[t]
        ys.append(c[t] @ h)

traces to T copies of the step's equations and no scan, so the adjoint
method has nothing to replace. :func:`find_chains` finds such chains in one
jaxpr level: a run of at least ``MIN_STEPS`` consecutive periods of
equations with the same primitives and shapes, wired identically from one
period to the next. In each period, the *body* is every equation whose
parameters all steps share; the rest (the slices ``x[t]``, whose index changes)
is *hoisted*: it runs as written, outside the scan, and its per-step values
are stacked as the scan's ``xs`` (rows of one array are scanned as that array).
The carry is what a step's body reads from the previous step. A step may read
only its own values, the previous step's values and values from before the
loop (a loop reaching two steps back matches with a period of two steps); a
hoisted equation that reads the carry, or effects, end the match.

:func:`roll` emits, in place of the chain, the hoisted equations, one
``lax.scan`` of the body over the stacked inputs, and one split of each output
that later code reads a step of. The adjoint pass rolls a chain
only when the scan it makes is a linear recurrence (:func:`.recurrence.classify`),
and leaves every other chain as written, named with the reason. A running total
(``loss = loss + f(h)``) is not part of that scan's carry: the scan returns each
step's increment, and the total is their sum after it.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from hlopass import internals as jx

from hlopass.interpreter import Replacement, bind_equation
from hlopass.jaxpr_utils import last_uses

#: The fewest steps a chain needs to be rolled (fewer keep nothing worth the scan).
MIN_STEPS = 8

#: How many rotations of a periodic run are tried as the loop's first step.
_OFFSETS = 16


@dataclasses.dataclass
class Chain:
    """A Python loop's steps, ``steps`` periods of ``period`` equations from ``start``."""

    start: int
    period: int
    steps: int
    body: list[int]              # positions in a period whose parameters all steps share, in order
    hoisted: list[int]           # the other positions (run as written, outside the scan)
    carry: list[tuple[int, int]]  # (position, output index) the next step reads
    wiring: dict[int, list[tuple]]   # body position -> one source per input
    init: list[Any]              # the carry's atoms before the first step
    consts: list[Any]            # atoms every step reads alike
    xs: list                     # per input slot: its atoms, one per step, or (v, start): rows of v
    ys: list[tuple[int, int]]    # body values read after the loop at some step
    totals: dict[int, tuple]     # carry index -> what its step adds (a running total, see _totals)
    inputs: list[Any]            # outer variables read by the chain
    outputs: list[Any]           # variables read after the chain
    sources: list[tuple]         # where each output comes from

    @property
    def end(self) -> int:
        return self.start + self.period * self.steps

    def eqn(self, jaxpr: jx.Jaxpr, t: int, j: int) -> jx.JaxprEqn:
        return jaxpr.eqns[self.start + t * self.period + j]


def _key(eqn) -> tuple:
    # dtypes as themselves: hashable and compared as their names are, and naming them was most of the cost
    shapes = lambda vs: tuple((getattr(v.aval, "shape", None), getattr(v.aval, "dtype", None)) for v in vs)  # noqa: E731
    return eqn.primitive.name, shapes(eqn.invars), shapes(eqn.outvars)


def _same_atom(a, b) -> bool:
    if isinstance(a, jx.Literal) and isinstance(b, jx.Literal):
        return a.aval == b.aval and np.array_equal(np.asarray(a.val), np.asarray(b.val))
    return a is b


def _same_value(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, (jx.ClosedJaxpr, jx.Jaxpr)) and type(a) is type(b):
        return str(a) == str(b)          # the same program, traced again at each step
    if hasattr(a, "f") and hasattr(a, "transforms") and type(a) is type(b):
        # a rule wrapped again at each step (custom_jvp's jvp): the call's jaxpr, compared by its
        # text, says which function it is
        return getattr(a.f, "__code__", a) is getattr(b.f, "__code__", b)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - parameters that do not compare (arrays) are different
        return False


def _same_params(a: dict, b: dict) -> bool:
    """Whether two steps' equations have the same parameters; sub-programs compare by their text,
    rules wrapped for them (``jvp_jaxpr_fun``) by their code, as each step traced them anew."""
    return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)


def _candidates(keys: list[tuple]) -> list[tuple[int, int]]:
    """(first index, period) of every key that recurs at a constant distance ``MIN_STEPS`` times."""
    positions: dict[tuple, list[int]] = collections.defaultdict(list)
    for i, k in enumerate(keys):
        positions[k].append(i)
    found = set()
    for pos in positions.values():
        if len(pos) < MIN_STEPS:
            continue
        first = 0
        for a in range(2, len(pos) + 1):
            if a == len(pos) or pos[a] - pos[a - 1] != pos[first + 1] - pos[first]:
                if a - first >= MIN_STEPS:
                    found.add((pos[first], pos[first + 1] - pos[first]))
                first = a - 1
    return sorted(found)


def find_chains(jaxpr: jx.Jaxpr) -> list[Chain]:
    """The chains of steps in ``jaxpr``'s own equations (not its sub-jaxprs), in order."""
    eqns = jaxpr.eqns
    if len(eqns) < 2 * MIN_STEPS:
        return []
    keys = [_key(e) for e in eqns]
    chains: list[Chain] = []
    taken_until = -1
    last = None
    same: dict[tuple[int, int], bool] = {}   # (x, p): eqns x and x + p have the same parameters
    refused: set[tuple[int, int, int]] = set()   # (offset, period, steps) that _verify turned down

    def same_as_next(x: int, p: int) -> bool:
        if (x, p) not in same:
            same[x, p] = _same_params(eqns[x].params, eqns[x + p].params)
        return same[x, p]

    for s, p in _candidates(keys):
        if s < taken_until:
            continue
        a, b = s, s + p
        while a > taken_until and a - 1 >= 0 and keys[a - 1] == keys[a - 1 + p]:
            a -= 1
        while b < len(eqns) and keys[b] == keys[b - p]:
            b += 1
        for o in range(a, min(a + p, a + _OFFSETS)):
            steps = (b - o) // p
            if steps < MIN_STEPS:
                break
            if (o, p, steps) in refused:  # the keys of one run of steps give it as many candidates
                continue
            last = last if last is not None else last_uses(jaxpr)
            try:
                chain = _verify(jaxpr, o, p, steps, last, same_as_next)
            except Exception:  # noqa: BLE001 - equations this matcher does not understand: no chain
                chain = None
            if chain is None:
                refused.add((o, p, steps))
            else:
                chains.append(chain)
                taken_until = chain.end
                break
    return chains


def _verify(jaxpr: jx.Jaxpr, o: int, p: int, steps: int, last: dict, same_as_next) -> Chain | None:
    """The chain of ``steps`` periods of ``p`` equations from ``o``, if they are wired as one.
    ``same_as_next(x, p)``: whether equations ``x`` and ``x + p`` have the same parameters (remembered
    by the caller: the candidates it tries overlap)."""
    eqns = jaxpr.eqns
    end = o + p * steps
    produced: dict = {}
    for t in range(steps):
        for j in range(p):
            e = eqns[o + t * p + j]
            if e.effects:
                return None
            for k, v in enumerate(e.outvars):
                if not isinstance(v, jx.DropVar):
                    produced[v] = (t, j, k)

    def source(t: int, a) -> tuple:
        if isinstance(a, jx.Literal):
            return ("outer", a)
        where = produced.get(a)
        if where is None:
            return ("outer", a)
        t2, j2, k2 = where
        if t2 == t:
            return ("local", j2, k2) if is_body[j2] else ("hoisted", j2, k2)
        return ("carry", j2, k2) if t2 == t - 1 else ("far",)

    # the body: every position whose parameters all steps share (step by step: sameness is an
    # equality); the rest (slices at the step's index) is hoisted, and must not read the carry
    is_body = [all(same_as_next(o + t * p + j, p) for t in range(steps - 1)) for j in range(p)]
    body = [j for j in range(p) if is_body[j]]
    hoisted = [j for j in range(p) if not is_body[j]]
    if not any(produced.get(a, (None,))[0] == 0 for j in body for a in eqns[o + p + j].invars
               if isinstance(a, jx.Var)):
        return None
    carry: list[tuple[int, int]] = []
    wiring: dict[int, list[tuple]] = {}
    consts: list = []
    xs: list[list] = []
    init: dict[tuple[int, int], Any] = {}
    for j in body:
        ref = eqns[o + p + j]
        slots = []
        for s, a in enumerate(ref.invars):
            seen = [source(t, eqns[o + t * p + j].invars[s]) for t in range(steps)]
            r = seen[1]
            if r[0] == "far":
                return None
            if r[0] == "carry":
                if any(d != r for d in seen[1:]) or seen[0][0] != "outer" or not is_body[r[1]]:
                    return None
                key = (r[1], r[2])
                if key in init and not _same_atom(init[key], seen[0][1]):
                    return None
                init.setdefault(key, seen[0][1])
                if key not in carry:
                    carry.append(key)
                slots.append(("carry", key))
            elif r[0] == "local":
                if any(d != r for d in seen):
                    return None
                slots.append(r)
            elif r[0] == "hoisted":
                if any(d != r for d in seen):
                    return None
                xs.append([eqns[o + t * p + r[1]].outvars[r[2]] for t in range(steps)])
                slots.append(("xs", len(xs) - 1))
            else:
                atoms = [d[1] for d in seen if d[0] == "outer"]
                if len(atoms) != steps:
                    return None
                if all(_same_atom(x, atoms[0]) for x in atoms):
                    consts.append(atoms[0])
                    slots.append(("const", len(consts) - 1))
                else:
                    xs.append(atoms)
                    slots.append(("xs", len(xs) - 1))
        wiring[j] = slots
    for j in hoisted:
        for t in range(steps):
            if any(source(t, a)[0] not in ("outer", "hoisted") for a in eqns[o + t * p + j].invars):
                return None
    carry.sort()
    index = {c: i for i, c in enumerate(carry)}
    for j, slots in wiring.items():
        wiring[j] = [("carry", index[d[1]]) if d[0] == "carry" else d for d in slots]

    ys: list[tuple[int, int]] = []
    outputs, sources = [], []
    for v, (t, j, k) in produced.items():
        if last.get(v, -1) < end:
            continue
        outputs.append(v)
        if not is_body[j]:
            sources.append(("hoisted", v))
        elif t == steps - 1 and (j, k) in index:
            sources.append(("final", index[(j, k)]))
        else:
            if (j, k) not in ys:
                ys.append((j, k))
            sources.append(("ys", ys.index((j, k)), t))
    inputs: dict = {}
    for i in range(o, end):
        for a in eqns[i].invars:
            if isinstance(a, jx.Var) and a not in produced:
                inputs.setdefault(a, None)
    xs = [_rows_of(eqns, o, p, atoms, produced) or atoms for atoms in xs]
    return Chain(o, p, steps, body, hoisted, carry, wiring, [init[c] for c in carry], consts, xs, ys,
                 _totals(eqns, o, p, carry, wiring), list(inputs), outputs, sources)


def _totals(eqns, o: int, p: int, carry: list, wiring: dict) -> dict[int, tuple]:
    """The running totals among the carries (``loss = loss + f(h)``): a carry whose step only adds
    something to it, read nowhere else in the step, its new value read by no other equation of the
    step. They leave the scan's carry (a total of ``f(h)`` is not linear in ``h``): the scan returns
    each step's increment, summed after it."""
    totals = {}
    reads = collections.Counter(d for slots in wiring.values() for d in slots)
    for ci, (j, k) in enumerate(carry):
        slots = wiring.get(j, [])
        if eqns[o + p + j].primitive.name not in ("add", "add_any") or k != 0 or len(slots) != 2:
            continue
        if reads[("carry", ci)] != 1 or slots.count(("carry", ci)) != 1 or reads[("local", j, 0)]:
            continue
        increment = slots[1 - slots.index(("carry", ci))]
        out = eqns[o + p + j].outvars[0].aval
        if increment[0] == "carry" or _aval_of(eqns, o, p, j, slots.index(increment)) != (out.shape, out.dtype):
            continue
        totals[ci] = increment
    return totals


def _aval_of(eqns, o: int, p: int, j: int, slot: int) -> tuple:
    aval = eqns[o + p + j].invars[slot].aval
    return aval.shape, aval.dtype


def _rows_of(eqns, o: int, p: int, atoms: list, produced: dict):
    """``(v, start)`` when ``atoms`` are the rows ``v[start + t : start + t + 1]`` of one outer
    array ``v`` (a Python loop reading ``x[t]``), to scan ``v`` itself instead of their copies."""
    first = None
    for t, a in enumerate(atoms):
        where = produced.get(a) if isinstance(a, jx.Var) else None
        if where is None:
            return None
        e = eqns[o + where[0] * p + where[1]]
        if e.primitive.name != "slice" or e.params.get("strides") not in (None, (1,) * len(
                e.params["start_indices"])) or isinstance(e.invars[0], jx.Literal) or e.invars[0] in produced:
            return None
        v, start, limit = e.invars[0], e.params["start_indices"], e.params["limit_indices"]
        full = all(s == 0 and l == d for s, l, d in zip(start[1:], limit[1:], v.aval.shape[1:]))
        if not full or limit[0] != start[0] + 1:
            return None
        if first is None:
            first = (v, start[0])
        elif v is not first[0] or start[0] != first[1] + t:
            return None
    return first


def roll(jaxpr: jx.Jaxpr, chain: Chain) -> Replacement:
    """The replacement of ``chain``'s equations by its hoisted equations and one ``lax.scan``."""
    ref = {j: chain.eqn(jaxpr, 1, j) for j in chain.body}

    def build(*values):
        env = dict(zip(chain.inputs, values))

        def read(a):
            return a.val if isinstance(a, jx.Literal) else env[a]

        for t in range(chain.steps):
            for j in chain.hoisted:
                e = chain.eqn(jaxpr, t, j)
                outs = bind_equation(e, [read(a) for a in e.invars])
                env.update((v, x) for v, x in zip(e.outvars, outs) if not isinstance(v, jx.DropVar))
        consts = [read(a) for a in chain.consts]
        xs = [jnp.stack([read(a) for a in atoms]) if isinstance(atoms, list)
              else lax.expand_dims(lax.slice_in_dim(read(atoms[0]), atoms[1], atoms[1] + chain.steps), (1,))
              for atoms in chain.xs]

        state = [ci for ci in range(len(chain.carry)) if ci not in chain.totals]
        totals = list(chain.totals)
        at = {(j, k): ci for ci, (j, k) in enumerate(chain.carry)}
        skipped = {chain.carry[ci][0] for ci in totals}
        own = [y for y in chain.ys if at.get(y) not in chain.totals]

        def step(carry, x):
            local: dict = {}
            carried = dict(zip(state, carry))

            def value(d):
                kind = d[0]
                return (local[d[1:]] if kind == "local" else carried[d[1]] if kind == "carry"
                        else consts[d[1]] if kind == "const" else x[d[1]])
            for j in chain.body:
                if j not in skipped:
                    outs = bind_equation(ref[j], [value(d) for d in chain.wiring[j]])
                    local.update(((j, k), o) for k, o in enumerate(outs))
            return ([local[chain.carry[ci]] for ci in state],
                    [local[y] for y in own] + [value(chain.totals[ci]) for ci in totals])

        init = [read(a) for a in chain.init]
        final, ys = lax.scan(step, [init[ci] for ci in state], xs, length=chain.steps)
        ends = dict(zip(state, final))
        stacked = dict(zip(own, ys[:len(own)]))
        for ci, increments in zip(totals, ys[len(own):]):   # a total's values: a cumulative sum
            ends[ci] = init[ci] + jnp.sum(increments, 0)
            if chain.carry[ci] in chain.ys:
                stacked[chain.carry[ci]] = init[ci] + jnp.cumsum(increments, 0)
        # one split per output, not a slice per step: the transpose of T slices is T zero-padded
        # copies of the whole output, that of a split one concatenation
        rows = [[jnp.squeeze(r, 0) for r in lax.split(stacked[y], [1] * chain.steps, 0)] for y in chain.ys]
        out = []
        for src in chain.sources:
            out.append(env[src[1]] if src[0] == "hoisted" else ends[src[1]] if src[0] == "final"
                       else rows[src[1]][src[2]])
        return out

    return Replacement(list(range(chain.start, chain.end)), list(chain.inputs), list(chain.outputs), build,
                       anchor=chain.start + chain.body[0])


def rolled_scan(jaxpr: jx.Jaxpr, chain: Chain) -> jx.JaxprEqn:
    """The ``scan`` equation :func:`roll` emits for ``chain`` (to classify it before rolling)."""
    build = roll(jaxpr, chain).build
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in chain.inputs]
    traced = jax.make_jaxpr(build)(*avals)
    return next(e for e in traced.jaxpr.eqns if e.primitive.name == "scan")
