"""Optimal checkpointing of a chain under a byte budget, by dynamic programming.

The chain: stages ``0 .. N-1``; stage ``l`` runs from boundary ``l`` to
boundary ``l + 1``. Its forward pass costs ``time[l]`` (seconds), leaves
``residual[l]`` bytes for its backward pass when it is *stored*, and
``extra[l]`` bytes more when the value at its end boundary must be kept for
a later recomputation (the part of that boundary's values that is not a
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

with ``r_i = residual[i] (+ extra[i] unless j = i + 1)``, ``T`` the summed
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
            keep = chain.residual[head.stage] + (chain.extra[head.stage] if rest else 0)
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
        cost = np.full((levels, n + 1, n + 1, q1), INF)
        peak = np.zeros((levels, n + 1, n + 1, q1), dtype=np.int32)
        choice = np.full((levels, n + 1, n + 1, q1), -1, dtype=np.int32)  # -1 store, k block (i, k]
        # the same rows shifted by the cut a block keeps at their start, indexed [d, j, k]: the
        # cost of the continuation (k, j] when the block before it keeps cut[k] out of m
        shifted = np.full((levels, n + 1, n + 1, q1), INF)
        shifted_peak = np.zeros((levels, n + 1, n + 1, q1), dtype=np.int32)

        def finish(d, i, j):
            w = int(cut[i])
            if w < q1:
                shifted[d, j, i, w:] = cost[d, i, j, :q1 - w]
                shifted_peak[d, j, i, w:] = w + peak[d, i, j, :q1 - w]

        for i in range(n + 1):
            cost[:, i, i, :] = 0.0
        cols = np.arange(q1)
        for length in range(1, n + 1):
            for i in range(0, n - length + 1):
                j = i + length
                w = int(res[i] if j == i + 1 else keep[i])
                for d in range(levels):
                    best = np.full(q1, INF)
                    best_peak = np.zeros(q1, dtype=np.int32)
                    best_choice = np.full(q1, -1, dtype=np.int32)
                    if w < q1 and (self.top_store or d < self.depth or self.depth == 0):
                        best[w:] = times[i] + cost[d, i + 1, j, :q1 - w]
                        best_peak[w:] = w + peak[d, i + 1, j, :q1 - w]
                    if d > 0:
                        kend = j if self.max_block is None else min(j, i + 1 + self.max_block)
                        candidates = []
                        if kend > i + 1:      # blocks (i, k] followed by (k, j]
                            ks = slice(i + 1, kend)
                            total = (prefix[ks] - prefix[i])[:, None] + shifted[d, j, ks] + cost[d - 1, i, ks]
                            if bad[kend - 1] != bad[i]:
                                total[bad[ks] != bad[i]] = INF     # a block must be recomputable
                            arg = np.argmin(total, axis=0)
                            split_peak = np.maximum(shifted_peak[d, j, ks][arg, cols], peak[d - 1, i, ks][arg, cols])
                            candidates.append((total[arg, cols], split_peak, arg + i + 1))
                        last = not self.top_store and d == self.depth
                        if last and bad[j] == bad[i] and (self.max_block is None or length <= self.max_block):
                            # a block (i, j] that ends the chain keeps no cut
                            candidates.append((prefix[j] - prefix[i] + cost[d - 1, i, j], peak[d - 1, i, j],
                                               np.full(q1, j, dtype=np.int64)))
                        for split, split_peak, ks_arg in candidates:
                            better = split < best * (1 - 1e-9) - 1e-15
                            best = np.where(better, split, best)
                            best_peak = np.where(better, split_peak, best_peak)
                            best_choice = np.where(better, ks_arg, best_choice)
                    cost[d, i, j] = best
                    peak[d, i, j] = best_peak
                    choice[d, i, j] = best_choice
                    finish(d, i, j)
        self._cost, self._peak, self._choice = cost, peak, choice

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

    def _items(self, d: int, i: int, j: int, m: int) -> list:
        out: list = []
        while i < j:
            k = int(self._choice[d, i, j, m])
            if k < 0:
                res = self.chain.residual[i] + (self.chain.extra[i] if j > i + 1 else 0)
                out.append(Stored(i))
                m -= self._up(res)
                i += 1
            else:
                out.append(Block(i, k, tuple(self._items(d - 1, i, k, m))))
                m -= self._up(self.chain.cut[k]) if k < j else 0
                i = k
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
