"""What the remat pass leaves alone (programs that fit: the same jaxpr object), and what it says
when no schedule reaches the limit (the smallest footprint found, as a warning or, under
``strict``, a ``MemoryLimitError``)."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlopass
from hlopass import settings
from hlopass.interpreter import inline_calls
from hlopass.passes.remat import RematPass
from hlopass.report import Note

from .models import make, plain


def config(limit, strict=False):
    return settings.resolve({"memory_limit": limit, "passes": "remat", "strict": strict})


def grad_program(name="mlp", layers=6):
    loss, params, x = make(name, layers, 32, 256)
    grad = jax.grad(loss)
    closed = inline_calls(jax.make_jaxpr(grad)(params, x))
    return loss, grad, params, x, closed


@pytest.mark.parametrize("name", ["mlp", "scan_mlp"])
def test_a_program_that_fits_is_the_same_object(name):
    loss, grad, params, x, closed = grad_program(name)
    fits = plain(grad, params, x).footprint
    for limit in (fits, 10 * fits, None):
        new, report = RematPass().run(closed, config("off" if limit is None else limit))
        assert new is closed and not report.rewrites and not report.skipped
    primal = jax.make_jaxpr(loss)(params, x)
    notes: list[Note] = []
    assert RematPass().before_linearize(primal, config(10 * fits), notes) is primal and not notes


def test_a_program_that_fits_gives_bit_identical_results():
    loss, grad, params, x, _ = grad_program("resnet")
    fits = plain(grad, params, x).footprint
    traced = hlopass.jit(grad, memory_limit=fits, passes="remat").trace(params, x)
    assert traced.rewritten_jaxpr is traced.original_jaxpr
    got = hlopass.jit(grad, memory_limit=fits, passes="remat")(params, x)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(jax.jit(grad)(params, x))):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_forward_programs_and_programs_without_residuals_are_left_alone():
    loss, grad, params, x, closed = grad_program()
    forward = inline_calls(jax.make_jaxpr(loss)(params, x))
    assert RematPass().run(forward, config(1))[0] is forward
    # a gradient whose backward pass reads nothing from the forward pass (a linear function)
    linear = inline_calls(jax.make_jaxpr(jax.grad(lambda w, x: jnp.sum(x @ w)))(params[0], x))
    new, report = RematPass().run(linear, config(1))
    assert new is linear and not report.rewrites


def test_unreachable_limit_warns_with_the_smallest_footprint(caplog):
    loss, grad, params, x, _ = grad_program("mlp", layers=8)
    before = plain(grad, params, x)
    limit = before.argument_bytes + before.output_bytes      # nothing left for temporaries
    f = hlopass.jit(grad, memory_limit=limit, passes="remat")
    with caplog.at_level(logging.WARNING, logger="hlopass"):
        got = f(params, x)
    (check,) = f.memory_checks()
    assert limit < check.footprint < before.footprint          # the smallest found, kept
    report = next(p for p in f.trace(params, x).report.passes if p.name == "remat")
    (skip,) = report.skipped
    assert f"the smallest footprint found is {hlopass.sizes.format_size(check.footprint)}" in skip.reason
    assert any(f"footprint {hlopass.sizes.format_size(check.footprint)}" in r.getMessage()
               and "over the memory limit" in r.getMessage() for r in caplog.records)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(jax.jit(grad)(params, x))):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * float(np.max(np.abs(b))))


def test_unreachable_limit_raises_under_strict():
    loss, grad, params, x, _ = grad_program("mlp", layers=8)
    before = plain(grad, params, x)
    limit = before.argument_bytes + before.output_bytes
    with pytest.raises(hlopass.MemoryLimitError) as err:
        hlopass.jit(grad, memory_limit=limit, strict=True, passes="remat")(params, x)
    found = err.value.check.footprint
    assert limit < found < before.footprint
    assert f"footprint {hlopass.sizes.format_size(found)}" in str(err.value)
