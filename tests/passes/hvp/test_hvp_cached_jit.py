"""Inner gradients that JAX traced and cached before hlopass's trace (a ``jax.jit(jax.grad(loss))``
called once outside) are still taken forward-over-reverse, and hlopass's trace leaves nothing in JAX's caches
that plain calls could pick up."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlopass
from fixtures import mixflow as mf

B, D, T, M = 128, 256, 2, 4
RTOL = 1e-4
HERE = os.path.basename(__file__)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def run_compiled(fn, *args):
    """(result, XLA temp bytes) from one compile."""
    compiled = fn.lower(*args).compile()
    return compiled(*args), compiled.memory_analysis().temp_size_in_bytes


def toy_with(inner_grad, loss):
    """The toy task of fixtures/mixflow.py with the inner gradient taken by ``inner_grad``."""
    def meta_loss(params, xs, targets, val_x, val_target):
        def inner_step(p, x_and_target):
            return p - mf.TOY_LR * inner_grad(p, *x_and_target), ()

        p, _ = jax.lax.scan(inner_step, params, (xs, targets))
        return loss(p, val_x, val_target)

    def task(*args):
        return jax.grad(meta_loss)(*args)

    return meta_loss, task


def first_step(args):
    params, xs, targets = args[:3]
    return params, xs[0], targets[0]


@functools.lru_cache(maxsize=None)
def toy_args():
    return mf.toy_inputs(B, D, T)


@functools.lru_cache(maxsize=None)
def uncached_figures():
    """(plain jax.jit gradient, plain temp, hlopass temp) with an inner jax.jit never called before."""
    args, loss = toy_args(), mf.toy_loss(M, "loop")
    _, task = toy_with(jax.jit(jax.grad(loss)), loss)
    expected, plain_temp = run_compiled(jax.jit(task), *args)
    _, task = toy_with(jax.jit(jax.grad(loss)), loss)
    got, temp = run_compiled(hlopass.jit(task, passes="hvp"), *args)
    assert rel_err(got, expected) < RTOL
    return np.asarray(expected), plain_temp, temp


def test_cached_inner_jit_taken_forward_over_reverse():
    args, loss = toy_args(), mf.toy_loss(M, "loop")
    expected, plain_temp, uncached_temp = uncached_figures()
    inner = jax.jit(jax.grad(loss))
    inner(*first_step(args))                      # traced and cached before hlopass sees it
    _, task = toy_with(inner, loss)
    fn = hlopass.jit(task, passes="hvp")
    got, temp = run_compiled(fn, *args)
    assert rel_err(got, expected) < RTOL
    assert temp == uncached_temp, (temp, uncached_temp)
    assert temp < plain_temp / 3, (temp, plain_temp)
    rewrites = [r for r in fn.trace(*args).report.rewrites if r.pass_name == "hvp"]
    assert [r.kind for r in rewrites] == ["fwdrev_hvp"]
    assert "mixflow.py:" in rewrites[0].summary and "(loss)" in rewrites[0].summary
    assert rewrites[0].location.startswith(f"{HERE}:") and rewrites[0].location.endswith("inner_step)")


def test_hlopass_trace_leaves_jax_caches_clean():
    """What hlopass traces under its interception (custom_vjp replacements) is not what plain calls get."""
    args, loss = toy_args(), mf.toy_loss(M, "loop")
    inner = jax.jit(jax.grad(loss))
    _, task = toy_with(inner, loss)
    fn = hlopass.jit(task, passes="hvp")
    fn.trace(*args)                                  # traces inner one gradient deep: replaced there
    assert [r.kind for r in fn.trace(*args).report.rewrites if r.pass_name == "hvp"] == ["fwdrev_hvp"]
    plain = str(jax.make_jaxpr(jax.jit(jax.grad(loss)))(*first_step(args)))
    assert "custom_vjp" not in plain
    assert str(jax.make_jaxpr(inner)(*first_step(args))) == plain
    # forward mode over the plain function still works (a custom_vjp inside would refuse it)
    tangents = tuple(jnp.ones_like(a) for a in first_step(args))
    jax.jvp(inner, first_step(args), tangents)
    # and a plain jax.jit of the whole task is the plain program
    assert "custom_vjp" not in str(jax.make_jaxpr(task)(*args))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_cached_inner_jit_small_both_forms(dtype):
    """Small sizes, both forms of use, float32 and float64, against plain jax.jit."""
    with jax.enable_x64(dtype == jnp.float64):
        args = mf.toy_inputs(5, 7, 2, dtype=dtype)
        loss = mf.toy_loss(2, "scan")
        inner = jax.jit(jax.grad(loss))
        inner(*first_step(args))
        meta_loss, task = toy_with(inner, loss)
        expected = jax.jit(task)(*args)
        tolerance = RTOL if dtype == jnp.float32 else 1e-10
        form1 = hlopass.jit(task, passes="hvp")
        got = form1(*args)
        assert got.dtype == dtype and rel_err(got, expected) < tolerance
        assert [r.kind for r in form1.trace(*args).report.rewrites if r.pass_name == "hvp"] == ["fwdrev_hvp"]
        form2 = jax.grad(hlopass.jit(meta_loss, passes="hvp"))
        got = jax.jit(form2)(*args)
        assert got.dtype == dtype and rel_err(got, expected) < tolerance
        kinds = [r.kind for rep in hlopass.reports(form2, *args) for r in rep.rewrites if r.pass_name == "hvp"]
        assert kinds == ["fwdrev_hvp"]


def _module_level_step(p, x_and_target):
    """A scan body defined once: JAX caches its trace by the function."""
    return p - 0.7 * jax.grad(mf.toy_loss(1, "loop"))(p, *x_and_target), ()


def _scan_meta_loss(params, xs, targets, val_x, val_target):
    p, _ = jax.lax.scan(_module_level_step, params, (xs, targets))
    return mf.toy_loss(1, "loop")(p, val_x, val_target)


def test_scan_body_traced_before_hlopass():
    args = mf.toy_inputs(5, 7, 2)
    task = jax.grad(_scan_meta_loss)
    expected = jax.jit(task)(*args)                  # the scan body is traced (and cached) here first
    fn = hlopass.jit(task, passes="hvp")
    assert rel_err(fn(*args), expected) < RTOL
    assert [r.kind for r in fn.trace(*args).report.rewrites if r.pass_name == "hvp"] == ["fwdrev_hvp"]


def test_each_trace_reports_its_own_replacements():
    """Two hlopass functions sharing one cached inner jit: both reports name the replacement."""
    args = mf.toy_inputs(5, 7, 2)
    loss = mf.toy_loss(1, "loop")
    inner = jax.jit(jax.grad(loss))
    _, task = toy_with(inner, loss)
    for _ in range(2):
        fn = hlopass.jit(task, passes="hvp")
        assert [r.kind for r in fn.trace(*args).report.rewrites if r.pass_name == "hvp"] == ["fwdrev_hvp"]


FIRST_ORDER_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
import hlopass                     # first, as a script does; no hlopass function called yet
traced = []

@jax.jit
def helper(w, x):
    traced.append(1)
    return jnp.tanh(x @ w)

def loss(w, x):
    return jnp.sum(helper(w, x) ** 2)

w, x = jnp.ones((5, 3)) / 7, jnp.arange(20.0).reshape(4, 5) / 20
want = jax.jit(jax.grad(loss))(w, x)      # JAX traces the helper (and caches it)
calls = []
got = hlopass.jit(jax.grad(lambda w, x: calls.append(1) or loss(w, x)))(w, x)
np.testing.assert_allclose(got, want, rtol=1e-6)
print("TRACES", len(traced), len(calls))
"""


def test_first_order_program_reuses_what_jax_traced_before():
    """No gradient nested in another: hlopass traces the function once, and the ``jax.jit`` helpers
    JAX had traced before hlopass's first call are not traced again (the hvp pass's first trace only
    observes, and its JAX user context was made at ``import hlopass``). In a fresh process, since
    which modules this one imported first is not the point."""
    done = subprocess.run([sys.executable, "-c", FIRST_ORDER_SCRIPT], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TRACES 1 1" in done.stdout, done.stdout
