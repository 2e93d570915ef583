"""hlopass/contraction.py on its own: extraction, costing, ordering and emission of networks."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hlopass.passes.matrix_chain.network import (contract, contract_optimally, extract_networks, network_from_subscripts,
                                  optimal_path, path_cost)
from hlopass import internals as jx
from hlopass.graph import DataflowGraph


def networks_of(fun, *args):
    return extract_networks(DataflowGraph(jax.make_jaxpr(fun)(*args)))


def test_extraction_labels_transposes_sums_and_batches():
    A, v = np.ones((3, 4), np.float32), np.ones(3, np.float32)
    [net] = networks_of(lambda A, v: A.T @ A @ A.T @ v, A, v)
    assert net.subscripts == "da,dc,bc,b->a"
    assert net.original_multiply_adds == 4 * 3 * 4 + 4 * 4 * 3 + 4 * 3
    assert net.original_peak_bytes == 4 * 4 * 4  # the 4x4 product; the transposes are 3x4

    [net] = networks_of(lambda A, B: jnp.sum(A @ B, axis=(0, 1)), A, A.T)
    assert [op.is_ones for op in net.operands] == [True, True, False, False]
    assert net.output == ()

    X = np.ones((2, 3, 4), np.float32)
    [net] = networks_of(lambda X, Y: X @ Y, X, X.transpose(0, 2, 1))
    assert net.subscripts == "abd,adc->abc"


def test_shared_and_returned_products_are_operands():
    A = np.ones((3, 3), np.float32)

    def fun(A):
        M = A @ A
        return M, M @ A

    nets = networks_of(fun, A)
    assert [len(n.operands) for n in nets] == [2, 2]


def all_pairwise_paths(n):
    """Every contraction order of n operands, in opt_einsum's linear path format."""
    if n == 1:
        yield []
        return
    for pair in itertools.combinations(range(n), 2):
        for rest in all_pairwise_paths(n - 1):
            yield [pair, *rest]


def connected_steps(net, path):
    tensors = [set(op.labels) for op in net.operands]
    for i, j in path:
        if not tensors[i] & tensors[j]:
            return False
        merged = tensors[i] | tensors[j]
        tensors = [t for k, t in enumerate(tensors) if k not in (i, j)] + [merged]
    return True


@st.composite
def einsum_networks(draw):
    n_operands = draw(st.integers(2, 5))
    alphabet = "abcdef"
    sizes = {label: draw(st.integers(1, 6)) for label in alphabet}
    inputs = [draw(st.lists(st.sampled_from(alphabet), min_size=0, max_size=3, unique=True))
              for _ in range(n_operands)]
    present = sorted(set().union(*map(set, inputs)))
    output = draw(st.lists(st.sampled_from(present), unique=True)) if present else []
    subscripts = ",".join("".join(i) for i in inputs) + "->" + "".join(output)
    shapes = [tuple(sizes[label] for label in labels) for labels in inputs]
    return subscripts, shapes


@settings(max_examples=30, deadline=None, derandomize=True)
@given(spec=einsum_networks(), seed=st.integers(0, 1000))
def test_optimal_order_of_any_network_matches_einsum_and_beats_every_connected_order(spec, seed):
    subscripts, shapes = spec
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(shape) for shape in shapes]
    with jax.enable_x64(True):
        got = np.asarray(contract_optimally(subscripts, *arrays))
    np.testing.assert_allclose(got, np.einsum(subscripts, *arrays), rtol=1e-10, atol=1e-10)

    net = network_from_subscripts(subscripts, *((s, np.float64) for s in shapes))
    best = path_cost(net, optimal_path(net)).multiply_adds
    connected = [path_cost(net, p).multiply_adds for p in all_pairwise_paths(len(shapes)) if connected_steps(net, p)]
    assert best <= min(connected, default=best)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(spec=einsum_networks(), limit=st.integers(1, 60))
def test_memory_limit_bounds_every_intermediate(spec, limit):
    subscripts, shapes = spec
    net = network_from_subscripts(subscripts, *((s, np.float32) for s in shapes))
    try:
        path = optimal_path(net, limit)
    except RuntimeError:
        return  # no order fits; the pass then falls back to the cheapest order
    assert path_cost(net, path).peak_elements <= max(limit, net.size(net.output))


def test_contract_emits_only_the_chosen_products():
    net = network_from_subscripts("ij,jk,k->i", ((50, 40), np.float32), ((40, 30), np.float32), ((30,), np.float32))
    for op in net.operands:
        op.atom = object()
    jaxpr = jax.make_jaxpr(lambda *a: contract(net, [(1, 2), (0, 1)], a))(
        np.ones((50, 40), np.float32), np.ones((40, 30), np.float32), np.ones(30, np.float32))
    assert [eqn.outvars[0].aval.shape for eqn in jaxpr.jaxpr.eqns if eqn.primitive.name == "dot_general"] == [
        (40,), (50,)]
    assert path_cost(net, [(1, 2), (0, 1)]).multiply_adds == 40 * 30 + 50 * 40
    assert path_cost(net, [(0, 1), (0, 1)]).multiply_adds == 50 * 40 * 30 + 50 * 30


@pytest.mark.parametrize("dtypes", [(jnp.bfloat16, jnp.float32), (jnp.float16, jnp.bfloat16)])
def test_contract_promotes_like_matmul(dtypes):
    a = jnp.ones((4, 5), dtypes[0])
    b = jnp.ones((5, 3), dtypes[1])
    assert contract_optimally("ij,jk->ik", a, b).dtype == (a @ b).dtype


def _every_root_built(graph, inline):
    """``extract_networks`` as it was before it skipped chains: a builder for every root."""
    from hlopass.passes.matrix_chain import network as nw
    absorbed = {}
    for i, eqn in enumerate(graph.jaxpr.eqns):
        if nw.is_link(eqn):
            for atom in eqn.invars:
                if isinstance(atom, jx.Var) and (nw._joins_consumer(graph, atom, i, nw.links(graph))
                                                       or atom in inline):
                    absorbed[atom] = graph.producer[atom]
    networks, charged = [], set()
    for i, eqn in enumerate(graph.jaxpr.eqns):
        if nw.is_link(eqn) and eqn.outvars[0] not in absorbed:
            network = nw._NetworkBuilder(graph.jaxpr, absorbed, inline, charged).build(i)
            if network is not None:
                networks.append(network)
    return networks


@settings(max_examples=60, deadline=None, derandomize=True)
@given(ops=st.lists(st.tuples(st.sampled_from(["dot", "scale", "transpose", "tanh"]), st.integers(0, 99),
                              st.integers(0, 99)), min_size=1, max_size=14),
       chosen=st.integers(0, 2**16))
# a shared scaling (value 2) recomputed by a chain without a product (value 3, read by tanh) before one
# with a product (value 5): the first chain built is charged for it
@example(ops=[("scale", 0, 0), ("scale", 2, 0), ("tanh", 3, 0), ("dot", 2, 1)], chosen=1)
def test_chains_without_a_product_are_skipped_without_changing_any_network(ops, chosen):
    """Skipping chains without a product (and shared results) leaves every network as building every
    chain gives it, multiply-adds charged to shared products included."""
    from hlopass.passes.matrix_chain.network import shareable

    def program(a, b):
        values = [a, b]
        for op, i, j in ops:
            x, y = values[i % len(values)], values[j % len(values)]
            values.append({"dot": lambda: x @ y, "scale": lambda: 2.0 * x, "transpose": lambda: x.T,
                           "tanh": lambda: jnp.tanh(x)}[op]())
        return values[-1], values[len(values) // 2]

    a = np.ones((3, 3), np.float32)
    graph = DataflowGraph(jax.make_jaxpr(program)(a, a))
    candidates = shareable(graph)
    inline = frozenset(v for k, v in enumerate(candidates) if chosen >> k & 1)
    summary = lambda nets: [(n.root, n.subscripts, n.original_multiply_adds, n.eqns, n.shared_eqns)  # noqa: E731
                            for n in nets]
    assert summary(extract_networks(graph, inline)) == summary(_every_root_built(graph, inline))


def _whole_level_choice(graph, cost):
    """``shared_worth_inlining`` as it was before it weighed each candidate in its own component:
    every chain of the level extracted again for every candidate."""
    from hlopass.passes.matrix_chain.network import shareable
    costs = lambda nets: {n.root: (n.subscripts, cost(n)) for n in nets}  # noqa: E731
    inline = frozenset()
    current = costs(extract_networks(graph, inline))
    for var in shareable(graph)[:32]:
        trial = costs(extract_networks(graph, inline | {var}))
        changed = {r for r in current.keys() | trial.keys() if current.get(r) != trial.get(r)}
        before = sum(current[r][1] for r in changed if r in current)
        after = sum(trial[r][1] for r in changed if r in trial)
        if after < before:
            inline, current = inline | {var}, trial
    return inline


@settings(max_examples=80, deadline=None, derandomize=True)
@given(ops=st.lists(st.tuples(st.sampled_from(["dot", "scale", "transpose", "tanh", "row"]), st.integers(0, 99),
                              st.integers(0, 99)), min_size=1, max_size=16),
       salt=st.integers(0, 1000))
# two shared products (values 2 and 6) in two components: taking the first must keep the costs of the
# second's component
@example(ops=[("dot", 0, 1), ("dot", 2, 0), ("dot", 2, 1), ("tanh", 3, 0), ("dot", 1, 0), ("dot", 6, 0),
              ("dot", 6, 1)], salt=0)
def test_weighing_a_shared_product_in_its_component_chooses_as_the_whole_level_does(ops, salt):
    """Each candidate is weighed by extracting only its component's chains: the same choice as
    extracting the whole level per candidate, under the real costs and under made-up ones (which
    take and refuse candidates in every combination, or take all of them)."""
    from hlopass.passes.matrix_chain.network import link_components, shared_worth_inlining

    def program(a, b, r):
        values = [a, b]
        for op, i, j in ops:
            x, y = values[i % len(values)], values[j % len(values)]
            values.append({"dot": lambda: x @ y, "scale": lambda: 2.0 * x, "transpose": lambda: x.T,
                           "tanh": lambda: jnp.tanh(x), "row": lambda: r @ (x @ y)}[op]())
        return values[-1], values[len(values) // 2], values[len(values) // 3]

    a = np.ones((5, 5), np.float32)
    graph = DataflowGraph(jax.make_jaxpr(program)(a, a, np.ones((5, 5), np.float32)))
    arbitrary = lambda n: (sum(map(ord, n.subscripts)) * 7919 + salt * (1 + len(n.eqns))) % 101  # noqa: E731
    for cost in (None, arbitrary, lambda n: 1):  # the last takes every candidate: one chain fewer
        reference_cost = cost or (lambda n: __import__(
            "hlopass.passes.matrix_chain.network", fromlist=["x"])._optimal_multiply_adds(n))
        assert shared_worth_inlining(graph, cost) == _whole_level_choice(graph, reference_cost)
    summary = lambda nets: [(n.root, n.subscripts, n.original_multiply_adds, n.eqns, n.shared_eqns)  # noqa: E731
                            for n in nets]
    for component in set(link_components(graph).values()):
        whole = [n for n in extract_networks(graph) if n.root in component]
        assert summary(extract_networks(graph, within=component)) == summary(whole)
