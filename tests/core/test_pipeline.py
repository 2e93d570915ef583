"""The rewriting interpreter, the graph view, pass reports and the pipeline's safety nets."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlopass
from hlopass.graph import DataflowGraph
from hlopass.interpreter import Replacement, rewrite
from hlopass.jaxpr_utils import aval_nbytes, count_equations, iter_eqns, trace_flat
from hlopass.pipeline import ENV_RAISE, run_pipeline


@hlopass.register_pass
class SquareToMul(hlopass.Pass):
    """Test pass: matches ``integer_pow(x, 2)`` and emits ``x * x``, at every nesting level."""

    name = "test_square_to_mul"

    def run_level(self, closed, config, report):
        replacements = []
        for i, eqn in enumerate(closed.jaxpr.eqns):
            if eqn.primitive.name == "integer_pow" and eqn.params["y"] == 2:
                replacements.append(Replacement([i], eqn.invars, eqn.outvars, lambda v: [v * v]))
                report.rewrite("square", eqn, "x**2 -> x*x")
        return rewrite(closed, replacements) if replacements else closed


@hlopass.register_pass
class Broken(hlopass.Pass):
    """Test pass that always raises."""

    name = "test_broken"

    def run_level(self, closed, config, report):
        raise RuntimeError("deliberately broken")


@hlopass.register_pass
class SignatureChanger(hlopass.Pass):
    """Test pass that returns a program with a different output shape."""

    name = "test_bad_signature"
    recursive = False

    def run_level(self, closed, config, report):
        return trace_flat(lambda *a: [jnp.zeros(3)], closed.in_avals)


def squares_everywhere(x):
    def body(carry, row):
        return carry + row ** 2, (row ** 2).sum()
    total, per_row = jax.lax.scan(body, jnp.zeros(x.shape[1]), x)
    return total.sum() + (x ** 2).sum() + per_row.sum()


def test_pass_rewrites_top_level_and_inside_scan_with_source_lines():
    x = jnp.arange(12.0).reshape(4, 3)
    h = hlopass.jit(squares_everywhere, passes="test_square_to_mul")
    np.testing.assert_allclose(h(x), squares_everywhere(x), rtol=1e-6)
    traced = h.trace(x)
    assert not any(e.primitive.name == "integer_pow" for e in iter_eqns(traced.rewritten_jaxpr))
    assert any(e.primitive.name == "integer_pow" for e in iter_eqns(traced.original_jaxpr))
    rewrites = traced.report.rewrites
    assert len(rewrites) == 3
    assert all(r.location.startswith("test_pipeline.py:") and "squares_everywhere" in r.location or
               "body" in r.location for r in rewrites)
    assert "x**2 -> x*x" in str(traced.report)


def test_gradient_of_rewritten_function():
    x = jnp.arange(12.0).reshape(4, 3) / 7
    h = hlopass.jit(squares_everywhere, passes="test_square_to_mul")
    np.testing.assert_allclose(jax.grad(h)(x), jax.grad(squares_everywhere)(x), rtol=1e-6)


def test_failing_pass_is_skipped_and_reported(monkeypatch, caplog):
    monkeypatch.setenv(ENV_RAISE, "0")
    h = hlopass.jit(lambda x: jnp.sin(x) * 2, passes="test_broken")
    with caplog.at_level(logging.WARNING, logger="hlopass"):
        np.testing.assert_allclose(h(jnp.ones(3)), jnp.sin(jnp.ones(3)) * 2)
    assert "deliberately broken" in caplog.text
    assert "deliberately broken" in str(h.trace(jnp.ones(3)).report)


def test_signature_change_is_refused(monkeypatch):
    monkeypatch.setenv(ENV_RAISE, "1")
    with pytest.raises(TypeError, match="changed the program's signature"):
        hlopass.jit(lambda x: x + 1, passes="test_bad_signature")(jnp.ones(4))


def test_interpreter_orders_replacements_by_dependencies():
    def f(x):
        a = jnp.sin(x)
        b = jnp.cos(x)
        c = a * 2
        return c + b
    closed = jax.make_jaxpr(f)(jnp.ones(3))
    eqns = closed.jaxpr.eqns
    # Replace {sin, mul} (0 and 2) by one builder; cos (1) sits between them.
    rep = Replacement([0, 2], [closed.jaxpr.invars[0]], [eqns[2].outvars[0]], lambda v: [jnp.sin(v) * 2])
    new = rewrite(closed, [rep])
    out = jax.core.eval_jaxpr(new.jaxpr, new.consts, jnp.arange(3.0))[0]
    np.testing.assert_allclose(out, f(jnp.arange(3.0)), rtol=1e-6)


def test_interpreter_rejects_non_convex_regions():
    def f(x):
        a = jnp.sin(x)
        b = jnp.cos(a)
        return jnp.exp(b) + a
    closed = jax.make_jaxpr(f)(jnp.ones(3))
    eqns = closed.jaxpr.eqns
    # {sin, exp} with cos outside: a path leaves (sin->cos) and re-enters (cos->exp).
    rep = Replacement([0, 2], [closed.jaxpr.invars[0], eqns[1].outvars[0]],
                      [eqns[0].outvars[0], eqns[2].outvars[0]], lambda v, b: [jnp.sin(v), jnp.exp(b)])
    assert not DataflowGraph(closed).is_convex([0, 2])
    with pytest.raises(ValueError, match="not convex"):
        rewrite(closed, [rep])


def test_graph_view():
    def f(x, y):
        d = x[:, None, :] - y[None, :, :]
        return jnp.sum(d ** 2, -1)
    closed = jax.make_jaxpr(f)(jnp.ones((50, 3)), jnp.ones((40, 3)))
    graph = DataflowGraph(closed)
    large = graph.large_equations(10_000)
    assert [graph.eqn(i).primitive.name for i in large] == ["sub", "integer_pow"]
    reducer = len(closed.jaxpr.eqns) - 1
    assert set(large) <= graph.ancestors(reducer)
    assert "test_pipeline.py" in graph.describe(large[0])
    assert graph.is_output(closed.jaxpr.outvars[0])


def test_pipeline_is_cached_per_jaxpr_and_config():
    closed = jax.make_jaxpr(lambda x: x ** 2)(jnp.ones(3))
    config = hlopass.resolve_config({"passes": "test_square_to_mul"})
    first = run_pipeline(closed, config)
    assert run_pipeline(closed, config) is first
    assert run_pipeline(closed, hlopass.resolve_config({"passes": "none"})) is not first


def test_sizes_and_counts():
    closed = jax.make_jaxpr(squares_everywhere)(jnp.ones((4, 3)))
    assert count_equations(closed) > len(closed.jaxpr.eqns)
    assert aval_nbytes(jax.core.ShapedArray((10, 10), jnp.float32)) == 400
    assert aval_nbytes(jax.core.ShapedArray((), jnp.bfloat16)) == 2


def square_in_while(x):
    return jax.lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] ** 2 * 0.5), (0, x))[1]


def square_in_cond(x):
    return jax.lax.cond(x.sum() > 0, lambda v: v ** 2, lambda v: -v, x)


@jax.custom_jvp
def square_custom_jvp(x):
    return x ** 2


square_custom_jvp.defjvp(lambda primals, tangents: (primals[0] ** 2, 2 * primals[0] * tangents[0]))


@jax.custom_vjp
def square_custom_vjp(x):
    return x ** 2


square_custom_vjp.defvjp(lambda x: (x ** 2, x), lambda x, g: (2 * x * g,))


def square_in_checkpoint(x):
    return jax.checkpoint(lambda v: jnp.sin(v ** 2))(x)


@pytest.mark.parametrize("fun", [square_in_while, square_in_cond, square_custom_jvp, square_custom_vjp,
                                 square_in_checkpoint], ids=lambda f: f.__name__)
def test_passes_reach_inside_sub_jaxprs(fun):
    x = jnp.linspace(0.1, 1.3, 7)
    h = hlopass.jit(fun, passes="test_square_to_mul")
    np.testing.assert_allclose(h(x), jax.jit(fun)(x), rtol=1e-6)
    traced = h.trace(x)
    assert any(e.primitive.name == "integer_pow" for e in iter_eqns(traced.original_jaxpr))
    assert not any(e.primitive.name == "integer_pow" for e in iter_eqns(traced.rewritten_jaxpr))
    assert traced.report.rewrites
    if fun is square_in_while:  # JAX cannot reverse-differentiate a while_loop; forward mode it can
        np.testing.assert_allclose(jax.jvp(h, (x,), (x,))[1], jax.jvp(fun, (x,), (x,))[1], rtol=1e-6)
    else:
        np.testing.assert_allclose(jax.grad(lambda v: h(v).sum())(x), jax.grad(lambda v: fun(v).sum())(x),
                                   rtol=1e-6)


def test_passes_do_not_enter_a_nested_hlopass_program():
    """An inner hlopass function is its own program with its own settings: the outer pipeline leaves
    it alone, and it runs its own pipeline once."""
    inner = hlopass.jit(lambda v: jnp.sin(v ** 2), passes="none")
    outer = hlopass.jit(lambda v: inner(v) + v ** 2, passes="test_square_to_mul")
    x = jnp.linspace(0.1, 1.3, 7)
    np.testing.assert_allclose(outer(x), jnp.sin(x ** 2) + x ** 2, rtol=1e-6)
    traced = outer.trace(x)
    assert len(traced.report.rewrites) == 1  # the outer x ** 2 only
    nested = [e for e in traced.rewritten_jaxpr.jaxpr.eqns if e.primitive.name == "hlopass_call"]
    assert len(nested) == 1 and nested[0].params["config"].pass_names == ()
    assert any(e.primitive.name == "integer_pow" for e in nested[0].params["jaxpr"].jaxpr.eqns)
    labels = [r.label for r in hlopass.reports(outer, x)]
    assert len(labels) == 2  # hlopass.reports still finds the nested program


def test_source_lines_name_the_users_code_not_hlopass():
    h = hlopass.jit(lambda v: jnp.exp(v) * 2)
    closed = jax.make_jaxpr(lambda v: h(v) + 1)(jnp.ones(3))
    eqn = next(e for e in closed.jaxpr.eqns if e.primitive.name == "hlopass_call")
    from hlopass.report import source_line
    assert source_line(eqn).startswith("test_pipeline.py:"), source_line(eqn)
    text = jax.jit(lambda v: h(v) + 1).lower(jnp.ones(3)).as_text(debug_info=True)
    assert "test_pipeline.py" in text and "api.py" not in text and "call.py" not in text
