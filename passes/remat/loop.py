"""The closed loop: choose schedules, emit, compile, measure, adjust, until the program fits.

A program has one or more recomputation problems (a flat chain, checkpointed
scans: :class:`ChainProblem`, :class:`ScanProblem`). One number, the budget fraction
``λ``, sets every problem's byte budget to ``λ`` times what it keeps when it
recomputes nothing (never below the least budget it can meet). The loop
starts from the linear estimate ``footprint ≈ base + λ · kept`` (``base``:
the measured footprint less what the original program keeps), emits the
program for that ``λ``, compiles it and reads XLA's footprint; while it is
over the limit ``λ`` moves by the secant through the measurements (the
footprint XLA really pays per byte of the model is rarely 1: fusion
recomputes some residuals for free, the backward pass has temporaries of
its own); once under it, ``λ`` moves back up (less recomputation) while a
round is left and the margin is large. When no ``λ`` fits, the schedules
that keep least are tried last, and their footprint is the smallest found.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from hlopass import internals as jx

from .schedule import Chain, Solver, Stored, simulate


@dataclasses.dataclass(frozen=True)
class Choice:
    """A problem's schedule for one budget: ``items`` over stages of ``group`` steps."""

    items: tuple
    peak: int
    extra_compute: float
    group: int = 1


class ChainProblem:
    """A flat chain: one :class:`.schedule.Solver` (tables up to what it keeps unrecomputed)."""

    def __init__(self, name: str, chain: Chain, *, buckets: int = 128, depth: int = 3):
        self.name = name
        self.store_all = simulate(chain, [Stored(l) for l in range(chain.n)])[1]
        self.solver = Solver(chain, max(self.store_all, 1), buckets=buckets, depth=depth)

    def least(self) -> int:
        """The smallest budget any schedule meets (bytes)."""
        found = self.solver.min_budget()
        return self.store_all if found is None else min(found, self.store_all)

    def solve(self, budget: int) -> Choice | None:
        sol = self.solver.solve(budget)
        if sol is None:
            return _store_all(self.solver.chain, 1) if budget >= self.store_all else None
        return Choice(sol.items, sol.peak, sol.extra_compute)


def _store_all(chain: Chain, group: int) -> Choice:
    """Nothing recomputed (the DP's buckets round sizes up, so they may miss this budget exactly)."""
    items = tuple(Stored(l) for l in range(chain.n))
    return Choice(items, simulate(chain, items)[1], 0.0, group)


class ScanProblem:
    """A scan of ``n`` equal steps: for each block length ``k`` in ``lengths``, the DP over stages
    of ``k`` steps where a block is one stage (runs of kept steps and of blocks of ``k`` steps, as
    nested scans run them; with ``keep_steps=False`` blocks only); the least-compute one within
    the budget wins."""

    def __init__(self, name: str, chain_of: Callable[[int], Chain], n: int, lengths: Sequence[int], *,
                 buckets: int = 1024, keep_steps: bool = True):
        self.name = name
        self.n = n
        self.keep_steps = keep_steps
        self.solvers: dict[int, Solver] = {}
        self.store_all = 0
        for k in lengths:
            chain = chain_of(k)
            self.store_all = max(self.store_all, simulate(chain, [Stored(l) for l in range(chain.n)])[1])
            self.solvers[k] = chain
        self.solvers = {k: Solver(chain, self.store_all, buckets=buckets, depth=1, max_block=1,
                                  top_store=keep_steps)
                        for k, chain in self.solvers.items()}

    def least(self) -> int:
        found = [s.min_budget() for s in self.solvers.values()]
        found = [f for f in found if f is not None]
        return min(found + [self.store_all])

    def solve(self, budget: int) -> Choice | None:
        if budget >= self.store_all and self.keep_steps:
            return _store_all(self.solvers[min(self.solvers)].chain, min(self.solvers))
        best = None
        for k, solver in self.solvers.items():
            sol = solver.solve(budget)
            if sol is None:
                continue
            key = (sol.extra_compute, -k)
            if best is None or key < best[0]:
                best = (key, Choice(sol.items, sol.peak, sol.extra_compute, group=k))
        return None if best is None else best[1]


Problem = ChainProblem | ScanProblem


@dataclasses.dataclass
class Plan:
    """One schedule per problem, for budget fraction ``lam``."""

    lam: float
    solutions: tuple[Choice, ...]

    @property
    def peak(self) -> int:
        return sum(s.peak for s in self.solutions)

    @property
    def extra_seconds(self) -> float:
        return sum(s.extra_compute for s in self.solutions)

    @property
    def key(self) -> tuple:
        return tuple((s.items, s.group) for s in self.solutions)


def plan_for(problems: Sequence, lam: float) -> Plan | None:
    """Each problem's least-compute schedule within ``lam`` times what it keeps unrecomputed (at
    least its smallest feasible budget); ``None`` if a problem has no schedule."""
    solutions = []
    for p in problems:
        budget = max(int(lam * p.store_all), p.least())
        sol = p.solve(budget)
        if sol is None:
            return None
        solutions.append(sol)
    return Plan(lam, tuple(solutions))


@dataclasses.dataclass
class Attempt:
    """One emitted program: its plan, XLA's footprint, and the footprint predicted before compiling."""

    plan: Plan
    jaxpr: jx.ClosedJaxpr
    footprint: int
    predicted: int


@dataclasses.dataclass
class Outcome:
    """The attempts made, the one chosen (the fitting one with least recomputation, else the
    smallest), whether it fits, and the estimated footprint not due to residuals."""

    attempts: list[Attempt]
    chosen: Attempt | None
    fits: bool
    base: int


def closed_loop(problems: Sequence[Problem], emit: Callable[[Plan], jx.ClosedJaxpr],
                measure: Callable[[jx.ClosedJaxpr], int], footprint0: int, limit: int, *,
                max_rounds: int = 6, slack: float = 0.15) -> Outcome:
    """Run the loop of the module docstring; ``slack``: stop once a fitting program is within this
    fraction of the limit."""
    kept = sum(p.store_all for p in problems)
    base = footprint0 - kept
    lam_min = min((p.least() / p.store_all for p in problems if p.store_all), default=0.0)
    points: list[tuple[float, int]] = [(1.0, footprint0)]
    attempts: list[Attempt] = []
    seen: dict[tuple, Attempt] = {}
    lam = min(1.0, max(lam_min, (limit - base) / kept if kept else 0.0))
    tried_least = False
    slope = float(max(kept, 1))
    for _ in range(4 * max_rounds):                 # repeated plans (budget buckets) cost no compile
        if len(attempts) >= max_rounds:
            break
        plan = plan_for(problems, lam)
        if plan is None:
            break
        tried_least = tried_least or lam <= lam_min
        attempt = seen.get(plan.key)
        if attempt is None:
            last_lam, last_f = points[-1]
            predicted = int(last_f + slope * (lam - last_lam))
            new = emit(plan)
            attempt = Attempt(plan, new, measure(new), predicted)
            seen[plan.key] = attempt
            attempts.append(attempt)
        points.append((lam, attempt.footprint))
        slope = _slope(points, kept)
        if attempt.footprint <= limit:
            if limit - attempt.footprint <= slack * limit or lam >= 1.0:
                break
            above = [l for l, f in points if f > limit and l > lam]
            step = min(1.0, lam + (limit - attempt.footprint) / slope)
            nxt = min(step, (lam + min(above)) / 2) if above else step
            if nxt <= lam + 1e-6:
                break
            lam = nxt
            continue
        if lam <= lam_min:
            break                                    # the schedules that keep least are over too
        below = [l for l, f in points if f <= limit and l < lam]
        nxt = lam - (attempt.footprint - limit) / slope
        if below:
            nxt = max(nxt, (lam + max(below)) / 2)
        if len(attempts) >= max_rounds - 1 and not tried_least and not below:
            nxt = lam_min                            # the last compile goes to the least-keeping plan
        lam = max(lam_min, min(nxt, lam * 0.98))
    fitting = [a for a in attempts if a.footprint <= limit]
    if fitting:
        chosen = min(fitting, key=lambda a: (a.plan.extra_seconds, a.footprint))
        return Outcome(attempts, chosen, True, base)
    chosen = min(attempts, key=lambda a: a.footprint) if attempts else None
    return Outcome(attempts, chosen, False, base)


def _slope(points: list[tuple[float, int]], kept: int) -> float:
    """Bytes of XLA footprint per unit of ``λ``: the secant through the two most recent distinct
    measurements, or ``kept`` when they do not give a positive one."""
    distinct = []
    for lam, f in reversed(points):
        if all(abs(lam - l) > 1e-9 for l, _ in distinct):
            distinct.append((lam, f))
        if len(distinct) == 2:
            break
    if len(distinct) == 2:
        (l1, f1), (l2, f2) = distinct
        slope = (f1 - f2) / (l1 - l2)
        if slope > 0.05 * max(kept, 1):
            return slope
    return float(max(kept, 1))
