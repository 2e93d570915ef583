"""Optimal checkpointing of a chain under a byte budget, by dynamic programming.

The chain: stages ``0 .. N-1``; stage ``l`` runs from boundary ``l`` to
boundary ``l + 1``. Its forward pass costs ``time[l]`` (seconds), leaves
``residual[l]`` bytes for its backward pass when it is *stored*, and
``extra[l]`` bytes more when a recomputed block follows it, whose entry is
the value at its end boundary (the part of that value that is not a
residual). ``cut[b]`` is the bytes of the values a recomputation must start
from at boundary ``b``. The value at boundary 0 is held by the caller.

A schedule of the sub-chain ``(i, j]`` (boundary ``i`` held) is a list of
items covering stages ``i .. j-1`` in order:

* :class:`Stored` ``(l)``: stage ``l`` runs once and keeps its residuals
  until its backward pass;
* :class:`Block` ``(i, k, inner)``: stages ``i .. k-1`` run without keeping
  anything but the boundary value ``k`` (``cut[k]`` bytes, held until the
  items after the block have run their backward passes); then, for the
  block's own backward pass, the block runs again from boundary ``i`` under
  the schedule ``inner`` (a recomputation, which may nest further blocks).

This is the recursion of Feng's generalisation of Gruslys et al.'s
checkpointing DP to arbitrary per-stage costs (seed 004, with the
corrections of ``notes/beyond.md``): ``C(i, j, m)`` is the least forward
compute that runs the backward pass of ``(i, j]`` within ``m`` bytes, and a
second table tracks the peak the chosen schedule really needs,

    C(i, j, m) = min( time[i] + C(i+1, j, m - r_i)                       store stage i
                      min_k T(i, k) + C(k, j, m - cut[k]) + C'(i, k, m) )  block (i, k]

with ``r_i = residual[i]``, plus ``extra[i]`` when ``C(i+1, j, ...)`` starts
with a block (two tables: schedules starting with a stored stage and with a
block), ``T`` the summed
forward times and ``C'`` one nesting level shallower (``depth`` bounds the
nesting: 1 is a single level of recomputation, as a checkpointed scan emits).
Memory is counted in buckets (sizes rounded up, the budget down), so a
schedule found within a budget fits it; :func:`simulate` replays a schedule
action by action and is checked against the tables and against brute force
in the tests.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

INF = math.inf


@dataclasses.dataclass(frozen=True)
class Stored:
    """Stage ``stage`` runs once and keeps its residuals."""

    stage: int


@dataclasses.dataclass(frozen=True)
class Block:
    """Stages ``start .. end-1`` run without keeping their residuals and run again, under
    ``inner``, for their backward pass (from the values at boundary ``start``)."""

    start: int
    end: int
    inner: tuple


@dataclasses.dataclass(frozen=True)
class Chain:
    """Per-stage costs of a chain (see the module docstring); sizes in bytes, times in seconds."""

    time: tuple[float, ...]
    residual: tuple[int, ...]
    extra: tuple[int, ...]
    cut: tuple[int, ...]                    # length N + 1; cut[0] and cut[N] are unused
    recomputable: tuple[bool, ...] = ()     # per stage; default all

    def __post_init__(self):
        n = len(self.time)
        if len(self.residual) != n or len(self.extra) != n or len(self.cut) != n + 1:
            raise ValueError("chain arrays have inconsistent lengths")
        if self.recomputable and len(self.recomputable) != n:
            raise ValueError("recomputable needs one entry per stage")

    @property
    def n(self) -> int:
        return len(self.time)

    def can_recompute(self, stage: int) -> bool:
        return not self.recomputable or self.recomputable[stage]


@dataclasses.dataclass(frozen=True)
class Solution:
    """The schedule chosen for a budget, its forward compute and its peak (bytes, as simulated)."""

    items: tuple
    compute: float          # all forward runs, the first one included
    extra_compute: float    # compute - one forward pass
    peak: int               # bytes: residuals and kept boundary values at the worst moment
    budget: int

    def recomputed_stages(self) -> list[int]:
        """Stages that run more than once."""
        out: list[int] = []

        def walk(items, inside):
            for item in items:
                if isinstance(item, Stored):
                    if inside:
                        out.append(item.stage)
                else:
                    walk(item.inner, True)
        walk(self.items, False)
        return sorted(set(out))


def simulate(chain: Chain, items: Sequence, start: int = 0) -> tuple[float, int]:
    """``(forward compute, peak bytes)`` of running ``items`` (a schedule of ``(start, ...]``),
    replayed action by action: allocations and frees of residuals and kept boundary values."""
    live = 0
    peak = 0
    compute = 0.0

    def alloc(nbytes):
        nonlocal live, peak
        live += nbytes
        peak = max(peak, live)

    def run(items, first):
        """Forward through ``items`` keeping what they keep, then backward through them."""
        nonlocal live, compute
        if not items:
            return
        head, rest = items[0], items[1:]
        if isinstance(head, Stored):
            compute += chain.time[head.stage]
            before_block = bool(rest) and isinstance(rest[0], Block)
            keep = chain.residual[head.stage] + (chain.extra[head.stage] if before_block else 0)
            alloc(keep)
            run(rest, head.stage + 1)
            live -= keep                                   # its backward pass frees them
            return
        compute += sum(chain.time[head.start:head.end])   # forward, nothing kept
        keep = chain.cut[head.end] if rest else 0
        alloc(keep)
        run(rest, head.end)
        live -= keep
        run(list(head.inner), head.start)                 # the recomputation, for its backward pass

    run(list(items), start)
    return compute, peak


def check_schedule(chain: Chain, items: Sequence, start: int = 0, end: int | None = None) -> None:
    """Raise ``ValueError`` unless ``items`` covers stages ``start .. end-1`` exactly, in order."""
    end = chain.n if end is None else end
    at = start
    for item in items:
        if isinstance(item, Stored):
            if item.stage != at:
                raise ValueError(f"stage {at} expected, got {item}")
            at += 1
        else:
            if item.start != at or not item.start < item.end <= end:
                raise ValueError(f"bad block {item} at {at}")
            check_schedule(chain, item.inner, item.start, item.end)
            at = item.end
    if at != end:
        raise ValueError(f"schedule ends at {at}, not {end}")


class Solver:
    """The DP tables for one chain, computed once for the largest budget; :meth:`solve` reads a
    schedule for any budget up to it. ``buckets`` memory buckets; ``depth`` levels of nesting;
    ``max_block``: the most stages a block may span (``None``: any); ``top_store=False``: every
    stage at the top level is recomputed (blocks only)."""

    def __init__(self, chain: Chain, max_budget: int, *, buckets: int = 128, depth: int = 3,
                 max_block: int | None = None, top_store: bool = True):
        self.chain = chain
        self.depth = max(0, int(depth))
        self.max_block = max_block
        self.top_store = top_store
        total = sum(chain.residual) + sum(chain.extra) + max(chain.cut, default=0)
        self.max_budget = int(max(1, min(max_budget, total)))
        self.quantum = max(1, -(-self.max_budget // buckets))
        self.size = self.max_budget // self.quantum
        self._fill()

    def _up(self, nbytes: int) -> int:
        return -(-int(nbytes) // self.quantum)

    def _fill(self) -> None:
        ch, n, q1 = self.chain, self.chain.n, self.size + 1
        res = np.array([self._up(r) for r in ch.residual], dtype=np.int64)
        keep = np.array([self._up(r + e) for r, e in zip(ch.residual, ch.extra)], dtype=np.int64)
        cut = np.array([self._up(c) for c in ch.cut], dtype=np.int64)
        times = np.array(ch.time, dtype=np.float64)
        prefix = np.concatenate([[0.0], np.cumsum(times)])
        bad = np.concatenate([[0], np.cumsum([0 if ch.can_recompute(l) else 1 for l in range(n)])])
        levels = self.depth + 1
        shape = (levels, n + 1, n + 1, q1)
        # [d, i, j, m]: the least compute of (i, j] within m whose first item is Stored(i) ("s") or a
        # block (i, k] ("b", k in block_end); cost: the smaller of the two. Peaks need no table:
        # a budget row is infinite where nothing fits, and simulate() replays the schedule found.
        cost_s = np.full(shape, INF, dtype=np.float32)
        cost_b = np.full(shape, INF, dtype=np.float32)
        block_end = np.full(shape, -1, dtype=np.int16 if n < 2 ** 15 else np.int32)
        cost = np.full(shape, INF, dtype=np.float32)
        # the same rows shifted by the cut a block keeps at their start, indexed [d, j, k]: the
        # cost of the continuation (k, j] when the block before it keeps cut[k] out of m
        shifted = np.full(shape, INF, dtype=np.float32)

        def shifted_rows(rows, w):
            """``rows[a, m - w[a]]`` (``INF`` where ``m < w[a]``): rows [A, q1], w [A]."""
            idx = np.arange(q1)[None, :] - w[:, None]
            out = np.take_along_axis(rows, np.maximum(idx, 0), axis=1)
            return np.where(idx >= 0, out, INF)

        def better(a, b):
            return a < b * (1 - 1e-6) - 1e-12

        for i in range(n + 1):
            cost[:, i, i, :] = 0.0
            cost_s[:, i, i, :] = 0.0
        for length in range(1, n + 1):
            I = np.arange(0, n - length + 1)
            J = I + length
            for d in range(levels):
                if self.top_store or d < self.depth or self.depth == 0:
                    if length == 1:
                        cs = shifted_rows(np.broadcast_to(times[I][:, None], (I.size, q1)), res[I])
                    else:
                        # the stage's end value is kept beyond its residuals only for a block after it
                        after_s = times[I][:, None] + shifted_rows(cost_s[d, I + 1, J], res[I])
                        after_b = times[I][:, None] + shifted_rows(cost_b[d, I + 1, J], keep[I])
                        cs = np.minimum(after_s, after_b)
                    cost_s[d, I, J] = cs
                if d > 0:
                    best = np.full((I.size, q1), INF, dtype=np.float32)
                    best_k = np.full((I.size, q1), -1, dtype=block_end.dtype)
                    widest = length - 1 if self.max_block is None else min(length - 1, self.max_block)
                    if widest >= 1:   # blocks (i, i + r] followed by (i + r, j]
                        K = I[:, None] + np.arange(1, widest + 1)[None, :]             # [A, R]
                        total = ((prefix[K] - prefix[I][:, None])[:, :, None].astype(np.float32)
                                 + shifted[d, J[:, None], K] + cost[d - 1, I[:, None], K])
                        total[bad[K] != bad[I][:, None]] = INF                        # a block must be recomputable
                        arg = np.argmin(total, axis=1)                                # [A, q1]
                        best = np.take_along_axis(total, arg[:, None, :], axis=1)[:, 0, :]
                        best_k = np.take_along_axis(K, arg, axis=1).astype(block_end.dtype)
                    if not self.top_store and d == self.depth and (self.max_block is None or length <= self.max_block):
                        # a block (i, j] that ends the chain keeps no cut
                        whole = (prefix[J] - prefix[I])[:, None].astype(np.float32) + cost[d - 1, I, J]
                        whole[bad[J] != bad[I]] = INF
                        take = better(whole, best)
                        best = np.where(take, whole, best)
                        best_k = np.where(take, J[:, None], best_k).astype(block_end.dtype)
                    cost_b[d, I, J], block_end[d, I, J] = best, best_k
                cost[d, I, J] = np.where(better(cost_b[d, I, J], cost_s[d, I, J]), cost_b[d, I, J], cost_s[d, I, J])
                shifted[d, J, I] = shifted_rows(cost[d, I, J], cut[I])
        self._cost = cost
        self._cost_s, self._cost_b, self._block_end = cost_s, cost_b, block_end
        self._res, self._keep = res, keep

    def min_budget(self) -> int | None:
        """The smallest budget (bytes, a bucket multiple) for which some schedule exists, or ``None``."""
        row = self._cost[self.depth, 0, self.chain.n]
        finite = np.nonzero(np.isfinite(row))[0]
        return None if finite.size == 0 else int(finite[0]) * self.quantum

    def solve(self, budget: int) -> Solution | None:
        """The least-compute schedule within ``budget`` bytes, or ``None`` when none fits."""
        bucket = min(self.size, max(0, int(budget) // self.quantum))
        n = self.chain.n
        if not math.isfinite(self._cost[self.depth, 0, n, bucket]):
            return None
        items = tuple(self._items(self.depth, 0, n, bucket))
        compute, peak = simulate(self.chain, items)
        return Solution(items=items, compute=compute, extra_compute=compute - sum(self.chain.time),
                        peak=peak, budget=int(budget))

    def _items(self, d: int, i: int, j: int, m: int, first: str | None = None) -> list:
        out: list = []
        while i < j:
            if first is None:
                first = "b" if self._cost_b[d, i, j, m] < self._cost_s[d, i, j, m] * (1 - 1e-6) - 1e-12 else "s"
            if first == "s":
                out.append(Stored(i))
                if i + 1 < j:
                    after_s = self._cost_s[d, i + 1, j, m - self._res[i]] if m >= self._res[i] else INF
                    after_b = self._cost_b[d, i + 1, j, m - self._keep[i]] if m >= self._keep[i] else INF
                    first = "b" if after_b < after_s else "s"
                    m -= int(self._keep[i] if first == "b" else self._res[i])
                i += 1
                continue
            k = int(self._block_end[d, i, j, m])
            out.append(Block(i, k, tuple(self._items(d - 1, i, k, m))))
            m -= self._up(self.chain.cut[k]) if k < j else 0
            i, first = k, None
        return out


def solve(chain: Chain, budget: int, *, buckets: int = 128, depth: int = 3,
          max_block: int | None = None) -> Solution | None:
    """One-off :meth:`Solver.solve`."""
    return Solver(chain, budget, buckets=buckets, depth=depth, max_block=max_block).solve(budget)


def group(chain: Chain, size: int) -> Chain:
    """The chain with every ``size`` consecutive stages merged into one (for long uniform chains)."""
    n = chain.n
    starts = list(range(0, n, size))
    ends = starts[1:] + [n]
    return Chain(time=tuple(sum(chain.time[a:b]) for a, b in zip(starts, ends)),
                 residual=tuple(sum(chain.residual[a:b]) for a, b in zip(starts, ends)),
                 extra=tuple(chain.extra[b - 1] for b in ends),
                 cut=tuple(chain.cut[b] for b in [0] + ends),
                 recomputable=tuple(all(chain.can_recompute(l) for l in range(a, b)) for a, b in zip(starts, ends)))
