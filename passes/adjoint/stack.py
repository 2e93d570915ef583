"""Time chunks across stacked layers: a linear recurrence and what reads its rows, run K rows at a time.

A state space model applies, along the time axis of length T, layers that are
each a scan (``h_t = a_t h_{t-1} + b_t``) joined by row-wise computation (a
residual ``x + tanh(y)``, an embedding lookup, a projection, a row-wise
``log_softmax``) and ends in a sum over time (the loss). Replacing each scan
alone by an adjoint scan (:mod:`.emit`) still leaves JAX keeping every layer's
T-row inputs and outputs for backpropagation across layers: memory grows with
T times the width. :func:`find_region` finds, at one jaxpr level, the
*time region* around the linear-recurrence scans of length T: equations that
act on each row of their T-row operands alone (rules in :func:`row_roles`),
the scans themselves, and sums, maxima or minima over the time axis (and
contractions over it) that end the region. :func:`chunked_region` evaluates
that region K rows at a time: one ``lax.scan`` over chunks whose carry is the
scans' states and the running sums, its body under ``jax.checkpoint`` and each
recurrence inside it an adjoint scan of the chunk. JAX then backpropagates
across layers as usual, chunk by chunk from the last, and only the states at
chunk boundaries (and the inputs' rows) are kept: memory independent of T for
the per-row values. Each chunk's adjoint states leave it through the carry's
cotangent (one state per layer per boundary).

Leaves alone: equations that mix rows (a cumulative sum over time, a shift,
a slice or a transpose of the time axis, an ``iota`` along it), calls with
their own derivatives, and everything after a value only known once all
chunks ran (a final state, a total): those are outside the region, which
hands them the full T-row values they read or its final values.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from hlopass import internals as jx

from hlopass.families import ARG_REDUCTIONS, CUMULATIVE, ELEMENTWISE, REDUCTIONS
from hlopass.interpreter import at_source_of, bind_equation
from hlopass.jaxpr_utils import aval_nbytes
from hlopass.sharding import conform

from .emit import adjoint_scan
from .recurrence import Recurrence, body_function

#: Reductions over the time axis that may end a region, and how partial results combine.
ACCUMULATE = {"reduce_sum": "add", "reduce_max": "max", "reduce_min": "min"}


@dataclasses.dataclass
class Region:
    """Equations of one level that run ``length`` rows at a time (see the module docstring).

    ``eqns``: indices, in order. ``sources``: T-row values read from outside (sliced per chunk).
    ``invariants``: other values read from outside (whole). ``rows_out``: T-row values read after
    the region (stacked from the chunks). ``finals``: values known after the last chunk (scan states,
    accumulators) read after it. ``scans``: eqn index -> its :class:`Recurrence`.
    """

    length: int
    eqns: list[int]
    sources: list[Any]
    invariants: list[Any]
    rows_out: list[Any]
    finals: list[Any]
    scans: dict[int, Recurrence]
    kinds: dict[int, str]
    carry_bytes: int = 0
    row_bytes: int = 0


def _leads(aval, length: int) -> bool:
    shape = getattr(aval, "shape", ())
    return len(shape) > 0 and shape[0] == length


def row_roles(eqn, length: int, recurrence: Recurrence | None = None) -> tuple[str, list[str]] | None:
    """How ``eqn`` treats the time axis (axis 0, ``length`` rows): ``("row", roles)`` when each
    output row depends only on the same row of the operands marked ``"row"`` (and on the whole of
    those marked ``"inv"``), ``("acc", roles)`` for a sum, maximum or minimum (or a contraction)
    over the time axis, ``("scan", roles)`` for a linear recurrence along it; ``None`` otherwise."""
    name = eqn.primitive.name
    avals = [a.aval for a in eqn.invars]
    outs = [v.aval for v in eqn.outvars]
    p = eqn.params
    if not outs:
        return None
    if name == "scan":
        if recurrence is None or recurrence.form is None or p["length"] != length or p.get("reverse"):
            return None
        nc, nk = jx.scan_num_consts(p), jx.scan_num_carry(p)
        xs = avals[nc + nk:]
        if not all(_leads(a, length) for a in xs):
            return None
        return "scan", ["inv"] * (nc + nk) + ["row"] * len(xs)
    if name in ELEMENTWISE:
        roles = []
        out_shape = outs[0].shape
        for a in avals:
            shape = getattr(a, "shape", ())
            fits = len(shape) == len(out_shape) and all(d in (o, 1) for d, o in zip(shape, out_shape))
            if not shape:
                roles.append("inv")
            elif fits and _leads(a, length):
                roles.append("row")
            elif fits and shape[0] == 1 and length != 1:
                roles.append("inv")     # the same for every row (a size-1 axis broadcast)
            else:
                return None
        return ("row", roles) if "row" in roles else None
    if name not in ("gather", "dot_general") and not (avals and _leads(avals[0], length)):
        return None
    if name == "broadcast_in_dim":
        dims, shape = p["broadcast_dimensions"], p["shape"]
        if dims and dims[0] == 0 and shape[0] == length:
            return "row", ["row"]
        return None
    if name == "reshape":
        if p.get("dimensions") is None and p["new_sizes"] and p["new_sizes"][0] == length:
            return "row", ["row"]
        return None
    if name == "squeeze":
        return ("row", ["row"]) if 0 not in p["dimensions"] else None
    if name == "transpose":
        return ("row", ["row"]) if p["permutation"][0] == 0 else None
    if name in REDUCTIONS or name in ARG_REDUCTIONS:
        axes = tuple(p["axes"])
        if 0 not in axes:
            return "row", ["row"]
        return ("acc", ["row"]) if name in ACCUMULATE else None
    if name in CUMULATIVE:
        return ("row", ["row"]) if p["axis"] != 0 else None
    if name == "dot_general":
        (lc, rc), (lb, rb) = p["dimension_numbers"]
        lrow, rrow = _leads(avals[0], length), _leads(avals[1], length)
        if not lb and not rb:
            if lrow and 0 not in lc:
                return "row", ["row", "inv"]
            if lrow and rrow and 0 in lc and 0 in rc and list(lc).index(0) == list(rc).index(0):
                return "acc", ["row", "row"]
            return None
        if lrow and rrow and lb[0] == 0 and rb[0] == 0:
            return "row", ["row", "row"]
        return None
    if name == "gather":
        dn = p["dimension_numbers"]
        operand, indices = avals
        if not _leads(indices, length) or len(indices.shape) < 2 or 0 in dn.offset_dims:
            return None
        if not dn.operand_batching_dims:
            return "row", ["inv", "row"]
        if (_leads(operand, length) and 0 in dn.operand_batching_dims
                and dn.start_indices_batching_dims[list(dn.operand_batching_dims).index(0)] == 0
                and p["slice_sizes"][0] == 1):
            return "row", ["row", "row"]
        return None
    return None


def _rows_params(eqn, rows: int) -> dict | None:
    """``eqn``'s params for ``rows`` rows instead of the full length (``None``: unchanged)."""
    name, p = eqn.primitive.name, eqn.params
    if name == "broadcast_in_dim":
        return {**p, "shape": (rows,) + tuple(p["shape"][1:])}
    if name == "reshape":
        return {**p, "new_sizes": (rows,) + tuple(p["new_sizes"][1:])}
    return None


def find_region(jaxpr: jx.Jaxpr, length: int, scans: dict[int, Recurrence]) -> Region | None:
    """The time region of ``jaxpr`` around its linear-recurrence ``scans`` of ``length`` steps
    (eqn index -> :class:`Recurrence`); ``None`` when there is none."""
    timed: set = set()      # region values with ``length`` rows
    final: set = set()      # region values known after the last chunk
    after: set = set()      # values outside the region that depend on it
    members: list[int] = []
    kinds: dict[int, str] = {}
    roles_of: dict[int, list[str]] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        ins = [a for a in eqn.invars if isinstance(a, jx.Var)]
        blocked = any(a in after or a in final for a in ins)
        found = None if blocked else row_roles(eqn, length, scans.get(i))
        if found is not None:
            kind, roles = found
            inv_ok = all(not (isinstance(a, jx.Var) and a in timed) for a, r in zip(eqn.invars, roles) if r == "inv")
            row_ok = all(isinstance(a, jx.Var) and _leads(a.aval, length)
                         for a, r in zip(eqn.invars, roles) if r == "row")
            effects = bool(getattr(eqn, "effects", None))
            if inv_ok and row_ok and not effects:
                members.append(i)
                kinds[i], roles_of[i] = kind, roles
                for j, v in enumerate(eqn.outvars):
                    if kind == "row" or (kind == "scan" and j >= jx.scan_num_carry(eqn.params)):
                        timed.add(v)
                    else:
                        final.add(v)
                continue
        if any(a in timed or a in after or a in final for a in ins):
            after.update(eqn.outvars)
    # keep what is connected to a recurrence (through region values)
    producer = {v: i for i in members for v in jaxpr.eqns[i].outvars}
    readers: dict[int, set[int]] = {i: set() for i in members}
    for i in members:
        for a in jaxpr.eqns[i].invars:
            if isinstance(a, jx.Var) and a in producer:
                readers[producer[a]].add(i)
                readers[i].add(producer[a])
    keep, todo = set(), [i for i in members if kinds[i] == "scan"]
    while todo:
        i = todo.pop()
        if i in keep:
            continue
        keep.add(i)
        todo.extend(readers[i] - keep)
    members = [i for i in members if i in keep]
    if not members:
        return None
    inside = set(members)
    defined = {v for i in members for v in jaxpr.eqns[i].outvars}
    sources, invariants = [], []
    for i in members:
        for a, r in zip(jaxpr.eqns[i].invars, roles_of[i]):
            if not isinstance(a, jx.Var) or a in defined:
                continue
            bucket = sources if r == "row" else invariants
            if a not in bucket:
                bucket.append(a)
    if set(sources) & set(invariants):
        return None   # one value read both row by row and whole
    used_after = set(v for v in jaxpr.outvars if isinstance(v, jx.Var))
    for j, eqn in enumerate(jaxpr.eqns):
        if j not in inside:
            used_after.update(a for a in eqn.invars if isinstance(a, jx.Var))
    rows_out = [v for i in members for v in jaxpr.eqns[i].outvars if v in used_after and v in timed]
    finals = [v for i in members for v in jaxpr.eqns[i].outvars if v in used_after and v in final]
    region_scans = {i: scans[i] for i in members if kinds[i] == "scan"}
    carry = sum(r.carry_bytes for r in region_scans.values()) + sum(
        aval_nbytes(jaxpr.eqns[i].outvars[0].aval) for i in members if kinds[i] == "acc")
    per_row = sum(aval_nbytes(v.aval) // length for i in members if kinds[i] == "row"
                  for v in jaxpr.eqns[i].outvars) + sum(r.step_bytes for r in region_scans.values())
    return Region(length, members, sources, invariants, rows_out, finals, region_scans, kinds, carry, per_row)


def near_divisor(length: int, k: int) -> int:
    """The largest divisor of ``length`` between ``k/2`` and ``k`` (no partial last chunk, never a
    longer chunk than asked), else ``k``."""
    k = max(1, min(k, length))
    for d in range(k, (k + 1) // 2 - 1, -1):
        if d >= 1 and length % d == 0:
            return d
    return k


def balanced_chunk(length: int, carry_bytes: int, row_bytes: int, memory_limit: int | None,
                   chunk: int | None = None) -> int:
    """K for a region: ``chunk`` if given; else the K minimising what is kept, ``(T/K) * carry +
    K * row`` (the states at chunk boundaries against one chunk's values, measured per step), at
    most an eighth of ``memory_limit`` for a chunk's values; a divisor of T a little below it when there is one."""
    if chunk is not None:
        return max(1, min(chunk, length))
    k = math.ceil(math.sqrt(length * max(carry_bytes, 1) / max(row_bytes, 1)))
    if memory_limit is not None and row_bytes:
        k = min(k, max(1, memory_limit // (8 * row_bytes)))
    return near_divisor(length, max(1, min(k, length)))


def nested_groups(chunks: int, levels: int) -> int:
    """How many groups of chunks a second level of checkpointing makes of ``chunks`` chunks: 1 for one
    level; for two, the divisor of ``chunks`` nearest ``sqrt(chunks)`` (within a factor of 2), else
    ``round(sqrt(chunks))`` groups with the chunks left over run after them. The states kept fall from
    one per chunk to one per group, plus one group's chunk states while the backward pass is in it."""
    if levels < 2 or chunks < 4:
        return 1
    root = math.sqrt(chunks)
    near = [d for d in range(max(2, math.ceil(root / 2)), math.floor(2 * root) + 1) if chunks % d == 0]
    return min(near, key=lambda d: abs(math.log(d / root))) if near else max(2, round(root))


def kept_states(chunks: int, groups: int) -> int:
    """States kept at chunk boundaries with ``groups`` groups (see :func:`nested_groups`): ``chunks``
    for one level; else one per group and one group's chunks (and the chunks left over)."""
    if groups <= 1:
        return chunks
    per, left = divmod(chunks, groups)
    return groups + per + left


class RegionRunner:
    """The equations of ``region`` run chunk by chunk from given states: what :func:`chunked_region`
    (one device) and :func:`.sharded.sharded_region` (a device's rows of a sharded time axis) share."""

    def __init__(self, jaxpr: jx.Jaxpr, region: Region, guard: Callable, manual: bool = False):
        # manual: run inside a shard_map, without the equations' trace-time mesh and global shardings
        self.jaxpr, self.region, self.guard, self.manual = jaxpr, region, guard, manual
        self.eqns = [jaxpr.eqns[i] for i in region.eqns]
        self.scan_ids = [i for i in region.eqns if region.kinds[i] == "scan"]
        self.acc_ids = [i for i in region.eqns if region.kinds[i] == "acc"]

    def how(self, i: int) -> str:
        """How the partial results of accumulator ``i`` combine: ``add``, ``max`` or ``min``."""
        eqn = self.jaxpr.eqns[i]
        return "add" if eqn.primitive.name == "dot_general" else ACCUMULATE[eqn.primitive.name]

    @staticmethod
    def combine(how: str, a, b):
        """Two partial results of an accumulator combined as ``how`` says."""
        return a + b if how == "add" else (jnp.maximum(a, b) if how == "max" else jnp.minimum(a, b))

    def initial(self, invals: dict) -> tuple[dict, dict]:
        """The scans' initial states (read from ``invals``) and the accumulators' identities."""
        states = {}
        for i in self.scan_ids:
            eqn = self.jaxpr.eqns[i]
            nc, nk = jx.scan_num_consts(eqn.params), jx.scan_num_carry(eqn.params)
            states[i] = [a.val if isinstance(a, jx.Literal) else invals[a] for a in eqn.invars[nc:nc + nk]]
        accs = {}
        for i in self.acc_ids:
            aval, how = self.jaxpr.eqns[i].outvars[0].aval, self.how(i)
            if how == "add":
                accs[i] = jnp.zeros(aval.shape, aval.dtype)
            else:
                big = jnp.inf if jnp.issubdtype(aval.dtype, jnp.inexact) else np.iinfo(aval.dtype).max
                accs[i] = jnp.full(aval.shape, -big if how == "max" else big, aval.dtype)
            if not self.manual:     # the type the chunks' partial results have (an explicit sharding)
                accs[i] = conform(accs[i], aval)
        return states, accs

    def finals(self, states: dict, accs: dict) -> list:
        """The region's final values (``region.finals``) from the last states and accumulators."""
        out = {}
        for i in self.scan_ids:
            out.update(zip(self.jaxpr.eqns[i].outvars[:len(states[i])], states[i]))
        for i in self.acc_ids:
            out[self.jaxpr.eqns[i].outvars[0]] = accs[i]
        return [out[v] for v in self.region.finals]

    def _chunk(self, invals: dict, states: dict, accs: dict, src_rows: Sequence, rows: int):
        region = self.region
        env = dict(invals)
        env.update(zip(region.sources, src_rows))
        states, accs = dict(states), dict(accs)

        def read(a):
            return a.val if isinstance(a, jx.Literal) else env[a]
        for i, eqn in zip(region.eqns, self.eqns):
            vals = [read(a) for a in eqn.invars]
            kind = region.kinds[i]
            if kind == "scan":
                p = eqn.params
                nc, nk = jx.scan_num_consts(p), jx.scan_num_carry(p)
                fun = adjoint_scan(body_function(p["jaxpr"], nc, nk, own_context=not self.manual), nc, nk, rows,
                                   rows, region.scans[i].form, guard=self.guard)
                outs = list(fun(*vals[:nc], *states[i], *vals[nc + nk:]))
                states[i] = outs[:nk]
                env.update(zip(eqn.outvars[nk:], outs[nk:]))
                continue
            params = _rows_params(eqn, rows)
            if self.manual:
                params = {k: (None if k in ("sharding", "out_sharding") else v)
                          for k, v in (eqn.params if params is None else params).items()}
                with at_source_of(eqn):
                    out = eqn.primitive.bind(*vals, **eqn.primitive.get_bind_params(params))
                outs = list(out) if eqn.primitive.multiple_results else [out]
            else:
                outs = bind_equation(eqn, vals, params)
            if kind == "acc":
                accs[i] = self.combine(self.how(i), accs[i], outs[0])
            else:
                env.update(zip(eqn.outvars, outs))
        return states, accs, [env[v] for v in region.rows_out]

    @staticmethod
    def blocks(srcs: Sequence, length: int, k: int) -> tuple[list, list]:
        """The sources' ``length`` rows as ``k``-row blocks (``[n, k, ...]``) and the rows after them."""
        n = length // k
        return ([s[:n * k].reshape((n, k) + s.shape[1:]) for s in srcs] if n else [],
                [s[n * k:] for s in srcs] if length % k else [])

    def run(self, invals: dict, states: dict, accs: dict, srcs: Sequence, length: int,
            k: int, groups: int = 1) -> tuple[dict, dict, list]:
        """``length`` rows of the sources (``srcs``) run ``k`` rows at a time from ``states`` and
        ``accs``: a ``lax.scan`` over chunks, its body under ``jax.checkpoint``, a last partial chunk
        after it. Returns the last states, the accumulators and the ``rows_out`` rows. With
        ``groups > 1`` (:func:`nested_groups`) the chunks run in groups, each group's scan under
        ``jax.checkpoint`` too: JAX keeps the states at group boundaries and, in the backward pass,
        recomputes a group's chunk states from them (one more forward pass)."""
        return self.run_blocks(invals, states, accs, *self.blocks(srcs, length, k), length, k, groups)

    def run_blocks(self, invals: dict, states: dict, accs: dict, blocks: Sequence, tails: Sequence,
                   length: int, k: int, groups: int = 1) -> tuple[dict, dict, list]:
        """:meth:`run` on sources already split by :meth:`blocks` (a region may have none: a
        recurrence with no inputs per step)."""
        n, r = divmod(length, k)
        pieces = []
        if n:
            @jax.checkpoint
            def body(carry, src_rows):
                st, ac = carry
                st, ac, ys = self._chunk(invals, st, ac, src_rows, k)
                return (st, ac), ys

            def chunks(carry, blocks_, count):
                return lax.scan(body, carry, list(blocks_), length=count)
            per, left = divmod(n, groups) if groups > 1 else (n, 0)
            if groups > 1:
                grouped = [b[:groups * per].reshape((groups, per) + b.shape[1:]) for b in blocks]
                carry, ys = lax.scan(jax.checkpoint(lambda c, g: chunks(c, g, per)), (states, accs), grouped,
                                     length=groups)
                ys = [y.reshape((groups * per,) + y.shape[2:]) for y in ys]
                if left:
                    carry, rest = chunks(carry, [b[groups * per:] for b in blocks], left)
                    ys = [jnp.concatenate([y, z]) for y, z in zip(ys, rest)]
                (states, accs) = carry
            else:
                (states, accs), ys = chunks((states, accs), blocks, n)
            pieces.append([y.reshape((n * k,) + y.shape[2:]) for y in ys])
        if r:
            last = jax.checkpoint(lambda st, ac, rows_: self._chunk(invals, st, ac, rows_, r))
            states, accs, ys = last(states, accs, list(tails))
            pieces.append(list(ys))
        rows_out = [t[0] if len(t) == 1 else jnp.concatenate(t, 0) for t in zip(*pieces)]
        return states, accs, rows_out


def chunked_region(jaxpr: jx.Jaxpr, region: Region, k: int, guard: Callable,
                   groups: int = 1) -> Callable[..., list]:
    """``build(*sources, *invariants) -> [*rows_out, *finals]``: the region run ``k`` rows at a time
    (a ``lax.scan`` over chunks, its body under ``jax.checkpoint``, a last partial chunk after it;
    ``groups``: see :meth:`RegionRunner.run`)."""
    runner = RegionRunner(jaxpr, region, guard)

    def build(*vals):
        srcs = list(vals[:len(region.sources)])
        invals = dict(zip(region.invariants, vals[len(region.sources):]))
        states, accs = runner.initial(invals)
        states, accs, rows_out = runner.run(invals, states, accs, srcs, region.length, k, groups)
        return rows_out + runner.finals(states, accs)
    return build
