"""``rewrite`` traces only the replacements' builders and splices their equations in among the
untouched ones: the result must be what tracing the whole program again gives (``retrace``: the same
equations, source lines and name scopes, the same values), on random programs with random
replacements, including builders that read literals and constants, forward an input, return a
constant, or build a value of another type (then ``rewrite`` traces the whole program again)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from hlopass import interpreter
from hlopass import internals as jx
from hlopass.graph import DataflowGraph
from hlopass.interpreter import Replacement, bind_equation, retrace, rewrite
from hlopass.jaxpr_utils import dce
from hlopass.report import source_line

N = 6
CONSTANT = np.linspace(0.5, 1.5, N)


def _piece(kind: str):
    if kind == "sin":
        return jnp.sin
    if kind == "scale":  # a literal operand
        return lambda y: y * 2.5
    if kind == "constant":  # a constant array of the program
        return lambda y: y + jnp.asarray(CONSTANT, y.dtype)
    if kind == "total":  # a reduction read again by a broadcast
        return lambda y: y - jnp.sum(y) / N
    if kind == "scoped":
        return lambda y: jax.named_scope("inner")(lambda a: jnp.exp(-a * a))(y)
    if kind == "pair":
        return lambda y: jnp.stack([y, y * y]).max(0)
    if kind == "where":
        return lambda y: jnp.where(y > 0, y, 0.1 * y)
    if kind == "cast":  # conversions of a scalar: folded by tracing when it becomes a literal
        return lambda y: y * jnp.sum(y).astype(jnp.int32).astype(y.dtype)
    raise ValueError(kind)


KINDS = ["sin", "scale", "constant", "total", "scoped", "pair", "where", "cast"]


def _program(kinds):
    def f(y):
        for kind in kinds:
            y = _piece(kind)(y)
        return y, jnp.sum(y * y)
    return f


def _region(jaxpr, graph, start: int, length: int):
    """Equations ``start .. start+length-1`` (consecutive, so convex): their inputs and the results read
    outside them."""
    eqns = list(range(start, min(start + length, len(jaxpr.eqns))))
    inside = {v for i in eqns for v in jaxpr.eqns[i].outvars}
    inputs = []
    for i in eqns:
        for a in jaxpr.eqns[i].invars:
            if isinstance(a, jx.Var) and a not in inside and a not in inputs:
                inputs.append(a)
    outputs = [v for i in eqns for v in jaxpr.eqns[i].outvars
               if not isinstance(v, jx.DropVar) and (graph.is_output(v) or any(j not in eqns for j in graph.uses(v)))]
    return eqns, inputs, outputs


def _builder(jaxpr, eqns, inputs, outputs, how: str):
    def build(*values):
        env = dict(zip(inputs, values))
        for i in eqns:
            eqn = jaxpr.eqns[i]
            results = bind_equation(eqn, [a.val if isinstance(a, jx.Literal) else env[a] for a in eqn.invars])
            env.update(zip(eqn.outvars, results))
        outs = [env[v] for v in outputs]
        if how == "twice":  # the same values through other equations
            outs = [o * 1 if jnp.issubdtype(o.dtype, jnp.inexact) else o for o in outs]
        elif how == "constant":  # a constant in place of the first result
            outs[0] = jnp.full(outputs[0].aval.shape, 0.75, outputs[0].aval.dtype)
        elif how == "forward" and inputs and inputs[0].aval == outputs[0].aval:
            outs[0] = values[0]
        elif how == "python scalar" and outputs[0].aval.shape == ():
            outs[0] = 0.5  # weakly typed: another type than the value it replaces
        elif how == "scalar constant" and outputs[0].aval.shape == () and not outputs[0].aval.weak_type:
            outs[0] = np.asarray(2.0, outputs[0].aval.dtype)  # a literal of the same type: readers fold it
        return outs
    return build


def _signature(closed):
    return [(e.primitive.name, str(e.source_info.name_stack), source_line(e)) for e in closed.jaxpr.eqns]


@settings(max_examples=80, deadline=None)
@given(kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=5), x64=st.booleans(),
       picks=st.lists(st.tuples(st.floats(0, 1), st.integers(1, 3),
                                st.sampled_from(["rebind", "twice", "constant", "forward", "python scalar",
                                                 "scalar constant"])),
                      min_size=1, max_size=3))
def test_spliced_replacements_are_what_tracing_again_gives(kinds, x64, picks):
    dtype = np.float64 if x64 else np.float32
    with jax.enable_x64(x64):
        x = jnp.asarray(np.linspace(-1.0, 1.0, N), dtype)
        closed = jax.make_jaxpr(_program(kinds))(x)
        jaxpr, graph = closed.jaxpr, DataflowGraph(closed.jaxpr)
        replacements, taken = [], set()
        for where, length, how in picks:
            start = min(int(where * len(jaxpr.eqns)), len(jaxpr.eqns) - 1)
            eqns, inputs, outputs = _region(jaxpr, graph, start, length)
            if taken & set(eqns) or not outputs:
                continue
            taken |= set(eqns)
            replacements.append(Replacement(eqns, inputs, outputs, _builder(jaxpr, eqns, inputs, outputs, how)))
        spliced = rewrite(closed, replacements)
        reference = dce(retrace(closed, replacements))
        jx.check_jaxpr(spliced.jaxpr)
        assert _signature(spliced) == _signature(reference)
        got = jax.jit(jx.jaxpr_as_fun(spliced))(x)
        want = jax.jit(jx.jaxpr_as_fun(reference))(x)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_untouched_equations_are_kept_and_only_the_builder_is_traced(monkeypatch):
    closed = jax.make_jaxpr(_program(["sin", "scale", "total"]))(jnp.ones(N))
    jaxpr, graph = closed.jaxpr, DataflowGraph(closed.jaxpr)
    eqns, inputs, outputs = _region(jaxpr, graph, 1, 1)
    replacement = Replacement(eqns, inputs, outputs, _builder(jaxpr, eqns, inputs, outputs, "twice"))
    bound = []
    monkeypatch.setattr(interpreter, "bind_equation", lambda eqn, *a, **k: bound.append(eqn) or bind_equation(eqn, *a, **k))
    new = rewrite(closed, [replacement])
    assert not bound  # nothing was bound again through the interpreter
    kept = [e for e in new.jaxpr.eqns if any(e is old for old in jaxpr.eqns)]
    untouched = [e for i, e in enumerate(jaxpr.eqns) if i not in eqns and not any(a in outputs for a in e.invars)]
    assert kept == untouched  # the equations reading the built value only read its new variable
    assert [e.primitive.name for e in new.jaxpr.eqns].count("mul") == 1 + [e.primitive.name for e in jaxpr.eqns].count("mul")


def test_a_built_value_of_another_type_traces_the_whole_program_again():
    closed = jax.make_jaxpr(lambda y: jnp.sum(y) * 2.0)(jnp.ones(N))
    jaxpr, graph = closed.jaxpr, DataflowGraph(closed.jaxpr)
    total = next(i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "reduce_sum")
    eqns, inputs, outputs = _region(jaxpr, graph, total, 1)
    new = rewrite(closed, [Replacement(eqns, inputs, outputs, lambda *v: [0.5])])
    reference = dce(retrace(closed, [Replacement(eqns, inputs, outputs, lambda *v: [0.5])]))
    assert _signature(new) == _signature(reference)
    assert float(jax.jit(jx.jaxpr_as_fun(new))(jnp.ones(N))[0]) == 1.0


def test_a_built_literal_is_folded_into_its_readers_as_tracing_folds_it():
    closed = jax.make_jaxpr(_program(["cast"]))(jnp.ones(N))
    jaxpr, graph = closed.jaxpr, DataflowGraph(closed.jaxpr)
    total = next(i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "reduce_sum")
    eqns, inputs, outputs = _region(jaxpr, graph, total, 1)
    replacement = Replacement(eqns, inputs, outputs, _builder(jaxpr, eqns, inputs, outputs, "scalar constant"))
    spliced, reference = rewrite(closed, [replacement]), dce(retrace(closed, [replacement]))
    assert _signature(spliced) == _signature(reference)
    assert "convert_element_type" not in [e.primitive.name for e in spliced.jaxpr.eqns], spliced
