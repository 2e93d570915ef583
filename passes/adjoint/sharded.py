"""A diagonal linear recurrence whose time axis is sharded over a mesh axis: adjoint scans per device.

With ``AdjointPass(sequence_axis="x")`` and a mesh holding the axis ``"x"``
(``jax.set_mesh(mesh)``, or ``AdjointPass(mesh=mesh)``), a diagonal (or
complex diagonal) recurrence ``h_t = a_t * h_{t-1} + b_t`` over ``T`` steps
whose length the axis's ``D`` devices divide becomes a ``shard_map``
(:func:`sharded_adjoint_scan`): device ``d`` holds rows ``[d T/D, (d+1) T/D)``
of the scanned inputs and outputs and

1. runs its rows from the states 0 and 1 (one adjoint scan of its rows,
   batched over the two states): the end states ``e_d`` and ``e_d + M_d``, so
   its rows' map is ``h -> M_d * h + e_d`` (``M_d`` the product of its decays);
2. gathers every device's ``(M, e)`` (one ``all_gather``) and folds those of
   the devices before it onto the initial state: its incoming state;
3. runs its rows from that state as an adjoint scan (:mod:`.emit`: chunk
   carries kept, per-step VJPs batched per chunk).

JAX differentiates the ``shard_map``: each device takes its chunks' VJPs;
the transpose of the ``all_gather`` hands each device the adjoint state at
its end from the devices after it (one state per device boundary), and the
parameters' cotangents, computed per device, are summed by one ``psum`` per
parameter (the transpose of making them per-device values).

Leaves alone (the single-device adjoint scan instead): dense recurrences
(their ``M_d`` is a matrix), lengths the devices do not divide, and a mesh
without the axis; each is said in the report.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from .emit import adjoint_scan


def mesh_axis_size(mesh, axis: str) -> int | None:
    """Devices along ``axis`` of ``mesh`` (``None``: no such axis or no mesh)."""
    if mesh is None or getattr(mesh, "empty", False):
        return None
    return dict(mesh.shape).get(axis)


def context_mesh():
    """The mesh set with ``jax.set_mesh`` (``None`` when there is none)."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else mesh


def sharded_adjoint_scan(step: Callable, num_consts: int, num_carry: int, num_xs: int, length: int, chunk: int,
                         form: str, mesh, axis: str, guard: Callable) -> Callable:
    """``f(*consts, *init, *xs) -> (*carry, *ys)``: the scan of ``step`` with its time axis split over
    ``axis`` of ``mesh`` (see the module docstring); ``chunk`` is K within a device's rows."""
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
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)
    return f
