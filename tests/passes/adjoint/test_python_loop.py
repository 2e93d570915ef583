"""Linear recurrences written as Python loops: rolled into a scan, gradients equal jax.grad's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlopass
from hlopass import internals as jx
from hlopass.interpreter import rewrite
from hlopass.passes.adjoint import AdjointPass
from hlopass.passes.adjoint.chains import MIN_STEPS, find_chains, roll

from . import models
from .test_adjoint import ARGNUMS, _compare, _kinds, _x64, problem


def _loop_loss(name, T, dtype, batch=()):
    layer, params, h0, xs = problem(name, T, dtype, batch)
    return models.loss_of(models.as_python_loop(layer)), params, h0, xs


def _rolled(report):
    return [r for p in report.passes if p.name == "adjoint" for r in p.rewrites if r.kind == "roll_loop"]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name,T", [("diagonal", 29), ("dense_per_step", 11), ("dense_shared", 13),
                                    ("complex", 17)])
def test_python_loop_gradient_equals_jax_grad(name, T, dtype):
    with _x64(dtype):
        loss, params, h0, xs = _loop_loss(name, T, dtype)
        want = jax.jit(jax.grad(loss, ARGNUMS))(params, h0, xs)
        inside = hlopass.jit(jax.grad(loss, ARGNUMS))             # default pipeline, jax.grad inside
        _compare(inside(params, h0, xs), want, dtype)
        report = inside.trace(params, h0, xs).report
        expected = {"diagonal": "diagonal", "complex": "complex"}.get(name, "dense")
        assert [r.details["steps"] for r in _rolled(report)] == [T]
        assert _kinds(report) == [None, expected]          # the roll, then the adjoint scan
        assert "models.py" in _rolled(report)[0].location
        if dtype == "float32":
            outside = jax.jit(jax.grad(hlopass.jit(loss, passes="adjoint"), ARGNUMS))   # jax.grad of it
            _compare(outside(params, h0, xs), want, dtype)


def test_python_loop_with_batch_dimensions_and_options():
    loss, params, h0, xs = _loop_loss("diagonal", 23, "float32", batch=(3,))
    want = jax.jit(jax.grad(loss, ARGNUMS))(params, h0, xs)
    f = hlopass.jit(jax.grad(loss, ARGNUMS), passes=[AdjointPass(chunk=5)])
    _compare(f(params, h0, xs), want, "float32")
    (scan,) = [r for p in f.trace(params, h0, xs).report.passes for r in p.rewrites if r.kind == "adjoint_scan"]
    assert scan.details["length"] == 23 and scan.details["chunk"] == 5


def test_python_loop_nan_and_inf_as_jit():
    loss, params, h0, xs = _loop_loss("diagonal", 13, "float32")
    xs = xs.at[3, 1].set(jnp.nan).at[9, 0].set(jnp.inf)
    want = jax.jit(jax.grad(loss, ARGNUMS))(params, h0, xs)
    got = hlopass.jit(jax.grad(loss, ARGNUMS))(params, h0, xs)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_array_equal(np.isinf(g), np.isinf(w))


def test_python_loop_saves_memory():
    """A selective layer of 41 steps, state 16 x 64: the adjoint keeps states at chunk boundaries."""
    loss, _, _, _ = _loop_loss("diagonal", 41, "float32")
    k = jax.random.split(jax.random.key(1), 4)
    params = tuple(0.1 * jax.random.normal(k[i], (64, 16)) for i in range(3))
    h0, xs = jnp.zeros((16, 64)), jax.random.normal(k[3], (41, 64))
    plain = jax.jit(jax.grad(loss, ARGNUMS)).lower(params, h0, xs).compile()
    ours = hlopass.jit(jax.grad(loss, ARGNUMS)).trace(params, h0, xs).lower().compile()
    assert ours.memory_analysis().temp_size_in_bytes < 0.5 * plain.memory_analysis().temp_size_in_bytes
    got, want = ours(params, h0, xs), plain(params, h0, xs)     # each compiled once
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):   # float32 sums of 41 steps
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=1e-5 * float(np.abs(w).max()))


@pytest.mark.parametrize("name,reason", [("nonlinear", "non-linear in the state (through tanh)"),
                                         ("gated", "feeds a comparison")])
def test_nonlinear_python_loop_left_alone_and_named(name, reason):
    loss, params, h0, xs = _loop_loss(name, 17, "float32")
    want = jax.jit(jax.grad(loss, ARGNUMS))(params, h0, xs)
    f = hlopass.jit(jax.grad(loss, ARGNUMS), passes=[AdjointPass(chunk=4)])   # options: always probed
    _compare(f(params, h0, xs), want, "float32")
    report = f.trace(params, h0, xs).report
    assert _kinds(report) == []
    (skip,) = [s for s in report.skipped if s.primitive == "loop"]
    assert reason in skip.reason and "Python loop unrolled into 17 steps" in skip.reason
    assert "models.py" in skip.location


def test_nonlinear_python_loop_is_traced_once_by_default(monkeypatch):
    """The backward pass of any loop is linear in its cotangent: that alone asks for no second trace."""
    loss, params, h0, xs = _loop_loss("nonlinear", 17, "float32")
    calls = []
    counted = lambda *a: calls.append(1) or loss(*a)      # noqa: E731
    f = hlopass.jit(jax.grad(counted, ARGNUMS))
    _compare(f(params, h0, xs), jax.jit(jax.grad(loss, ARGNUMS))(params, h0, xs), "float32")
    assert len(calls) == 1


def test_undifferentiated_linear_python_loop_is_traced_once():
    loss, params, h0, xs = _loop_loss("diagonal", 13, "float32")
    calls = []
    counted = lambda *a: calls.append(1) or loss(*a)      # noqa: E731
    f = hlopass.jit(counted)
    np.testing.assert_allclose(f(params, h0, xs), jax.jit(loss)(params, h0, xs), rtol=1e-6)
    assert len(calls) == 1


def _chain_program(T):
    def f(a, b, h):
        for t in range(T):
            h = a * h + b[t]
        return h
    return f


def test_short_loops_are_not_chains_and_lagged_ones_roll_two_steps_at_a_time():
    short = jax.make_jaxpr(_chain_program(MIN_STEPS - 1))(jnp.ones(3), jnp.ones((MIN_STEPS - 1, 3)), jnp.ones(3))
    assert find_chains(short.jaxpr) == []

    def lagged(a, h):                   # h_t reads h_{t-2}: one step of the scan is two of the loop
        hs = [h, 2.0 * h]
        for _ in range(22):
            hs.append(a * hs[-2] + 1.0)
        return hs[-1]
    args = (jnp.linspace(0.5, 0.9, 3), jnp.ones(3))
    closed = jax.make_jaxpr(lagged)(*args)
    (chain,) = find_chains(closed.jaxpr)
    assert chain.period == 2 and len(chain.carry) == 2
    new = rewrite(closed, [roll(closed.jaxpr, chain)])
    np.testing.assert_allclose(jax.jit(jx.jaxpr_as_fun(new))(*args)[0], jax.jit(lagged)(*args), rtol=1e-6)


def test_a_run_of_steps_is_verified_once_per_offset(monkeypatch):
    """The gradient of an unrolled loop: every key of a step recurs with its period, each a candidate
    for the same run; a rotation the verifier turned down is not tried again (240 verifications
    of 38-equation steps became 16 on a 61-step loop), and the chain found is the same."""
    from hlopass.passes.adjoint import chains
    loss, params, h0, xs = _loop_loss("diagonal", 29, "float32")
    closed = jax.make_jaxpr(jax.grad(loss, ARGNUMS))(params, h0, xs)
    tried = []
    verify = chains._verify
    monkeypatch.setattr(chains, "_verify", lambda jaxpr, o, p, steps, *rest: tried.append((o, p, steps))
                        or verify(jaxpr, o, p, steps, *rest))
    found = find_chains(closed.jaxpr)
    assert [c.steps for c in found] == [29]
    assert len(tried) == len(set(tried)), sorted(tried)
    assert len(tried) < 40


@pytest.mark.parametrize("T", [MIN_STEPS, 19])
def test_rolled_chain_equals_the_loop_as_written(T):
    """The roll alone (no adjoint): the same values, the loop's hoisted rows read from the array."""
    with jax.enable_x64(True):
        f = _chain_program(T)
        args = (jnp.linspace(0.5, 0.9, 3), jnp.arange(T * 3.0).reshape(T, 3), jnp.ones(3))
        closed = jax.make_jaxpr(f)(*args)
        (chain,) = find_chains(closed.jaxpr)
        assert chain.steps == T and chain.xs == [(closed.jaxpr.invars[1], 0)]
        new = rewrite(closed, [roll(closed.jaxpr, chain)])
        assert [e.primitive.name for e in new.jaxpr.eqns].count("scan") == 1
        np.testing.assert_allclose(jax.jit(jx.jaxpr_as_fun(new))(*args)[0], jax.jit(f)(*args), rtol=1e-14)


def _with_total(a, w, h0, xs, partials=None):
    """A running total kept in the loop (``loss = loss + f(h)``), as a training loop writes its loss."""
    h, loss = h0, 0.0
    for t in range(xs.shape[0]):
        h = jax.nn.sigmoid(a * xs[t]) * h + w * xs[t]
        loss = loss + jnp.sum(jnp.sin(h) ** 2)
        if partials is not None:
            partials.append(loss)
    return loss + jnp.sum(h ** 2) + (0.0 if partials is None else 0.01 * jnp.sum(jnp.stack(partials) ** 2))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("read_partials", [False, True])
def test_running_total_leaves_the_carry(dtype, read_partials):
    with _x64(dtype):
        k = jax.random.split(jax.random.key(7), 4)
        a, w, h0 = (jax.random.normal(k[i], (2, 5)).astype(dtype) for i in range(3))
        xs = jax.random.normal(k[3], (19, 2, 5)).astype(dtype)
        loss = (lambda *args: _with_total(*args, partials=[])) if read_partials else _with_total
        argnums = (0, 1, 2, 3)
        want = jax.jit(jax.value_and_grad(loss, argnums))(a, w, h0, xs)
        f = hlopass.jit(jax.value_and_grad(loss, argnums))
        _compare(f(a, w, h0, xs), want, dtype)
        report = f.trace(a, w, h0, xs).report
        assert [r.details["steps"] for r in _rolled(report)] == [19]
        assert _kinds(report) == [None, "diagonal"]


def test_a_total_the_state_reads_is_not_a_running_total():
    def loss(a, h0, xs):
        h, total = h0, jnp.zeros_like(h0)
        for t in range(xs.shape[0]):
            h = a * h + xs[t] * jnp.tanh(total)        # the state reads the total: one non-linear carry
            total = total + h
        return jnp.sum(total)
    args = (jnp.full(3, 0.9), jnp.ones(3), jax.random.normal(jax.random.key(2), (11, 3)))
    f = hlopass.jit(jax.grad(loss, (0, 1, 2)), passes=[AdjointPass(chunk=4)])
    _compare(f(*args), jax.jit(jax.grad(loss, (0, 1, 2)))(*args), "float32")
    report = f.trace(*args).report
    assert _kinds(report) == [] and "tanh" in " ".join(s.reason for s in report.skipped)
