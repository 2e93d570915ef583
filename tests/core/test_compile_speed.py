"""Issue 27, compile in seconds: the pipeline's gates (a program with nothing to do goes to XLA as
written, no pass run)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlopass
from hlopass import pipeline
from hlopass.jaxpr_utils import largest_value_bytes
from hlopass.pass_base import ProgramFacts
from tests.core.spy_pass import RUNS


def small(x, y):
    return jnp.sum(jnp.tanh(x @ y.T), 1)


def args():
    rng = np.random.default_rng(0)
    return rng.standard_normal((64, 8), np.float32), rng.standard_normal((32, 8), np.float32)


@pytest.fixture(autouse=True)
def _fresh_counts():
    RUNS.clear()
    yield
    RUNS.clear()


# -- nothing to do costs nothing ---------------------------------------------------------------------

def test_nothing_to_do_runs_no_pass_and_equals_jax_jit(monkeypatch):
    def no_inlining(*a, **k):
        raise AssertionError("the pipeline inlined calls of a program with nothing to do")
    monkeypatch.setattr(pipeline, "inline_calls", no_inlining)
    f = hlopass.jit(small, passes="hvp,adjoint,test_spy_gated,remat")
    out = f(*args())
    assert RUNS["test_spy_gated"] == 0
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(small)(*args())))
    report = f.trace(*args()).report
    assert [p.ran for p in report.passes] == [False] * 4
    assert "not run (nothing for it to do)" in str(report)
    assert "hlopass_small" in f.lower(*args()).as_text()  # the program as written, in its call


def test_gate_opens_above_the_threshold():
    f = hlopass.jit(small, passes="test_spy_gated", threshold="1kB")  # x @ y.T is 8 kB
    f(*args())
    assert RUNS["test_spy_gated"] == 1
    assert [p.ran for p in f.trace(*args()).report.passes] == [True]


def test_default_pipeline_gates():
    """hvp and adjoint act while tracing and remat only over the memory limit: none runs on a
    small program; the passes with no gate of their own still run (they may rewrite small programs)."""
    report = hlopass.jit(small).trace(*args()).report
    ran = {p.name: p.ran for p in report.passes}
    assert ran["hvp"] is False and ran["adjoint"] is False and ran["remat"] is False
    assert ran["algebraic"] and ran["matrix_chain"]
    tight = hlopass.jit(small, memory_limit="1kB", threshold="off").trace(*args()).report
    assert {p.name: p.ran for p in tight.passes}["remat"] is True


def test_facts_read_every_value_sub_programs_and_inputs_included():
    def in_scan(x):
        def body(c, row):
            return c + jnp.sum(jnp.exp(row[:, None] * x[None, :])), None  # 4000 x 4000 inside the body only
        return jax.lax.scan(body, 0.0, x.reshape(4, 1000))[0]
    closed = jax.make_jaxpr(in_scan)(jnp.ones(4000))
    assert largest_value_bytes(closed) == 1000 * 4000 * 4
    assert max(v.aval.size * 4 for e in closed.jaxpr.eqns for v in e.outvars) < 1000 * 4000 * 4
    big_input = jax.make_jaxpr(lambda x: x[:2])(jnp.ones(10_000))
    assert ProgramFacts(big_input).largest_bytes == 40_000
    facts = ProgramFacts(closed)
    assert facts.above(1_000_000) and not facts.above(None) and not facts.over(None)
