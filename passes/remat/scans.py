"""Checkpointed scans: a scan over layers keeps only every k-th carry, and recomputes the rest.

A schedule for a scan of ``n`` steps (from the DP of :mod:`.schedule`, one
level of recomputation, over stages of ``group`` steps) becomes a list of
:class:`Segment` s in execution order: runs of steps whose stacked
residuals are kept as they were, and runs of blocks of ``k`` steps of which
only the carry entering each block is kept.

:class:`PairPlan` rewrites the two scans of a differentiated program (``jax.grad``
inside the hlopass function): the forward scan becomes, per segment, a scan
that keeps the residual stacks, or an outer scan over blocks whose inner
scan drops them and whose outer outputs are the block-entry carries; the
transposed scan becomes, per segment in reverse, either its own body over
the kept stacks or an outer scan over blocks whose body first recomputes
the block's residual stacks from its carry (an inner forward scan) and then
runs the transposed body over them. Steps read their ``xs`` by index from the
original arrays (no sliced copies). The recomputation sits inside the
backward loop's body, a computation of its own, so XLA cannot merge it with
the forward scan nor hoist it out of its iteration.

:func:`checkpointed_scan` does the same before differentiation (``jax.grad``
of a hlopass function): the forward scan becomes a scan that keeps its
residuals, then an outer scan whose body is a :func:`.gate.remat_block` of
an inner scan of ``k`` steps, and JAX differentiates that.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
from jax import lax
from hlopass import internals as jx

from .gate import remat_block
from .schedule import Block, Stored


@dataclasses.dataclass(frozen=True)
class Segment:
    """Steps ``start .. stop-1`` (execution positions) kept (``block == 0``) or recomputed in blocks
    of ``block`` steps."""

    start: int
    stop: int
    block: int = 0

    def indices(self, n: int, reverse: bool) -> tuple[int, int]:
        """The range of array indices the segment's steps read and write."""
        return (n - self.stop, n - self.start) if reverse else (self.start, self.stop)

    @property
    def count(self) -> int:
        return (self.stop - self.start) // self.block if self.block else 0


def segments(items: Sequence, group: int, n: int) -> list[Segment]:
    """Top-level schedule items over stages of ``group`` steps -> segments (runs of kept steps;
    runs of equally long blocks)."""
    out: list[Segment] = []
    for item in items:
        if isinstance(item, Stored):
            start, stop, block = item.stage * group, min(n, (item.stage + 1) * group), 0
        elif isinstance(item, Block):
            if any(not isinstance(i, Stored) for i in item.inner):
                raise ValueError("a scan schedule has one level of recomputation")
            start, stop = item.start * group, min(n, item.end * group)
            block = stop - start
        else:
            raise TypeError(item)
        last = out[-1] if out else None
        if last is not None and last.stop == start and last.block == block:
            out[-1] = Segment(last.start, stop, block)
        else:
            out.append(Segment(start, stop, block))
    return out


def block_lengths(n: int, max_stages: int, count: int = 24) -> list[int]:
    """Candidate block lengths for a scan of ``n`` steps: all of them for short scans, else a
    geometric grid from ``n / max_stages`` (at most ``max_stages`` blocks) to ``n``."""
    if n <= max_stages:
        return list(range(1, n + 1))
    low = -(-n // max_stages)
    grid = {int(round(low * (n / low) ** (i / (count - 1)))) for i in range(count)}
    return sorted(k for k in grid if 1 <= k <= n)


def _index(stack, t):
    return lax.dynamic_index_in_dim(stack, t, 0, keepdims=False)


def _concat(parts: list[tuple[int, object]]):
    parts = sorted(parts, key=lambda p: p[0])
    return parts[0][1] if len(parts) == 1 else lax.concatenate([p[1] for p in parts], 0)


def _merge(stack, count: int, k: int):
    return lax.reshape(stack, (count * k, *stack.shape[2:]))


class _Outputs:
    """The stacked per-step outputs of a scan run as several segments: with one segment, the
    scans' own stacking; with more, buffers of the full length carried through every segment's
    loops and written in place at each step's index (no concatenation copies)."""

    def __init__(self, avals, n: int, segments: int):
        self.buffered = segments > 1
        self.avals = list(avals)
        self.parts: list[list] = [[] for _ in self.avals]
        self.buffers = [jnp.zeros((n, *a.shape), a.dtype) for a in self.avals] if self.buffered else []

    def wrap(self, step):
        """``step(carry, t) -> (carry, ys)`` as the step of a scan whose carry also holds the buffers."""
        if not self.buffered:
            return step

        def buffered(state, t):
            carry, buffers = state
            carry, ys = step(carry, t)
            buffers = [lax.dynamic_update_index_in_dim(b, y, t, 0) for b, y in zip(buffers, ys)]
            return (carry, buffers), []
        return buffered

    def init(self, carry):
        return (carry, self.buffers) if self.buffered else carry

    def finish(self, state, ys, start: int, merge=None):
        """Record one segment's result; returns its carry."""
        if self.buffered:
            carry, self.buffers = state
            return carry
        for part, y in zip(self.parts, ys):
            part.append((start, y if merge is None else merge(y)))
        return state

    def result(self) -> list:
        return list(self.buffers) if self.buffered else [_concat(p) for p in self.parts]


class PairPlan:
    """The rewrite of one forward/transposed scan pair (see the module docstring)."""

    def __init__(self, residual_ys: Sequence[int], backward_xs: dict[int, Sequence[int]],
                 plan: list[Segment], used: set | None = None):
        self.residual_ys = tuple(residual_ys)
        self.backward_xs = {pos: y for y, poss in backward_xs.items() for pos in poss}
        self.plan = plan
        self.used = used              # the program's values that something reads (None: all)
        self.kept: dict[Segment, object] = {}
        self.forward_inputs = None

    def _step(self, params, consts, xs, want):
        body = jx.jaxpr_as_fun(params["jaxpr"])
        ncar = jx.scan_num_carry(params)

        def step(carry, t):
            out = body(*consts, *carry, *[_index(x, t) for x in xs])
            return list(out[:ncar]), [out[ncar + y] for y in want]
        return step

    # -- the forward scan ------------------------------------------------------------------------
    def forward(self, eqn, invals) -> list:
        p = eqn.params
        ncon, ncar, n, rev = jx.scan_num_consts(p), jx.scan_num_carry(p), p["length"], p["reverse"]
        consts, carry, xs = invals[:ncon], list(invals[ncon:ncon + ncar]), invals[ncon + ncar:]
        self.forward_inputs = (p, consts, xs)
        nys = len(eqn.outvars) - ncar
        others = [y for y in range(nys) if y not in self.residual_ys and self._read(eqn.outvars[ncar + y])]
        ys_avals = p["jaxpr"].out_avals[ncar:]
        outputs = _Outputs([ys_avals[y] for y in others], n, len(self.plan))
        for seg in self.plan:
            t0, t1 = seg.indices(n, rev)
            if not seg.block:
                # the residual stacks are this scan's own outputs; the other ys go through ``outputs``
                step, m = self._step(p, consts, xs, others + list(self.residual_ys)), len(others)

                def kept_step(state, t, step=step, m=m):
                    if not outputs.buffered:
                        return step(state, t)
                    carry, buffers = state
                    carry, ys = step(carry, t)
                    buffers = [lax.dynamic_update_index_in_dim(b, y, t, 0) for b, y in zip(buffers, ys[:m])]
                    return (carry, buffers), ys[m:]
                state, ys = lax.scan(kept_step, outputs.init(carry), jnp.arange(t0, t1, dtype=jnp.int32),
                                     reverse=rev)
                residual, other = (ys, []) if outputs.buffered else (ys[m:], ys[:m])
                self.kept[seg] = dict(zip(self.residual_ys, residual))
                carry = outputs.finish(state, other, t0)
                continue
            k, count = seg.block, seg.count
            step = outputs.wrap(self._step(p, consts, xs, others))

            def outer(state, b, step=step, t0=t0, k=k):
                base = t0 + b * k
                entry = state[0] if outputs.buffered else state
                state, ys = lax.scan(lambda cc, j: step(cc, base + j), state, jnp.arange(k, dtype=jnp.int32),
                                     reverse=rev)
                return state, (entry, ys)
            state, (entries, ys) = lax.scan(outer, outputs.init(carry), jnp.arange(count, dtype=jnp.int32),
                                            reverse=rev)
            self.kept[seg] = entries
            carry = outputs.finish(state, ys, t0, merge=lambda y, count=count, k=k: _merge(y, count, k))
        ys = iter(outputs.result())
        return list(carry) + [next(ys) if y in others else None for y in range(nys)]

    # -- the transposed scan -------------------------------------------------------------------------
    def backward(self, eqn, invals) -> list:
        p = eqn.params
        ncon, ncar, n, rev = jx.scan_num_consts(p), jx.scan_num_carry(p), p["length"], p["reverse"]
        consts, carry, xs = invals[:ncon], list(invals[ncon:ncon + ncar]), invals[ncon + ncar:]
        body = jx.jaxpr_as_fun(p["jaxpr"])
        fp, fconsts, fxs = self.forward_inputs
        nys = len(eqn.outvars) - ncar
        wanted = [y for y in range(nys) if self._read(eqn.outvars[ncar + y])]
        outputs = _Outputs([p["jaxpr"].out_avals[ncar + y] for y in wanted], n, len(self.plan))

        def bstep(c, t, stacks, offset):
            x = [_index(stacks[self.backward_xs[q]], t - offset) if q in self.backward_xs else _index(xq, t)
                 for q, xq in enumerate(xs)]
            out = body(*consts, *c, *x)
            return list(out[:ncar]), [out[ncar + y] for y in wanted]

        for seg in reversed(self.plan):
            t0, t1 = seg.indices(n, not rev)
            if not seg.block:
                step = outputs.wrap(lambda c, t, stacks=self.kept[seg], t0=t0: bstep(c, t, stacks, t0))
                state, ys = lax.scan(step, outputs.init(carry), jnp.arange(t0, t1, dtype=jnp.int32), reverse=rev)
                carry = outputs.finish(state, ys, t0)
                continue
            k, count = seg.block, seg.count
            fstep = self._step(fp, fconsts, fxs, list(self.residual_ys))

            def outer(state, bx, t0=t0, k=k, fstep=fstep):
                b, entry = bx
                base = t0 + b * k
                _, recomputed = lax.scan(lambda cc, j: fstep(cc, base + j), entry,
                                         jnp.arange(k, dtype=jnp.int32), reverse=not rev)
                stacks = dict(zip(self.residual_ys, recomputed))
                step = outputs.wrap(lambda cc, t: bstep(cc, t, stacks, base))
                return lax.scan(lambda cc, j: step(cc, base + j), state, jnp.arange(k, dtype=jnp.int32),
                                reverse=rev)
            state, ys = lax.scan(outer, outputs.init(carry), (jnp.arange(count, dtype=jnp.int32), self.kept[seg]),
                                 reverse=rev)
            carry = outputs.finish(state, ys, t0, merge=lambda y, count=count, k=k: _merge(y, count, k))
        ys = dict(zip(wanted, outputs.result()))
        return list(carry) + [ys.get(y) for y in range(nys)]

    def _read(self, var) -> bool:
        return self.used is None or var in self.used


def checkpointed_scan(eqn, invals, plan: list[Segment]) -> list:
    """A primal ``scan`` equation evaluated under ``plan``, before differentiation: kept segments
    as plain scans, blocked segments as an outer scan over :func:`.gate.remat_block` s of an inner
    scan of ``block`` steps (its carry is all a block keeps)."""
    p = eqn.params
    ncon, ncar, n, rev = jx.scan_num_consts(p), jx.scan_num_carry(p), p["length"], p["reverse"]
    consts, carry, xs = list(invals[:ncon]), list(invals[ncon:ncon + ncar]), list(invals[ncon + ncar:])
    body = jx.jaxpr_as_fun(p["jaxpr"])
    nys = len(eqn.outvars) - ncar

    def step(c, x):
        out = body(*consts, *c, *x)
        return list(out[:ncar]), list(out[ncar:])

    parts: list[list] = [[] for _ in range(nys)]
    for seg in plan:
        t0, t1 = seg.indices(n, rev)
        seg_xs = [lax.slice_in_dim(x, t0, t1) for x in xs] if (t0, t1) != (0, n) else xs
        if not seg.block:
            carry, ys = lax.scan(step, carry, seg_xs, reverse=rev)
            for y in range(nys):
                parts[y].append((t0, ys[y]))
            continue
        k, count = seg.block, seg.count
        nx = len(seg_xs)
        # the block keeps its carry and its index; its xs are sliced again from a copy of the
        # segment's xs that gradients do not flow through (loop-invariant: JAX hoists it out of
        # the loop instead of stacking every block's slice)
        whole = [lax.stop_gradient(x) for x in seg_xs]

        def inner(*args, k=k):
            c2, ys = lax.scan(step, list(args[:ncar]), list(args[ncar + 1:ncar + 1 + nx]), reverse=rev)
            return [*c2, *ys]

        def keep(args, k=k):
            return (*args[:ncar], args[ncar], *args[ncar + 1 + nx:])

        def restore(kept, k=k):
            carry_, b, full = kept[:ncar], kept[ncar], kept[ncar + 1:]
            return [*carry_, b, *[lax.dynamic_slice_in_dim(x, b * k, k) for x in full], *full]

        block = remat_block(inner, keep=keep, restore=restore,
                            nondiff=[False] * ncar + [True] + [False] * nx + [True] * nx)

        def outer(c, bx, block=block, whole=whole):
            b, xb = bx[0], bx[1:]
            out = block(*c, b, *xb, *whole)
            return list(out[:ncar]), list(out[ncar:])
        blocked = [lax.reshape(x, (count, k, *x.shape[1:])) for x in seg_xs]
        carry, ys = lax.scan(outer, carry, [jnp.arange(count, dtype=jnp.int32), *blocked], reverse=rev)
        for y in range(nys):
            parts[y].append((t0, _merge(ys[y], count, k)))
    return list(carry) + [_concat(parts[y]) for y in range(nys)]
