"""``DataflowGraph.between`` and ``GrowingRegion`` against the definition, on random programs: the
equations outside a region that are reachable from it and reach it again (networkx's descendants
and ancestors)."""

import jax
import jax.numpy as jnp
import networkx as nx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hlopass.graph import DataflowGraph


def _program(steps):
    """A jaxpr of ``len(steps)`` equations, each reading one or two earlier values."""
    def fn(x):
        values = [x]
        for a, b, op in steps:
            u, v = values[a % len(values)], values[b % len(values)]
            values.append(jnp.sin(u) if op == 0 else u * v if op == 1 else u + v)
        return values[-1]
    return jax.make_jaxpr(fn)(np.ones(3, np.float32))


def _definition(graph: DataflowGraph, region: set[int]) -> list[int]:
    g = graph.graph
    down = set().union(*(nx.descendants(g, i) for i in region))
    up = set().union(*(nx.ancestors(g, i) for i in region))
    return sorted((down & up) - region)


steps = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(0, 2)), min_size=2, max_size=40)


@settings(max_examples=60, deadline=None)
@given(steps=steps, picks=st.lists(st.integers(0, 10**6), min_size=1, max_size=12), limit=st.sampled_from([0, 4096]))
def test_between_is_the_definition(steps, picks, limit):
    graph = DataflowGraph(_program(steps))
    graph.CLOSURE_LIMIT = limit   # 0: the bounded search; 4096: the bit-set closure
    n = len(graph.jaxpr.eqns)
    region = {p % n for p in picks}
    assert list(graph.between(region)) == _definition(graph, region)


@settings(max_examples=40, deadline=None)
@given(steps=steps, picks=st.lists(st.integers(0, 10**6), min_size=1, max_size=12))
def test_growing_region_follows_each_added_equation(steps, picks):
    graph = DataflowGraph(_program(steps))
    n = len(graph.jaxpr.eqns)
    growing, region = graph.growing(), set()
    for p in picks:
        region.add(p % n)
        growing.add(p % n)
        found = growing.between(region)
        want = _definition(graph, region)
        assert list(found) == want and bool(found) == bool(want)
        if want:
            assert found[0] == want[0] and len(found) == len(want)


def test_derived_facts_are_computed_once_per_graph():
    jaxpr = jax.make_jaxpr(lambda x: jnp.sin(x) * 2.0)(1.0)
    calls = []

    def count(graph):
        calls.append(graph)
        return len(graph.jaxpr.eqns)

    first, second = DataflowGraph(jaxpr), DataflowGraph(jaxpr)
    assert [first.derived("n", count), first.derived("n", count), second.derived("n", count)] == [2, 2, 2]
    assert calls == [first, second]
