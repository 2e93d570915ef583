"""The checkpointing DP against brute force: every schedule of small random chains enumerated and
replayed action by action (:func:`simulate`), the DP's optimum equal to the least compute of any
schedule within the budget, and the schedule it returns within the budget."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hlopass.passes.remat.schedule import Block, Chain, Solver, Stored, check_schedule, group, simulate


def all_schedules(i, j, depth, top, top_store, max_block):
    """Every schedule of (i, j] with at most ``depth`` nested recomputations (``top_store=False``:
    blocks only at the top level, when blocks are allowed at all)."""
    if i == j:
        yield []
        return
    if not (top and not top_store and depth > 0):
        for rest in all_schedules(i + 1, j, depth, top, top_store, max_block):
            yield [Stored(i)] + rest
    if depth > 0:
        last = top and not top_store   # a block may then end the chain
        for k in range(i + 1, (j + 1) if last else j):
            if max_block is not None and k - i > max_block:
                break
            for inner in all_schedules(i, k, depth - 1, False, top_store, max_block):
                for rest in all_schedules(k, j, depth, top, top_store, max_block):
                    yield [Block(i, k, tuple(inner))] + rest


def recomputable(chain, items) -> bool:
    for item in items:
        if isinstance(item, Block):
            if not all(chain.can_recompute(l) for l in range(item.start, item.end)):
                return False
            if not recomputable(chain, item.inner):
                return False
    return True


chains = st.integers(1, 6).flatmap(lambda n: st.builds(
    Chain,
    time=st.tuples(*[st.sampled_from([0.0, 1.0, 2.0, 3.5]) for _ in range(n)]),
    residual=st.tuples(*[st.integers(0, 6) for _ in range(n)]),
    extra=st.tuples(*[st.integers(0, 3) for _ in range(n)]),
    cut=st.tuples(*[st.integers(0, 5) for _ in range(n + 1)]),
    recomputable=st.tuples(*[st.booleans() for _ in range(n)])))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(chain=chains, depth=st.integers(0, 3), top_store=st.booleans(),
       max_block=st.sampled_from([None, 1, 2]))
def test_dp_equals_brute_force(chain, depth, top_store, max_block):
    total = sum(chain.residual) + sum(chain.extra) + max(chain.cut)
    solver = Solver(chain, total, buckets=max(total, 1), depth=depth, max_block=max_block, top_store=top_store)
    assert solver.quantum == 1
    schedules = [s for s in all_schedules(0, chain.n, depth, True, top_store, max_block) if recomputable(chain, s)]
    replayed = [simulate(chain, s) for s in schedules]
    for budget in range(0, total + 1):
        best = min((c for c, p in replayed if p <= budget), default=math.inf)
        solution = solver.solve(budget)
        if solution is None:
            assert best == math.inf, (budget, best)
            continue
        check_schedule(chain, solution.items)
        assert recomputable(chain, solution.items)
        assert solution.peak <= budget
        assert simulate(chain, solution.items) == (solution.compute, solution.peak)
        assert solution.compute == pytest.approx(best), (budget, solution, best)


def test_min_budget_is_the_least_feasible():
    chain = Chain(time=(1.0,) * 8, residual=(4,) * 8, extra=(0,) * 8, cut=(1,) * 9)
    solver = Solver(chain, 40, buckets=40, depth=3)
    least = solver.min_budget()
    assert solver.solve(least) is not None
    assert solver.solve(least - 1) is None


def test_more_budget_never_costs_more():
    chain = Chain(time=(1.0, 2.0, 0.5, 3.0, 1.0, 1.0, 2.0), residual=(5, 3, 8, 2, 6, 4, 4), extra=(1,) * 7,
                  cut=(0, 2, 1, 3, 1, 2, 2, 0))
    solver = Solver(chain, 60, buckets=60, depth=2)
    costs = [s.compute for s in (solver.solve(b) for b in range(60)) if s is not None]
    assert costs == sorted(costs, reverse=True)
    everything = solver.solve(60)
    assert everything.extra_compute == 0 and all(isinstance(i, Stored) for i in everything.items)


def test_uniform_chain_recomputes_about_one_forward_at_sqrt_budget():
    # 64 equal layers, residual 4, cut 1: the classic sqrt(n) regime costs at most one more forward
    n = 64
    chain = Chain(time=(1.0,) * n, residual=(4,) * n, extra=(0,) * n, cut=(1,) * (n + 1))
    solution = Solver(chain, 4 * n, buckets=4 * n, depth=3).solve(2 * 16 + 4 * 8)
    assert solution is not None and solution.peak <= 64
    assert solution.extra_compute <= n


def test_unrecomputable_stages_are_always_stored():
    chain = Chain(time=(1.0,) * 4, residual=(5,) * 4, extra=(0,) * 4, cut=(1,) * 5,
                  recomputable=(True, False, True, True))
    solver = Solver(chain, 20, buckets=20, depth=3)
    for budget in range(21):
        solution = solver.solve(budget)
        if solution is not None:
            assert Stored(1) in solution.items


def test_group_merges_stages():
    chain = Chain(time=(1.0, 2.0, 3.0, 4.0, 5.0), residual=(1, 2, 3, 4, 5), extra=(0, 0, 0, 0, 9),
                  cut=(0, 1, 2, 3, 4, 5))
    grouped = group(chain, 2)
    assert grouped.time == (3.0, 7.0, 5.0)
    assert grouped.residual == (3, 7, 5)
    assert grouped.cut == (0, 2, 4, 5)
    assert grouped.extra == (0, 0, 9)
