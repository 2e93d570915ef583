"""``inline_calls`` splices call bodies into their callers: the result must be what re-tracing
through the bodies gives (the same equations, source lines and name scopes, literal operands folded
as tracing folds them), and compute what the program as written computes, on random nests of calls."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from hlopass import internals as jx
from hlopass.families import INLINABLE
from hlopass.interpreter import PLAIN_CALLS, at_source_of, bind_equation, evaluate, inline_calls
from hlopass.jaxpr_utils import call_body, iter_eqns, map_subjaxprs, trace_flat, dce
from hlopass.report import source_line

N = 7


def retraced(closed, primitives, deep):
    """The reference: every equation bound again, calls evaluated through their bodies."""
    def rule(eqn, invals):
        if eqn.primitive.name in primitives:
            body = call_body(eqn)
            if body is not None:
                with at_source_of(eqn):
                    return evaluate(body.jaxpr, body.consts, invals, eqn_rule=rule)
        if not deep:
            return None
        params = map_subjaxprs(eqn, lambda sub: retraced(sub, primitives, deep))
        return None if params is None else bind_equation(eqn, invals, params)

    in_avals = [v.aval for v in closed.jaxpr.invars]
    return dce(trace_flat(lambda *args: evaluate(closed.jaxpr, closed.consts, args, eqn_rule=rule), in_avals))


def _scale(y, c):
    return y * c + jnp.arange(N, dtype=y.dtype)  # a constant array: the body's own constant


_shared = jax.jit(_scale)


@jax.custom_jvp
def _soft(y):
    return jnp.log1p(jnp.exp(y))


_soft.defjvp(lambda primals, tangents: (_soft(primals[0]), tangents[0] * jax.nn.sigmoid(primals[0])))


def _step(kind: str):
    """One piece of a program on ``y`` (f32[N]); each writes a call in its own way."""
    if kind == "literal":  # a Python scalar operand: a literal once inlined, folded where tracing folds
        return lambda y: jax.jit(lambda a, c: a * jnp.asarray(c, a.dtype))(y, 3)
    if kind == "shared":  # one body (one jaxpr object) at two call sites
        return lambda y: _shared(_shared(y, 2.0), y[0])
    if kind == "forward":  # results that are the body's inputs and a literal
        return lambda y: (lambda a, b, c: a + b * c)(*jax.jit(lambda a, b: (b, a, 1.5))(y, y + 1))
    if kind == "drop":  # a result nobody reads
        return lambda y: jax.jit(lambda a: (jnp.sin(a), jnp.cos(a)))(y)[0]
    if kind == "nested":
        return lambda y: jax.jit(lambda a: jax.jit(jnp.tanh)(a) * 2)(y)
    if kind == "remat":
        return lambda y: jax.checkpoint(lambda a: jnp.sin(a) ** 2)(y)
    if kind == "custom_jvp":
        return _soft
    if kind == "scan":  # a call inside a loop body: inlined only with deep
        def scanned(y):
            def body(carry, x):
                return jax.jit(lambda c, v: c * 0.5 + v)(carry, x), carry
            final, ys = jax.lax.scan(body, y, jnp.stack([y, y * 2]))
            return final + ys.sum(0)
        return scanned
    raise ValueError(kind)


KINDS = ["literal", "shared", "forward", "drop", "nested", "remat", "custom_jvp", "scan"]


def _program(kinds):
    def f(y):
        for kind in kinds:
            y = _step(kind)(y)
        return y
    return f


def _signature(closed, deep):
    eqns = iter_eqns(closed) if deep else closed.jaxpr.eqns
    return [(e.primitive.name, str(e.source_info.name_stack), source_line(e)) for e in eqns]


@settings(max_examples=40, deadline=None)
@given(kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=5), deep=st.booleans(),
       custom=st.booleans(), x64=st.booleans())
def test_spliced_calls_are_what_retracing_gives(kinds, deep, custom, x64):
    dtype = np.float64 if x64 else np.float32
    with jax.enable_x64(x64):
        x = jnp.asarray(np.linspace(-1.0, 1.0, N), dtype)
        closed = jax.make_jaxpr(_program(kinds))(x)
        primitives = INLINABLE if custom else PLAIN_CALLS
        spliced = inline_calls(closed, primitives, deep=deep)
        reference = retraced(closed, primitives, deep)
        jx.check_jaxpr(spliced.jaxpr)
        assert _signature(spliced, deep) == _signature(reference, deep)
        left = [e.primitive.name for e in (iter_eqns(spliced) if deep else spliced.jaxpr.eqns)
                if e.primitive.name in primitives and call_body(e) is not None]
        assert not left
        want = jax.jit(jx.jaxpr_as_fun(closed))(x)
        got = jax.jit(jx.jaxpr_as_fun(spliced))(x)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_program_without_calls_comes_back_as_it_is():
    closed = jax.make_jaxpr(lambda y: jnp.sin(y) * 2)(jnp.ones(N))
    assert inline_calls(closed, deep=True) is closed


def test_a_body_called_twice_gets_fresh_variables_each_time():
    closed = jax.make_jaxpr(_step("shared"))(jnp.ones(N))
    spliced = inline_calls(closed)
    binders = [v for e in spliced.jaxpr.eqns for v in e.outvars]
    assert len(binders) == len(set(binders))
    assert collections.Counter(e.primitive.name for e in spliced.jaxpr.eqns)["mul"] == 2
