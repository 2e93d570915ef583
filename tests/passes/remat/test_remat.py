"""The remat pass: gradients equal to ``jax.jit``'s under limits that force recomputation, both
ways JAX can differentiate, for MLPs, residual networks, scans over layers and a Transformer; the
footprint XLA reports within the limit; the report naming what was recomputed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlopass import internals as jx

import hlopass
from hlopass.checked import _primitive_calls
from hlopass.memory import measure
from hlopass.jaxpr_utils import is_backward
from hlopass.passes.remat.chain import backward_pass
from hlopass.passes.remat.primal import backward_program

from .models import assert_tree_close, make, plain

#: float32 results may differ from jax.jit's by reordering only (the models are conditioned so
#: that float32 and float64 gradients agree to ~1e-6)
RTOL32 = 2e-5


def remat_report(report):
    return next(p for p in report.passes if p.name == "remat")


def split_backward_footprint(loss, params, x, threshold=None) -> int:
    """XLA's footprint of the backward call of ``jax.grad`` of a hlopass function, unrewritten."""
    closed = jax.make_jaxpr(loss)(params, x)
    program = backward_program(closed, threshold)
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in program.in_avals]
    return measure(jax.jit(jx.jaxpr_as_fun(program)).lower(*args).compile()).footprint


def check_grad_inside(name, layers=6, width=32, batch=256, dtype=jnp.float32, rtol=RTOL32, cut=0.2):
    """``hlopass.jit(jax.grad(loss))`` under a limit ``cut`` of plain's temporaries below its footprint."""
    loss, params, x = make(name, layers, width, batch, dtype)
    grad = jax.grad(loss)
    want = jax.jit(grad)(params, x)
    before = plain(grad, params, x)
    limit = int(before.footprint - cut * before.temp_bytes)
    lowered = hlopass.jit(grad, memory_limit=limit, strict=True).trace(params, x).lower()
    compiled = lowered.compile()                        # strict: raises if over the limit
    assert_tree_close(compiled(params, x), want, rtol)
    assert lowered.memory_check.footprint <= limit < before.footprint
    report = remat_report(lowered.report)
    kinds = {r.kind for r in report.rewrites}
    assert kinds & {"recompute", "checkpointed_scan"} and "memory" in kinds, report
    memory = next(r for r in report.rewrites if r.kind == "memory")
    assert memory.details["measured"] == lowered.memory_check.footprint and memory.details["predicted"] > 0
    assert memory.details["extra_seconds"] > 0
    return report


def check_grad_of_hlopass(name, layers=6, width=32, batch=256, dtype=jnp.float32, rtol=RTOL32, keep=0.8):
    """``jax.grad(hlopass.jit(loss))`` (eager and under ``jax.jit``) under ``keep`` of the footprint of
    the backward call JAX's split would run unrewritten."""
    loss, params, x = make(name, layers, width, batch, dtype)
    want = jax.jit(jax.grad(loss))(params, x)
    limit = int(keep * split_backward_footprint(loss, params, x))
    f = hlopass.jit(loss, memory_limit=limit, strict=True, threshold="off")
    _primitive_calls.clear()
    got = jax.grad(f)(params, x)                           # eager: each call checked, strict
    assert_tree_close(got, want, rtol)
    footprints = [c.footprint for calls in _primitive_calls.values() for jitted in calls.values()
                  for c in jitted.checks]
    assert len(footprints) == 2 and max(footprints) <= limit
    assert_tree_close(jax.jit(jax.grad(f))(params, x), want, rtol)
    reports = hlopass.reports(jax.grad(f), params, x)
    rewrites = [r for rep in reports for r in remat_report(rep).rewrites]
    assert {"recompute", "checkpointed_scan"} & {r.kind for r in rewrites}, reports
    return rewrites


@pytest.mark.parametrize("name", ["mlp", "resnet", "scan_mlp"])
def test_grad_inside_the_hlopass_function(name):
    check_grad_inside(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["scan_resnet", "scan_reversed", "scan_outputs"])
def test_grad_inside_the_hlopass_function_more(name):
    check_grad_inside(name)


@pytest.mark.parametrize("name", ["mlp", "scan_mlp"])
def test_grad_of_a_hlopass_function(name):
    check_grad_of_hlopass(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet", "scan_resnet"])
def test_grad_of_a_hlopass_function_more(name):
    check_grad_of_hlopass(name)


def test_a_gradient_inside_the_forward_pass_is_forward_computation():
    """Fuzz batch s201549705917: forward equations read what a gradient taken inside the forward pass
    computed (equations with ``transpose(...)`` in their name stack). Those equations are forward
    computation of the outer gradient, recomputed with it, not a backward pass to recompute for."""
    def loss(params, x):
        inner = jax.grad(lambda z: jnp.sum(jnp.tanh(z) ** 2))(x)
        h = x * inner
        for w in params:
            h = jnp.tanh(h @ w) * inner
        return jnp.sum(h ** 2)

    keys = jax.random.split(jax.random.key(0), 7)
    params = [jax.random.normal(k, (32, 32)) / 6 for k in keys[:6]]
    x = jax.random.normal(keys[6], (256, 32))
    grad = jax.grad(loss)
    before = plain(grad, params, x)
    limit = int(before.footprint - 0.2 * before.temp_bytes)
    lowered = hlopass.jit(grad, passes="remat", memory_limit=limit, strict=True).trace(params, x).lower()
    assert_tree_close(lowered.compile()(params, x), jax.jit(grad)(params, x), RTOL32)
    assert lowered.memory_check.footprint <= limit
    assert "recompute" in {r.kind for r in remat_report(lowered.report).rewrites}


def test_an_update_reading_the_gradients_keeps_the_backward_pass():
    """An optimizer's update reads the gradients and feeds no backward equation: the backward pass
    stays what JAX's transposition emitted, and the step under a limit recomputes as the gradient
    alone would."""
    loss, params, x = make("mlp", 6, 32, 256, jnp.float32)

    def step(params, x):
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, jax.grad(loss)(params, x))

    eqns = jax.make_jaxpr(step)(params, x).jaxpr.eqns
    assert backward_pass(eqns) == [is_backward(e) for e in eqns] and any(backward_pass(eqns))
    before = plain(step, params, x)
    limit = int(before.footprint - 0.2 * before.temp_bytes)
    lowered = hlopass.jit(step, passes="remat", memory_limit=limit, strict=True).trace(params, x).lower()
    assert_tree_close(lowered.compile()(params, x), jax.jit(step)(params, x), RTOL32)
    assert "recompute" in {r.kind for r in remat_report(lowered.report).rewrites}


@pytest.mark.slow
def test_transformer_both_ways():
    check_grad_inside("transformer", layers=3, width=32, batch=256)
    check_grad_of_hlopass("transformer", layers=3, width=32, batch=256)


def test_odd_sizes():
    # 7 layers (prime: the scan's blocks cannot all be equal), width 31, batch 257
    check_grad_inside("mlp", layers=7, width=31, batch=257)
    report = check_grad_inside("scan_mlp", layers=7, width=31, batch=257)
    assert any(r.kind == "checkpointed_scan" for r in report.rewrites)


@pytest.mark.slow
def test_float64():
    with jax.enable_x64(True):
        check_grad_inside("resnet", layers=5, dtype=jnp.float64, rtol=1e-12)
        check_grad_of_hlopass("mlp", layers=5, dtype=jnp.float64, rtol=1e-12)


def test_report_names_source_lines_and_nesting():
    report = check_grad_inside("mlp", layers=10, cut=0.45)
    recomputes = [r for r in report.rewrites if r.kind == "recompute"]
    assert recomputes and all("models.py:15 (mlp)" in r.details["lines"] for r in recomputes)
    assert all(r.details["dropped"] > 0 for r in recomputes)


def test_linearize_of_a_hlopass_function_is_left_to_jax():
    # before_linearize hooks (this pass's custom_vjp blocks) run for VJPs only: jax.linearize works
    loss, params, x = make("mlp", 6, 32, 256)
    f = hlopass.jit(loss, memory_limit=int(0.3 * split_backward_footprint(loss, params, x)))
    tangent = jax.tree_util.tree_map(jnp.ones_like, params)
    got = jax.linearize(f, params, x)[1](tangent, jnp.zeros_like(x))
    want = jax.linearize(loss, params, x)[1](tangent, jnp.zeros_like(x))
    np.testing.assert_allclose(got, want, rtol=1e-5)
