"""The HVP rewrite on the Mix Flow-MG toy task (appendix A.6), a MAML-style task and the explicit HVP idiom.

Acceptance: B = 128, D = 256, T = 2, M in {4, 8}, Python-loop and lax.scan
variants, both forms of use; XLA temp memory at most 1.25x the hand-written
forward-over-reverse version under jax.jit, gradients equal to the default
program's within 1e-4 relative, and the second-order term far above that.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlopass
from fixtures import mixflow as mf

B, D, T = 128, 256, 2
RTOL = 1e-4
MEMORY_FACTOR = 1.25


def temp_bytes(fn, *args) -> int:
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes


def run_compiled(fn, *args):
    """(result, XLA temp bytes) from one compile."""
    compiled = fn.lower(*args).compile()
    return compiled(*args), compiled.memory_analysis().temp_size_in_bytes


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def tree_rel_err(a, b) -> float:
    return max(rel_err(x, y) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


@functools.lru_cache(maxsize=None)
def toy_args():
    return mf.toy_inputs(B, D, T)


@functools.lru_cache(maxsize=None)
def toy_reference(variant: str, M: int):
    """(default gradient, default temp, hand-written temp) under jax.jit."""
    args = toy_args()
    expected, default_temp = run_compiled(jax.jit(mf.toy_task(M, variant)), *args)
    return np.asarray(expected), default_temp, temp_bytes(jax.jit(mf.toy_task(M, variant, "fwdrev")), *args)


def assert_matches_handwritten(fn, args, variant, M):
    """Gradients equal to the default program's; XLA temp within MEMORY_FACTOR of hand-written."""
    expected, default_temp, handwritten_temp = toy_reference(variant, M)
    got, temp = run_compiled(fn, *args)
    assert rel_err(got, expected) < RTOL
    assert temp <= MEMORY_FACTOR * handwritten_temp, (temp, handwritten_temp)
    assert temp < default_temp / 3, (temp, default_temp)


def hvp_rewrites(report):
    return [r for r in report.rewrites if r.pass_name == "hvp"]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["loop", "scan"])
@pytest.mark.parametrize("M", [4, 8])
def test_toy_under_hlopass_jit_matches_handwritten_memory(variant, M):
    """Form 1: @hlopass.jit on the program that calls jax.grad(meta_loss) itself."""
    args = toy_args()
    fn = hlopass.jit(mf.toy_task(M, variant), passes="hvp")
    assert_matches_handwritten(fn, args, variant, M)
    rewrites = hvp_rewrites(fn.trace(*args).report)
    assert len(rewrites) == 1
    assert rewrites[0].kind == "fwdrev_hvp"
    assert re.search(r"gradient of mixflow\.py:\d+ \(loss\)", rewrites[0].summary), rewrites[0].summary
    assert "inner_step" in rewrites[0].location


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["loop", "scan"])
@pytest.mark.parametrize("M", [4, 8])
def test_toy_grad_of_hlopass_jit_matches_handwritten_memory(variant, M):
    """Form 2: jax.grad(hlopass.jit(meta_loss)); the linearize hook rewrites the primal jaxpr."""
    args = toy_args()
    meta_loss = hlopass.jit(mf.toy_meta_loss(M, variant), passes="hvp")
    assert_matches_handwritten(jax.jit(jax.grad(meta_loss)), args, variant, M)
    # the primal hlopass_call carries the replaced region's note; its report names the inner loss
    rewrites = [r for rep in hlopass.reports(jax.grad(meta_loss), *args) for r in hvp_rewrites(rep)]
    assert len(rewrites) == 1
    assert rewrites[0].location.startswith("mixflow.py:") and rewrites[0].location.endswith(".loss)")


@pytest.mark.parametrize("M", [4, 8])
def test_second_order_term_matters(M):
    """Dropping the second-order term (stop_gradient on the inner gradient) moves the gradient by >> RTOL."""
    args = toy_args()
    expected, _, _ = toy_reference("loop", M)
    first_order = jax.jit(mf.toy_task(M, "loop", "first_order"))(*args)
    assert rel_err(first_order, expected) > 1000 * RTOL


@pytest.mark.parametrize("variant", ["loop", "scan"])
def test_maml_mixed_derivatives_both_forms(variant):
    """Meta-parameters in the inner loss: their cotangent is the mixed product d2L/deta dtheta . ct."""
    args = mf.maml_inputs(32, 24, 2)
    expected = jax.jit(mf.maml_task(3, variant))(*args)
    handwritten = jax.jit(mf.maml_task(3, variant, "fwdrev"))
    first_order = jax.jit(mf.maml_task(3, variant, "first_order"))(*args)
    assert rel_err(first_order["log_w"], expected["log_w"]) > 1000 * RTOL

    form1 = hlopass.jit(mf.maml_task(3, variant), passes="hvp")
    form2 = jax.jit(jax.grad(hlopass.jit(mf.maml_meta_loss(3, variant), passes="hvp")))
    handwritten_temp = temp_bytes(handwritten, *args)
    for fn in (form1, form2):
        got, temp = run_compiled(fn, *args)
        assert tree_rel_err(got, expected) < RTOL
        assert temp <= MEMORY_FACTOR * handwritten_temp
    assert len(hvp_rewrites(form1.trace(*args).report)) == 1


def test_maml_region_uses_the_inner_loss_for_mixed_products():
    """Form 2 identifies the inner loss value in the forward run (no local reverse-over-reverse fallback)."""
    from hlopass.passes.hvp import regions as hvp_regions
    from hlopass.interpreter import inline_calls
    args = mf.maml_inputs(8, 6, 2)
    primal = jax.make_jaxpr(mf.maml_meta_loss(2, "loop"))(*args)
    body = next(e for e in primal.jaxpr.eqns if e.primitive.name == "scan").params["jaxpr"]
    flat = inline_calls(body)
    regions = hvp_regions.find_regions(flat.jaxpr)
    assert len(regions) == 1
    plan = hvp_regions.plan_region(flat.jaxpr, regions[0])
    assert not isinstance(plan, str), plan
    assert plan.loss is not None and plan.loss.aval.shape == ()
    assert [plan.inputs[p].aval.shape for p in plan.params] == [(6, 6)]


def _explicit_inputs(n=37):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, n)) / np.sqrt(n)
    x, v = rng.standard_normal((2, n))
    return tuple(jnp.asarray(a, jnp.float32) for a in (x, v, w))


def test_explicit_hvp_idiom_form1():
    x, v, w = _explicit_inputs()
    expected = jax.jit(mf.explicit_hvp)(x, v, w)
    exact = jax.jit(lambda x, v, w: jax.hessian(mf.explicit_hvp_loss)(x, w) @ v)(x, v, w)
    fn = hlopass.jit(mf.explicit_hvp, passes="hvp")
    assert rel_err(fn(x, v, w), expected) < RTOL
    assert rel_err(fn(x, v, w), exact) < RTOL
    rewrites = hvp_rewrites(fn.trace(x, v, w).report)
    assert len(rewrites) == 1 and "(explicit_hvp_loss)" in rewrites[0].summary


def test_explicit_hvp_idiom_form2():
    x, v, w = _explicit_inputs()
    expected = jax.jit(mf.explicit_hvp)(x, v, w)

    def directional(x, v, w):
        return jnp.vdot(jax.grad(mf.explicit_hvp_loss)(x, w), v)

    fn = jax.jit(jax.grad(hlopass.jit(directional, passes="hvp")))
    assert rel_err(fn(x, v, w), expected) < RTOL
    # the rewritten primal has a custom_vjp in place of the inner gradient
    from hlopass.passes.hvp.regions import linearize_hook
    closed = jax.make_jaxpr(directional)(x, v, w)
    rewritten = linearize_hook(closed, None)
    assert rewritten is not closed
    assert any("custom_vjp" in e.primitive.name for e in rewritten.jaxpr.eqns)
