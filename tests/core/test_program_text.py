"""The persistent cache's name for a program (:func:`hlopass.jaxpr_utils.program_text`): programs
that print differently, or differ only in a constant's value, get different names; the same program
gets the same name in every trace and every process."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from hlopass.jaxpr_utils import program_text
from tests.fuzz.exclusions import excluded
from tests.fuzz.programs import float_inputs, programs
from tests.fuzz.runner import _value_and_grad, well_posed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _traced(program, grad: bool = False):
    """``program``'s jaxpr, or with ``grad`` its value and gradient's as the fuzzer takes them
    (``None`` where the fuzzer does not differentiate it)."""
    inputs = program.make_inputs()
    if not grad:
        return jax.make_jaxpr(program.fn)(*inputs)
    floats = float_inputs(program.inputs)
    if not floats or not well_posed(program, "grad_out") or excluded(program, "grad_out"):
        return None
    try:
        return jax.make_jaxpr(_value_and_grad(program.fn, floats))(*inputs)
    except (NotImplementedError, TypeError, ValueError):  # JAX cannot differentiate it (a cond under a
        return None                                       # custom_jvp: no transpose of stop_gradient)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(programs(), programs(), st.booleans())
def test_programs_that_print_differently_are_named_differently(a, b, grad):
    """Random programs (their gradients too): a different print is a different name, and tracing a
    program again gives it the same name."""
    assume(all(well_posed(p, "value") and not excluded(p, "value") for p in (a, b)))  # as the fuzzer draws them
    first, second = _traced(a, grad), _traced(b, grad)
    if first is None or second is None:  # no float input to differentiate, or not differentiable
        first, second = _traced(a), _traced(b)
        grad = False
    if str(first.jaxpr) != str(second.jaxpr):
        assert program_text(first) != program_text(second)
    assert program_text(_traced(a, grad)) == program_text(first)


def test_the_same_program_is_named_the_same_in_every_trace():
    def f(x, w):
        return jnp.sum(jax.nn.softmax(x @ w, axis=-1) ** 2)
    args = (jnp.ones((7, 5)), jnp.ones((5, 3)))
    texts = {program_text(jax.make_jaxpr(jax.grad(lambda *a: f(*a), argnums=1))(*args)) for _ in range(3)}
    assert len(texts) == 1


@pytest.mark.parametrize("variant", ["axis", "literal_dtype", "shape", "dtype", "primitive"])
def test_small_differences_change_the_name(variant):
    x = jnp.ones((6, 6), jnp.float32)
    base = lambda x: jnp.sum(jnp.sin(x) * 2.0, axis=0)  # noqa: E731
    other = {
        "axis": lambda x: jnp.sum(jnp.sin(x) * 2.0, axis=1),   # only a parameter differs: same shapes
        "literal_dtype": lambda x: jnp.sum(jnp.sin(x) * np.float32(2.0).astype(np.float16).astype(np.float32)
                                          * jnp.int32(2), axis=0),
        "shape": None,
        "dtype": None,
        "primitive": lambda x: jnp.sum(jnp.cos(x) * 2.0, axis=0),
    }[variant]
    if variant == "shape":
        first, second = jax.make_jaxpr(base)(x), jax.make_jaxpr(base)(jnp.ones((6, 7), jnp.float32))
    elif variant == "dtype":
        first, second = jax.make_jaxpr(base)(x), jax.make_jaxpr(base)(x.astype(jnp.bfloat16))
    else:
        first, second = jax.make_jaxpr(base)(x), jax.make_jaxpr(other)(x)
    assert str(first.jaxpr) != str(second.jaxpr)
    assert program_text(first) != program_text(second)


def test_constants_differing_only_in_value_change_the_name():
    """Constants are not printed by ``str(jaxpr)``: their values are digested, at the top level and
    inside sub-programs (a ``closed_call`` body holding its own constants)."""
    x = jnp.ones((3,), jnp.float32)

    def top(value):
        c = np.full((3,), value, np.float32)
        return jax.make_jaxpr(lambda x: x * c)(x)

    assert str(top(1.0).jaxpr) == str(top(2.0).jaxpr)
    assert program_text(top(1.0)) != program_text(top(2.0))
    assert program_text(top(1.0)) == program_text(top(1.0))

    from hlopass import internals as jx
    outer_one, outer_two = _closed_call_of(jx, 1.0, x), _closed_call_of(jx, 2.0, x)
    assert any(isinstance(p, jx.ClosedJaxpr) and p.consts for e in outer_one.jaxpr.eqns for p in e.params.values())
    assert program_text(outer_one) != program_text(outer_two)


def _closed_call_of(jx, value, x):
    """A program whose one equation's sub-program keeps a constant of ``value`` as a constant of its own."""
    c = np.full((3,), value, np.float32)
    body = jax.make_jaxpr(lambda x: x * c)(x)
    assert body.consts
    return jx.ClosedJaxpr(jx.Jaxpr([], [v := jx.Var(body.in_avals[0])], [w := jx.Var(body.out_avals[0])],
                                   [jx.new_jaxpr_eqn([v], [w], jx.closed_call_p, {"call_jaxpr": body},
                                                     body.effects)]), [])


CHILD = """
import jax, jax.numpy as jnp
from hlopass.jaxpr_utils import program_text
def f(x):
    return x * jax.random.normal(jax.random.PRNGKey(0), x.shape)
print("TEXT", program_text(jax.make_jaxpr(f)(jnp.ones(4))))
"""


def test_a_program_drawing_random_numbers_has_one_name_in_every_process():
    """A PRNG implementation's repr holds the addresses of its functions: left out of the name."""
    texts = set()
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=120)
        lines = [line for line in done.stdout.splitlines() if line.startswith("TEXT ")]
        assert lines, done.stderr[-2000:]
        texts.add(lines[0])
    assert len(texts) == 1 and " at 0x" not in texts.pop()
