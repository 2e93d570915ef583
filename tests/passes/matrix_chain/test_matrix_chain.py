"""The matrix-chain pass: each rewrite checked against ``jax.jit`` of the unrewritten code."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hlopass
from fixtures import chains
from hlopass import pipeline
from hlopass.settings import resolve
from hlopass.passes.matrix_chain.network import contract_optimally
from hlopass.stablehlo import max_tensor_bytes
from hlopass.passes.matrix_chain import MatrixChainPass

N = 37  # prime: no accidental divisibility


def chain_jit(fun, **settings):
    return hlopass.jit(fun, passes="matrix_chain", **settings)


def chain_rewrites(report):
    return [r for r in report.rewrites if r.pass_name == "matrix_chain"]


def assert_matches_jit(fun, args, hfun=None, rtol=1e-5, atol=1e-5):
    hfun = hfun or chain_jit(fun)
    got, want = hfun(*args), jax.jit(fun)(*args)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), rtol=rtol, atol=atol)


def dot_count(closed):
    return sum(eqn.primitive.name == "dot_general" for eqn in closed.jaxpr.eqns)


@pytest.mark.parametrize("name", list(chains.CHAINS))
def test_benchmark_chains_are_reordered(name):
    fun, by_hand, make = chains.CHAINS[name]
    args = make(N, np.float32, 0, 3 if name.startswith("batched") else None)
    traced = chain_jit(fun).trace(*args)
    [entry] = chain_rewrites(traced.report)
    assert entry.location.startswith("chains.py:")
    assert entry.details["flops_after"] < entry.details["flops_before"]
    assert entry.details["peak_intermediate_after"] < entry.details["peak_intermediate_before"]
    assert "FLOPs" in entry.summary and "peak intermediate" in entry.summary
    assert_matches_jit(fun, args, rtol=1e-4, atol=1e-4)
    assert_matches_jit(by_hand, args, hfun=chain_jit(fun), rtol=1e-4, atol=1e-4)


def test_matrix_vector_chain_loses_its_square_intermediate_in_stablehlo():
    n = 64
    A, B, v = chains.CHAINS["A@B@v"][2](n)
    plain = jax.jit(chains.abv).lower(A, B, v).compiler_ir("stablehlo")
    rewritten = chain_jit(chains.abv).lower(A, B, v).compiler_ir("stablehlo")
    assert max_tensor_bytes(plain) == n * n * 4  # A @ B
    assert max_tensor_bytes(rewritten) == n * 4  # only vectors are computed


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_transposed_chain_in_both_precisions(dtype):
    with jax.enable_x64(dtype == np.float64):
        args = chains.CHAINS["A.T@B.T@C@v"][2](N, dtype, 1)
        traced = chain_jit(chains.transposed_chain).trace(*args)
        assert len(chain_rewrites(traced.report)) == 1
        assert traced.rewritten_jaxpr.out_avals[0].dtype == dtype
        tol = 1e-12 if dtype == np.float64 else 1e-4
        assert_matches_jit(chains.transposed_chain, args, rtol=tol, atol=tol)


def test_transpose_of_an_intermediate_product():
    def fun(A, B, v):
        return (A @ B).T @ v + jnp.sum((A @ B.T).T, axis=0)

    args = chains.CHAINS["A@B@v"][2](N, np.float32, 2)
    traced = chain_jit(fun).trace(*args)
    assert len(chain_rewrites(traced.report)) == 2
    assert all(eqn.outvars[0].aval.shape != (N, N) for eqn in traced.rewritten_jaxpr.jaxpr.eqns
               if eqn.primitive.name == "dot_general")
    assert_matches_jit(fun, args, rtol=1e-4, atol=1e-4)


def test_already_optimal_chain_is_left_as_it_is():
    A, B, v = chains.CHAINS["A@B@v"][2](N)
    closed = jax.make_jaxpr(chains.abv_by_hand)(A, B, v)
    new, report = MatrixChainPass().run(closed, resolve({"passes": "matrix_chain"}))
    assert new is closed
    assert report.rewrites == [] and report.skipped == []
    single = jax.make_jaxpr(lambda A, B: A @ B)(A, B)
    assert MatrixChainPass().run(single, resolve({"passes": "matrix_chain"}))[0] is single


def test_chains_inside_a_larger_graph():
    args = chains.CHAINS["A@B@v"][2](N, np.float32, 3) + (np.linspace(-1, 1, N, dtype=np.float32),)
    traced = chain_jit(chains.chain_inside_graph).trace(*args)
    assert len(chain_rewrites(traced.report)) == 2
    assert all(eqn.outvars[0].aval.shape != (N, N) for eqn in traced.rewritten_jaxpr.jaxpr.eqns
               if eqn.primitive.name == "dot_general")
    assert_matches_jit(chains.chain_inside_graph, args, rtol=1e-4, atol=1e-4)


def test_a_product_used_twice_is_recomputed_when_that_is_cheaper():
    # M = A @ B feeds M @ v and M.T @ w: A @ (B @ v) and B.T @ (A.T @ w) cost 4n^2, not n^3 + 2n^2.
    A, B, v = chains.CHAINS["A@B@v"][2](N, np.float32, 4)
    w = np.cos(np.arange(N, dtype=np.float32))
    traced = chain_jit(chains.reused_product).trace(A, B, v, w)
    rewrites = chain_rewrites(traced.report)
    assert len(rewrites) == 2 and all(r.details["shared_equations"] == 1 for r in rewrites)
    assert sum(r.details["flops_before"] for r in rewrites) == 2 * (N**3 + 2 * N * N)
    assert sum(r.details["flops_after"] for r in rewrites) == 2 * 4 * N * N
    assert all(eqn.outvars[0].aval.shape != (N, N) for eqn in traced.rewritten_jaxpr.jaxpr.eqns)
    assert_matches_jit(chains.reused_product, (A, B, v, w), rtol=1e-4, atol=1e-4)


def test_a_product_used_twice_stays_a_boundary_when_recomputing_costs_more():
    def fun(A, B, C, D):
        M = A @ B
        return M @ C, M.T @ D  # recomputing A @ B inside both would cost 4n^3 instead of 3n^3

    args = chains.CHAINS["A.T@B.T@C@v"][2](N, np.float32, 12)[:3] + (np.eye(N, dtype=np.float32),)
    traced = chain_jit(fun).trace(*args)
    assert chain_rewrites(traced.report) == []
    assert dot_count(traced.rewritten_jaxpr) == 3
    assert_matches_jit(fun, args, rtol=1e-4, atol=1e-4)


def test_a_product_also_read_outside_chains_is_a_boundary():
    def fun(A, B, v):
        M = A @ B
        return jnp.tanh(M) @ v + M @ v

    args = chains.CHAINS["A@B@v"][2](N, np.float32, 13)
    traced = chain_jit(fun).trace(*args)
    assert chain_rewrites(traced.report) == []
    assert_matches_jit(fun, args, rtol=1e-4, atol=1e-4)


def test_a_returned_intermediate_is_a_boundary():
    def fun(A, B, v):
        M = A @ B
        return M, M @ v

    args = chains.CHAINS["A@B@v"][2](N)
    traced = chain_jit(fun).trace(*args)
    assert chain_rewrites(traced.report) == []
    assert_matches_jit(fun, args)


def test_square_of_a_matrix_applied_to_a_vector():
    def fun(A, v):
        return A @ A @ A.T @ v

    A, _, v = chains.CHAINS["A@B@v"][2](N, np.float32, 5)
    traced = chain_jit(fun).trace(A, v)
    [entry] = chain_rewrites(traced.report)
    assert entry.details["flops_after"] == 2 * 3 * N * N
    assert_matches_jit(fun, (A, v), rtol=1e-4, atol=1e-4)


def test_sum_reductions_are_products_with_ones():
    def fun(A, B, C):
        return jnp.sum(A @ B @ C), jnp.sum(A @ B, axis=0), jnp.sum(A.T @ C, axis=1)

    args = chains.CHAINS["A.T@B.T@C@v"][2](N, np.float32, 6)[:3]
    traced = chain_jit(fun).trace(*args)
    rewrites = chain_rewrites(traced.report)
    assert len(rewrites) == 3
    assert rewrites[0].details["flops_after"] <= 2 * (3 * N * N + 2 * N)
    assert_matches_jit(fun, args, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("dims", [(2, 11, 13, 1), (1, 17, 19, 3)])
def test_batched_chains_with_broadcast_factors(dims):
    b, n, m, k = dims

    def fun(A, B, C):
        return A @ B @ C  # C has no batch axis

    rng = np.random.default_rng(7)
    args = (rng.standard_normal((b, n, m)).astype(np.float32), rng.standard_normal((b, m, n)).astype(np.float32),
            rng.standard_normal((n, k)).astype(np.float32))
    traced = chain_jit(fun).trace(*args)
    assert len(chain_rewrites(traced.report)) == 1
    assert_matches_jit(fun, args, rtol=1e-4, atol=1e-4)


def test_mixed_dtypes_promote_as_jax_does():
    def fun(A, B, v):
        return A @ B.astype(jnp.float16) @ v

    def accumulate_wide(A, B, v):
        return jnp.matmul(A, B, preferred_element_type=jnp.float32) @ v

    rng = np.random.default_rng(8)
    A = rng.standard_normal((N, N)).astype(np.float16)
    B = (rng.standard_normal((N, N)) / N).astype(np.float32)
    v = rng.standard_normal(N).astype(np.float32)
    for f, args in ((fun, (A, B, v)), (accumulate_wide, (A, B.astype(jnp.bfloat16), v.astype(jnp.bfloat16)))):
        traced = chain_jit(f).trace(*args)
        assert len(chain_rewrites(traced.report)) == 1
        assert traced.rewritten_jaxpr.out_avals[0].dtype == jnp.float32
        assert_matches_jit(f, args, rtol=2e-2, atol=2e-2)


def test_narrowing_cast_is_a_boundary():
    def fun(A, B, v):
        return (A @ B).astype(jnp.float16) @ v

    A, B, v = chains.CHAINS["A@B@v"][2](N)
    traced = chain_jit(fun).trace(A, B, v.astype(np.float16))
    assert chain_rewrites(traced.report) == []


def test_integer_chains_are_left_alone():
    def fun(A, B, v):
        return A @ B @ v

    args = tuple(np.arange(k, k + s, dtype=np.int32).reshape(shape) for k, s, shape in
                 ((0, 25, (5, 5)), (3, 25, (5, 5)), (1, 5, (5,))))
    traced = chain_jit(fun).trace(*args)
    assert chain_rewrites(traced.report) == []
    assert_matches_jit(fun, args)


def test_threshold_picks_the_cheapest_order_that_fits(monkeypatch):
    # (M1 M2) M3 is cheapest (8,000 multiply-adds) but holds a 1x2000 intermediate;
    # M1 (M2 M3) costs 8,004 and its intermediate is 2x2.
    rng = np.random.default_rng(9)
    args = [rng.standard_normal(s).astype(np.float32) for s in ((1, 2), (2, 2000), (2000, 2))]

    def fun(M1, M2, M3):
        return M1 @ M2 @ M3

    assert chain_rewrites(chain_jit(fun, threshold="off").trace(*args).report) == []
    traced = chain_jit(fun, threshold="1kB").trace(*args)
    [entry] = chain_rewrites(traced.report)
    assert entry.details["peak_intermediate_before"] == 8000
    assert entry.details["peak_intermediate_after"] == 16
    assert entry.details["flops_after"] == 2 * 8004
    assert_matches_jit(fun, args, hfun=chain_jit(fun, threshold="1kB"), rtol=1e-4, atol=1e-4)
    monkeypatch.setenv("HLOPASS_TENSOR_SIZE_THRESHOLD", "1kB")  # the same through the environment
    [entry] = chain_rewrites(chain_jit(fun).trace(*args).report)
    assert entry.details["peak_intermediate_after"] == 16


def test_gradient_inside_the_function():
    def grad_w1(x, W1, W2):
        return jax.grad(lambda W1: jnp.sum(x @ W1 @ W2))(W1)

    args = chains.CHAINS["x@W1@W2 (thin W2)"][2](N)
    traced = chain_jit(grad_w1).trace(*args)
    rewrites = chain_rewrites(traced.report)
    assert rewrites and all(r.details["flops_after"] < r.details["flops_before"] for r in rewrites)
    assert all(eqn.outvars[0].aval.shape != (4 * N, N) for eqn in traced.rewritten_jaxpr.jaxpr.eqns
               if eqn.primitive.name == "dot_general")
    assert_matches_jit(grad_w1, args, rtol=1e-4, atol=1e-3)


def test_full_gradient_inside_the_function():
    def grads(x, W1, W2):
        return jax.grad(lambda *a: jnp.sum(chains.thin_mlp(*a)), argnums=(0, 1, 2))(x, W1, W2)

    args = chains.CHAINS["x@W1@W2 (thin W2)"][2](N)
    traced = chain_jit(grads).trace(*args)
    rewrites = chain_rewrites(traced.report)
    assert len(rewrites) == 3  # dx, dW1 and dW2
    assert sum(r.details["flops_after"] for r in rewrites) * 10 < sum(r.details["flops_before"] for r in rewrites)
    products = [eqn.outvars[0].aval.shape for eqn in traced.rewritten_jaxpr.jaxpr.eqns
                if eqn.primitive.name == "dot_general"]
    assert products.count((4 * N, N)) == 1  # only dx itself, as an outer product
    assert_matches_jit(grads, args, rtol=1e-4, atol=1e-4)


def test_gradient_of_a_hlopass_function_rewrites_the_backward_program():
    def loss(x, W1, W2):
        return jnp.sum(jnp.tanh(x @ W1 @ W2))

    args = chains.CHAINS["x@W1@W2 (thin W2)"][2](N)
    f = chain_jit(loss)
    got = jax.jit(jax.grad(f, argnums=1))(*args)
    want = jax.jit(jax.grad(loss, argnums=1))(*args)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    backward = [r for r in hlopass.reports(jax.grad(f, argnums=1), *args) if r.label.startswith("transpose(")]
    [entry] = chain_rewrites(backward[-1])  # dW1 = x.T @ (g @ W2.T) -> (x.T @ g) @ W2.T
    assert entry.details["peak_intermediate_before"] == 4 * N * N * 4
    assert entry.details["peak_intermediate_after"] == N * 4


def test_chain_inside_a_loop_body():
    def fun(A, B, v):
        return lax.fori_loop(0, 3, lambda i, u: A @ B @ u / N, v)

    args = chains.CHAINS["A@B@v"][2](N, np.float32, 10)
    traced = chain_jit(fun).trace(*args)
    assert len(chain_rewrites(traced.report)) == 1
    assert_matches_jit(fun, args, rtol=1e-4, atol=1e-5)


def test_contract_optimally_for_other_passes():
    rng = np.random.default_rng(11)
    A, B = rng.standard_normal((40, 30)), rng.standard_normal((30, 50))
    ones = np.ones(50)
    got = jax.jit(lambda A, B, ones: contract_optimally("ij,jk,k->i", A, B, ones))(A, B, ones)
    np.testing.assert_allclose(got, np.sum(A @ B, axis=1), rtol=1e-4, atol=1e-4)
    jaxpr = jax.make_jaxpr(lambda A, B, ones: contract_optimally("ij,jk,k->i", A, B, ones))(A, B, ones)
    assert all(eqn.outvars[0].aval.shape != (40, 50) for eqn in jaxpr.jaxpr.eqns)


def test_chain_with_mixed_precisions_is_skipped_and_reported():
    def fun(A, B, v):
        return jnp.matmul(A, B, precision=lax.Precision.HIGHEST) @ v

    args = chains.CHAINS["A@B@v"][2](N)
    traced = chain_jit(fun).trace(*args)
    assert chain_rewrites(traced.report) == []
    [skip] = [s for s in traced.report.skipped if s.pass_name == "matrix_chain"]
    assert "precisions" in skip.reason and skip.location.startswith("test_matrix_chain.py:")
    assert_matches_jit(fun, args)


def test_scalar_factors_join_the_chain():
    def fun(A, B, v, s):
        return 2.0 * (A @ B) * s @ v / N

    A, B, v = chains.CHAINS["A@B@v"][2](N, np.float32, 14)
    s = np.float32(0.5)
    traced = chain_jit(fun).trace(A, B, v, s)
    [entry] = chain_rewrites(traced.report)
    assert entry.details["peak_intermediate_after"] == N * 4
    assert all(eqn.outvars[0].aval.shape != (N, N) for eqn in traced.rewritten_jaxpr.jaxpr.eqns)
    assert_matches_jit(fun, (A, B, v, s), rtol=1e-4, atol=1e-5)

    def square(s, A):  # both factors scalars: a product of scalars, nothing to reorder
        return (s * s) * A @ A

    assert_matches_jit(square, (s, A), rtol=1e-4, atol=1e-5)


def test_threshold_binds_intermediates_even_when_the_result_is_larger():
    """(A B) C with A 5x2, B 2x1, C 1x2 at a 16-byte threshold: the result (40 B) cannot fit, but
    A (B C) keeps the only intermediate at 16 B where (A B) needs 20 B; found by hypothesis."""
    rng = np.random.default_rng(0)
    A, B, C = (rng.standard_normal(s).astype(np.float32) for s in ((5, 2), (2, 1), (1, 2)))
    f = lambda A, B, C: (A @ B) @ C  # noqa: E731
    h = hlopass.jit(f, passes="matrix_chain", threshold=16)
    traced = h.trace(A, B, C)
    (rewrite,) = traced.report.rewrites
    assert rewrite.details["peak_intermediate_before"] == 20 and rewrite.details["peak_intermediate_after"] == 16
    np.testing.assert_allclose(h(A, B, C), f(A, B, C), rtol=1e-5)
