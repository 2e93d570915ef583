"""Property tests: random chains, emitted order against a brute force over all parenthesisations.

A chain has 2 to 8 factors with dimensions 1 to 400 (1-wide ones included),
optional vector ends, factors stored transposed and written ``x.mT``,
optional batch axes (on some factors only: the others broadcast), and a random
parenthesisation as written. The multiply-adds of the ``dot_general`` s in
the rewritten program must equal the brute-force optimum, and the values must
match ``jax.jit`` within the float64 rounding bound ``|A1|...|Ak|`` scales.
"""

import dataclasses
import functools
import math

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import hlopass

MAX_WRITTEN_COST = 3e7  # multiply-adds of the order as written: keeps each example quick


@dataclasses.dataclass
class Chain:
    dims: list[int]            # p_0 .. p_k; factor i is p_i x p_{i+1}
    left_vector: bool          # factor 0 is a 1-D vector (p_0 == 1)
    right_vector: bool         # factor k-1 is a 1-D vector (p_k == 1)
    transposed: list[bool]     # stored transposed, written x.mT
    batch: int | None
    batched: list[bool]        # which factors carry the batch axis
    tree: object               # written parenthesisation: a factor index or (left, right)

    @property
    def k(self) -> int:
        return len(self.dims) - 1

    def is_vector(self, i: int) -> bool:
        return (i == 0 and self.left_vector) or (i == self.k - 1 and self.right_vector)

    def stored_shape(self, i: int) -> tuple[int, ...]:
        rows, cols = self.dims[i], self.dims[i + 1]
        if self.is_vector(i):
            return (cols,) if i == 0 and self.left_vector else (rows,)
        shape = (cols, rows) if self.transposed[i] else (rows, cols)
        return ((self.batch,) if self.batched[i] else ()) + shape

    def step_cost(self, lo: int, mid: int, hi: int) -> int:
        """Multiply-adds of (factors lo..mid-1) @ (factors mid..hi-1)."""
        scale = self.batch if any(self.batched[lo:hi]) else 1
        return scale * self.dims[lo] * self.dims[mid] * self.dims[hi]


def span(tree) -> tuple[int, int]:
    if isinstance(tree, int):
        return tree, tree + 1
    return span(tree[0])[0], span(tree[1])[1]


def tree_cost(chain: Chain, tree) -> tuple[int, int]:
    """(multiply-adds, largest intermediate in elements, the final result excluded)."""
    if isinstance(tree, int):
        return 0, 0
    (lo, mid), (_, hi) = span(tree[0]), span(tree[1])
    cost, peak = 0, 0
    for side in tree:
        c, p = tree_cost(chain, side)
        cost, peak = cost + c, max(peak, p)
        a, b = span(side)
        if b - a > 1:
            scale = chain.batch if any(chain.batched[a:b]) else 1
            peak = max(peak, scale * chain.dims[a] * chain.dims[b])
    return cost + chain.step_cost(lo, mid, hi), peak


def all_trees(lo: int, hi: int):
    """Every parenthesisation of factors lo..hi-1 (brute force: Catalan many)."""
    if hi - lo == 1:
        yield lo
        return
    for mid in range(lo + 1, hi):
        for left in all_trees(lo, mid):
            for right in all_trees(mid, hi):
                yield (left, right)


def brute_force_optimum(chain: Chain, limit_elements: int | None = None) -> int:
    costs = [tree_cost(chain, t) for t in all_trees(0, chain.k)]
    fitting = [c for c, peak in costs if limit_elements is None or peak <= limit_elements]
    return min(fitting or [c for c, _ in costs])


@st.composite
def random_tree(draw, lo: int, hi: int):
    if hi - lo == 1:
        return lo
    mid = draw(st.integers(lo + 1, hi - 1))
    return (draw(random_tree(lo, mid)), draw(random_tree(mid, hi)))


@st.composite
def chains(draw):
    k = draw(st.sampled_from([5, 8, 3, 6, 2, 7, 4]))
    dim = st.one_of(st.integers(1, 3), st.integers(1, 40), st.integers(1, 400))
    dims = [draw(dim) for _ in range(k + 1)]
    batch = draw(st.one_of(st.none(), st.integers(1, 3)))
    left_vector = batch is None and draw(st.booleans())
    right_vector = batch is None and draw(st.booleans())
    if left_vector:
        dims[0] = 1
    if right_vector:
        dims[k] = 1
    transposed = [draw(st.booleans()) for _ in range(k)]
    batched = [batch is not None and draw(st.booleans()) for _ in range(k)]
    if batch is not None and not any(batched):
        batched[draw(st.integers(0, k - 1))] = True
    chain = Chain(dims, left_vector, right_vector, transposed, batch, batched, draw(random_tree(0, k)))
    assume(tree_cost(chain, chain.tree)[0] <= MAX_WRITTEN_COST)
    return chain


def chain_function(chain: Chain):
    def evaluate(factors, tree):
        if isinstance(tree, int):
            x = factors[tree]
            return x.mT if chain.transposed[tree] and not chain.is_vector(tree) else x
        return evaluate(factors, tree[0]) @ evaluate(factors, tree[1])

    return lambda *factors: evaluate(factors, chain.tree)


def emitted_multiply_adds(closed) -> int:
    total = 0
    for eqn in closed.jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            lhs, rhs = (v.aval.shape for v in eqn.invars)
            (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
            total += math.prod(lhs) * math.prod(rhs) // math.prod(rhs[a] for a in (*rhs_contract, *rhs_batch))
    assert all(not hasattr(v, "jaxpr") for eqn in closed.jaxpr.eqns for v in eqn.params.values())
    return total


def emitted_peak(closed) -> int:
    """Largest dot_general result other than the last one (which makes the chain's value)."""
    sizes = [math.prod(eqn.outvars[0].aval.shape) for eqn in closed.jaxpr.eqns if eqn.primitive.name == "dot_general"]
    return max(sizes[:-1], default=0)


def make_factors(chain: Chain, seed: int):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(chain.stored_shape(i)) for i in range(chain.k)]


def abs_product_bound(chain: Chain, factors) -> np.ndarray:
    """|A1| |A2| ... |Ak| (elementwise absolute values, float64): the scale of any order's rounding error."""
    return np.asarray(chain_function(chain)(*(np.abs(f) for f in factors)))


PROPERTY_SETTINGS = settings(max_examples=30, deadline=None, derandomize=True,
                             suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])


@pytest.mark.slow
@PROPERTY_SETTINGS
@given(chain=chains(), seed=st.integers(0, 2**16), min_gain=st.sampled_from([1.0, 1.25, 3.0]))
def test_emitted_order_is_optimal_and_values_match(chain, seed, min_gain):
    """The optimum is emitted when it cuts the written multiply-adds by ``min_gain``; otherwise
    the order as written stays (and the report says so when some order was cheaper)."""
    fun = chain_function(chain)
    with jax.enable_x64(True):
        factors = make_factors(chain, seed)
        hfun = hlopass.jit(fun, passes="matrix_chain", threshold="off", min_gain=min_gain)
        traced = hfun.trace(*factors)
        optimum = brute_force_optimum(chain)
        written = tree_cost(chain, chain.tree)[0]
        pays = optimum < written and optimum * min_gain <= written
        assert emitted_multiply_adds(traced.rewritten_jaxpr) == (optimum if pays else written)
        rewrites = [r for r in traced.report.rewrites if r.pass_name == "matrix_chain"]
        assert len(rewrites) == (1 if pays else 0)
        small_gain = [s for s in traced.report.skipped if "minimum gain" in s.reason]
        assert len(small_gain) == (1 if optimum < written and not pays else 0)
        event("reordered" if rewrites else "left for a small gain" if small_gain else "already optimal")
        event(f"batch={chain.batch}, vector ends={chain.left_vector + chain.right_vector}")
        event(f"{chain.k} factors")
        if rewrites:
            assert rewrites[0].details["flops_before"] == 2 * written
            assert rewrites[0].details["flops_after"] == 2 * optimum

        got, want = np.asarray(hfun(*factors)), np.asarray(jax.jit(fun)(*factors))
    assert got.shape == want.shape and got.dtype == want.dtype == np.float64
    tolerance = 4 * np.finfo(np.float64).eps * (sum(chain.dims) + chain.k) * abs_product_bound(chain, factors)
    assert np.all(np.abs(got - want) <= tolerance + 1e-300)


@pytest.mark.slow
@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(chain=chains(), fraction=st.floats(0.0, 1.0))
def test_threshold_respected_whenever_some_order_fits(chain, fraction):
    fun = chain_function(chain)
    peaks = sorted({tree_cost(chain, t)[1] for t in all_trees(0, chain.k)})
    limit = max(1, peaks[int(fraction * (len(peaks) - 1))])  # an achievable limit, in float32 elements
    with jax.enable_x64(False):
        factors = [f.astype(np.float32) for f in make_factors(chain, 0)]
        traced = hlopass.jit(fun, passes="matrix_chain", threshold=4 * limit, min_gain=1).trace(*factors)
    assert emitted_peak(traced.rewritten_jaxpr) <= limit
    assert emitted_multiply_adds(traced.rewritten_jaxpr) == brute_force_optimum(chain, limit)


@functools.cache
def _catalan_check():
    return [sum(1 for _ in all_trees(0, k)) for k in range(1, 9)]


def test_brute_force_enumerates_every_parenthesisation():
    assert _catalan_check() == [1, 1, 2, 5, 14, 42, 132, 429]
