"""Linear recurrences whose time axis is sharded over a mesh axis.

With ``AdjointPass(sequence_axis="x")`` and a mesh holding the axis ``"x"``
(``jax.set_mesh(mesh)``, or ``AdjointPass(mesh=mesh)``) of ``D`` devices, and
``T`` steps that ``D`` divides, device ``d`` holds rows ``[d T/D, (d+1) T/D)``
of the time axis. Without ``sequence_axis``, an ``Explicit`` mesh's types name
the axis (see ``rewrite._time_axis``).

A time region (:mod:`.stack`: stacked layers and the row-wise code between
them) becomes :func:`sharded_region`: each device runs its rows ``K`` at a
time, keeping its chunks' boundary states; the devices run one after the
other, because with stacked layers a device's incoming states depend on every
layer of the devices before it; the backward pass runs them in reverse, one set
of adjoint states crossing each device boundary. Per device, what is kept is
about ``sqrt(1/D)`` of one device's (boundary states and one chunk's working
set, each ``sqrt(T c s)``; ``c`` a step's state bytes, ``s`` its
intermediates) plus a ``D``-th of the rows; the time is one device's. Two
levels of checkpointing (``AdjointPass(levels=2)``) shrink the boundary states
to a few, for one more forward pass.

A diagonal (or complex diagonal) recurrence ``h_t = a_t * h_{t-1} + b_t``
outside any region becomes a ``shard_map`` of its own
(:func:`sharded_adjoint_scan`), and its devices run at once:

1. each runs its rows from the states 0 and 1 (one adjoint scan of its rows,
   batched over the two states): the end states ``e_d`` and ``e_d + M_d``, so
   its rows' map is ``h -> M_d * h + e_d`` (``M_d`` the product of its decays);
2. gathers every device's ``(M, e)`` (one ``all_gather``) and folds those of
   the devices before it onto the initial state: its incoming state;
3. runs its rows from that state as an adjoint scan (:mod:`.emit`: chunk
   carries kept, per-step VJPs batched per chunk).

JAX differentiates that ``shard_map``: each device takes its chunks' VJPs;
the transpose of the ``all_gather`` hands each device the adjoint state at
its end from the devices after it (one state per device boundary), and the
parameters' cotangents, computed per device, are summed by one ``psum`` per
parameter (the transpose of making them per-device values).

Leaves alone (one device's time region or adjoint scan instead): complex
recurrences in a region (XLA 0.10's CPU compiler fails on them in a
``shard_map``), dense recurrences outside a region (their ``M_d`` is a
matrix), lengths the devices do not divide, and a mesh without the axis; each
is said in the report.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from hlopass.sharding import conform

from .emit import adjoint_scan
from .stack import RegionRunner


def mesh_axis_size(mesh, axis: str) -> int | None:
    """Devices along ``axis`` of ``mesh`` (``None``: no such axis or no mesh)."""
    if mesh is None or getattr(mesh, "empty", False):
        return None
    return dict(mesh.shape).get(axis)


def context_mesh():
    """The mesh set with ``jax.set_mesh`` (``None`` when there is none)."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else mesh


def _broadcast_from(j, me, axis: str, tree):
    """Device ``j``'s ``tree`` on every device (a masked ``psum``)."""
    return jax.tree.map(lambda v: lax.psum(jnp.where(me == j, v, jnp.zeros_like(v)), axis), tree)


def _stages(order: Sequence[int], me, axis: str, work: Callable, passed, kept):
    """``work(passed, kept) -> (passed', kept')`` on one device at a time, devices in ``order``: at its
    stage a device works from the ``passed`` its predecessor produced (broadcast to all), the others
    pass their values through a ``lax.cond``; ``kept`` holds each device's own results (one carried
    buffer). Returns the last device's ``passed`` (on every device) and each device's ``kept``."""
    def stage(carry, j):
        passed, kept = carry
        out, kept = lax.cond(me == j, work, lambda p, k: (p, k), passed, kept)
        return (_broadcast_from(j, me, axis, out), kept), None
    (passed, kept), _ = lax.scan(stage, (passed, kept), jnp.asarray(order))
    return passed, kept


def _explicit(mesh, axis: str) -> bool:
    """Whether ``axis`` of ``mesh`` is an ``Explicit`` one (values carry their sharding in their type)."""
    types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()) or ()))
    return types.get(axis) == jax.sharding.AxisType.Explicit


def _zeros(shapes):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def sharded_adjoint_scan(step: Callable, num_consts: int, num_carry: int, num_xs: int, length: int, chunk: int,
                         form: str, mesh, axis: str, guard: Callable, out_avals: Sequence = ()) -> Callable:
    """``f(*consts, *init, *xs) -> (*carry, *ys)``: the scan of ``step`` with its time axis split over
    ``axis`` of ``mesh`` (see the module docstring); ``chunk`` is K within a device's rows. Under an
    ``Explicit`` axis the results are given the types of ``out_avals`` (the scan's outputs)."""
    nc, nk = num_consts, num_carry
    devices = mesh_axis_size(mesh, axis)
    rows = length // devices
    local = adjoint_scan(step, nc, nk, rows, max(1, min(chunk, rows)), form, guard=guard)

    def body(*args):
        consts = list(args[:nc])
        init = list(args[nc:nc + nk])
        xs = list(args[nc + nk:])
        # both runs at once: the rows' scan batched over the two initial states 0 and 1
        starts = [jnp.stack([jnp.zeros_like(h), jnp.ones_like(h)]) for h in init]
        both = jax.vmap(lambda *h: list(local(*consts, *h, *xs))[:nk])(*starts)
        e = [b[0] for b in both]
        m = [b[1] - b[0] for b in both]
        all_m = [lax.all_gather(v, axis) for v in m]
        all_e = [lax.all_gather(v, axis) for v in e]
        me = lax.axis_index(axis)
        h = list(init)
        for j in range(devices - 1):    # fold the devices before this one onto the initial state
            h = [jnp.where(j < me, mm[j] * hh + ee[j], hh) for mm, ee, hh in zip(all_m, all_e, h)]
        outs = list(local(*consts, *h, *xs))
        ends, ys = outs[:nk], outs[nk:]
        finals = [lax.psum(jnp.where(me == devices - 1, v, jnp.zeros_like(v)), axis) for v in ends]
        return (*finals, *ys)

    def f(*args):
        in_specs = (P(),) * (nc + nk) + (P(axis),) * num_xs
        out_avals = jax.eval_shape(lambda *a: step(list(a[:nc]), list(a[nc:nc + nk]),
                                                   [x[0] for x in a[nc + nk:]]), *args)
        out_specs = (P(),) * nk + (P(axis),) * len(out_avals[1])
        # the body is the user's jaxpr bound as written (no per-value axis types): unchecked, and the
        # cotangents of the replicated inputs (parameters, initial state) are summed over the axis
        if _explicit(mesh, axis):   # as in sharded_region
            args = [jax.sharding.reshard(a, spec) for a, spec in zip(args, in_specs)]
            outs = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)
            return tuple(conform(o, a) for o, a in zip(outs, out_avals)) + tuple(outs[len(out_avals):])
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)
    return f


def sharded_region(jaxpr, region, chunk: int, guard: Callable, mesh, axis: str,
                   groups: int = 1) -> Callable[..., list]:
    """``build(*sources, *invariants) -> [*rows_out, *finals]``: a time region (:mod:`.stack`) whose
    ``T`` rows are split over ``axis`` of ``mesh``, each device running its ``T/D`` rows ``chunk`` at
    a time (:class:`.stack.RegionRunner`).

    Stacked layers make a device's incoming states depend on every layer of the devices before it,
    so the devices run one after the other (:func:`_stages`): device ``j`` runs its rows from the
    states device ``j-1`` ended with and keeps its VJP's residuals (its chunks' boundary states and
    its inputs: a ``D``-th of one device's). The backward pass (a ``jax.custom_vjp``) runs the
    devices in reverse: device ``j`` applies its VJP to the cotangents of its rows and of its end
    states, those from device ``j+1``, and hands device ``j-1`` the cotangents of its incoming
    states: one set of adjoint states per device boundary. The parameters' cotangents are summed
    over the devices (the ``shard_map``'s transpose); the accumulators' partial results (a loss's
    sum over time) are gathered and combined once. ``groups > 1``: two levels of checkpointing in
    each device's rows (:meth:`.stack.RegionRunner.run`), so that its VJP keeps the states at group
    boundaries only.
    """
    devices = mesh_axis_size(mesh, axis)
    rows = region.length // devices
    runner = RegionRunner(jaxpr, region, guard, manual=True)
    ns = len(region.sources)
    forward_order, backward_order = list(range(devices)), list(range(devices - 1, -1, -1))

    def body(*args):
        # the sources enter as k-row blocks, so that the residuals holding them are the inputs themselves
        blocks, tails = runner.blocks(list(args[:ns]), rows, chunk)
        args = [*blocks, *tails, *args[ns:]]
        nb, nt = len(blocks), len(tails)
        inexact = [jnp.issubdtype(jnp.result_type(a), jnp.inexact) for a in args]

        def every(diff, fixed):
            it_d, it_f = iter(diff), iter(fixed)
            return [next(it_d) if d else next(it_f) for d in inexact]

        def local(start, diff, fixed):
            vals = every(diff, fixed)
            invals = dict(zip(region.invariants, vals[nb + nt:]))
            return runner.run_blocks(invals, start, runner.initial(invals)[1], vals[:nb], vals[nb:nb + nt],
                                     rows, chunk, groups)

        def primal(start, diff, fixed):
            shapes = jax.eval_shape(local, start, diff, fixed)

            def work(st, kept):
                ends, accs, rows_out = local(st, diff, fixed)
                return ends, (accs, rows_out)
            finals, (accs, rows_out) = _stages(forward_order, lax.axis_index(axis), axis, work, start,
                                               _zeros(shapes[1:]))
            return finals, accs, rows_out

        treedef = {}

        def linearized(st, diff, fixed):
            with guard():       # this pass's own derivative: not one to rewrite
                outs, vjp = jax.vjp(lambda st, diff: local(st, diff, fixed), st, diff)
            leaves, treedef["vjp"] = jax.tree_util.tree_flatten(vjp)
            # residuals that are the inputs themselves are not copied into the kept buffer
            treedef["input"] = [next((n for n, d in enumerate(diff) if leaf is d), None) for leaf in leaves]
            return (*outs, [leaf for leaf, n in zip(leaves, treedef["input"]) if n is None])

        def staged_fwd(start, diff, fixed):
            shapes = jax.eval_shape(linearized, start, diff, fixed)

            def work(st, kept):
                ends, accs, rows_out, leaves = linearized(st, diff, fixed)
                return ends, (accs, rows_out, leaves)
            finals, (accs, rows_out, leaves) = _stages(forward_order, lax.axis_index(axis), axis, work, start,
                                                       _zeros(shapes[1:]))
            return (finals, accs, rows_out), (leaves, diff)

        def staged_bwd(res, cts):
            kept, diff = res
            me = lax.axis_index(axis)
            kept = iter(kept)
            leaves = [next(kept) if n is None else diff[n] for n in treedef["input"]]
            vjp = jax.tree_util.tree_unflatten(treedef["vjp"], leaves)
            ct_finals, ct_accs, ct_rows = cts
            # the final states are one value on every device: its cotangent is the devices' sum
            ct_end = jax.tree.map(lambda c: lax.psum(c, axis), ct_finals)

            def work(ct_end, kept):
                return vjp((ct_end, ct_accs, ct_rows))
            ct_start, ct_diff = _stages(backward_order, me, axis, work, ct_end, [jnp.zeros_like(d) for d in diff])
            # device 0 started from the initial states: the shard_map's transpose sums the devices' parts
            ct_init = jax.tree.map(lambda c: jnp.where(me == 0, c, jnp.zeros_like(c)), ct_start)
            return ct_init, ct_diff, None

        staged = jax.custom_vjp(primal)
        staged.defvjp(staged_fwd, staged_bwd)
        diff = [a for a, d in zip(args, inexact) if d]
        fixed = [a for a, d in zip(args, inexact) if not d]
        invals = dict(zip(region.invariants, args[nb + nt:]))
        states = runner.initial(invals)[0]
        start = {i: [jnp.asarray(v, o.aval.dtype) for v, o in zip(vs, jaxpr.eqns[i].outvars)]
                 for i, vs in states.items()}
        finals, accs, rows_out = staged(start, diff, fixed)
        totals = {}
        for i, a in accs.items():
            gathered = lax.all_gather(a, axis)
            how = runner.how(i)
            totals[i] = gathered.sum(0) if how == "add" else gathered.max(0) if how == "max" else gathered.min(0)
        return (*rows_out, *runner.finals(finals, totals))

    def build(*vals):
        in_specs = (P(axis),) * ns + (P(),) * len(region.invariants)
        out_specs = (P(axis),) * len(region.rows_out) + (P(),) * len(region.finals)
        explicit = _explicit(mesh, axis)
        if explicit:   # values typed with their shardings enter as the specs say, and leave as they were
            vals = [jax.sharding.reshard(v, spec) for v, spec in zip(vals, in_specs)]
        outs = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*vals)
        return [conform(o, v.aval) if explicit else o for o, v in zip(outs, region.rows_out + region.finals)]
    return build
