"""What the HVP rewrite leaves alone, and what stays true after it (small sizes, both forms of use)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import hlopass
from fixtures import mixflow as mf
from hlopass.passes.hvp import regions as hvp_regions
from hlopass.passes.hvp.regions import linearize_hook

RTOL = 1e-4


def rel_err(a, b) -> float:
    leaves = zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
    return max(float(np.linalg.norm(np.asarray(x, np.float64) - np.asarray(y, np.float64)) /
                     np.linalg.norm(np.asarray(y, np.float64))) for x, y in leaves)


def hvp_rewrites(fn, *args):
    return [r for r in fn.trace(*args).report.rewrites if r.pass_name == "hvp"]


def small_toy(B=7, D=13, T=2, dtype=jnp.float32):
    """Odd sizes (primes), so nothing divides evenly."""
    return mf.toy_inputs(B, D, T, dtype=dtype)


def mse(p, x, t):
    return jnp.mean((jnp.tanh(x @ p) - t) ** 2)


# -- left alone -----------------------------------------------------------------------------------

def test_first_order_gradient_jaxpr_unchanged():
    args = small_toy()[:3]
    with_pass = hlopass.jit(jax.grad(mse), passes="hvp").trace(*args)
    without = hlopass.jit(jax.grad(mse), passes="none").trace(*args)
    assert str(with_pass.original_jaxpr) == str(without.original_jaxpr)
    assert str(with_pass.rewritten_jaxpr) == str(without.original_jaxpr)
    assert not [r for r in with_pass.report.rewrites if r.pass_name == "hvp"]


def test_program_without_gradients_unchanged():
    args = small_toy()[:3]
    traced = hlopass.jit(mse, passes="hvp").trace(*args)
    assert str(traced.rewritten_jaxpr) == str(hlopass.jit(mse, passes="none").trace(*args).original_jaxpr)
    closed = jax.make_jaxpr(mse)(*args)
    assert linearize_hook(closed, None) is closed


def test_first_order_grad_of_hlopass_jit_hook_is_identity():
    args = small_toy()[:3]
    closed = jax.make_jaxpr(mse)(*args)
    assert linearize_hook(closed, None) is closed
    got = jax.jit(jax.grad(hlopass.jit(mse, passes="hvp")))(*args)
    assert rel_err(got, jax.jit(jax.grad(mse))(*args)) < RTOL


def test_forward_mode_inside_user_code_left_alone():
    """jax.jvp of an inner gradient under an outer grad: a custom_vjp there could not be jvp'd."""
    v = jnp.linspace(-1.0, 1.0, 5)
    f = lambda x: jnp.sum(jnp.tanh(x) ** 3)  # noqa: E731
    prog = lambda x: jax.grad(lambda y: jnp.sum(jax.jvp(jax.grad(f), (y,), (v,))[1] ** 2))(x)  # noqa: E731
    x = jnp.linspace(-0.5, 0.7, 5)
    fn = hlopass.jit(prog, passes="hvp")
    assert rel_err(fn(x), jax.jit(prog)(x)) < RTOL
    assert not hvp_rewrites(fn, x)
    hessian_prog = lambda x: jax.grad(lambda y: jnp.sum(jax.hessian(f)(y) ** 2))(x)  # noqa: E731
    fn = hlopass.jit(hessian_prog, passes="hvp")
    assert rel_err(fn(x), jax.jit(hessian_prog)(x)) < RTOL


def test_ambiguous_parameter_left_alone_and_correct():
    """Two inputs of the gradient's type that the loss reads: the region is skipped, not guessed."""
    def meta_loss(p, q, x):
        g = jax.grad(lambda p: jnp.sum(jnp.sin(p * q) * x))(p)
        return jnp.sum((p - 0.5 * g) ** 2 * q)

    p, q, x = (jnp.asarray(np.random.default_rng(k).standard_normal(5), jnp.float32) for k in range(3))
    got = jax.jit(jax.grad(hlopass.jit(meta_loss, passes="hvp"), argnums=(0, 1)))(p, q, x)
    assert rel_err(got, jax.jit(jax.grad(meta_loss, argnums=(0, 1)))(p, q, x)) < RTOL
    # the skipped region reaches the report of the program JAX differentiated, at the inner loss's line
    skips = [s for rep in hlopass.reports(jax.grad(hlopass.jit(meta_loss, passes="hvp")), p, q, x)
             for s in rep.skipped if s.pass_name == "hvp"]
    assert len(skips) == 1 and "cannot tell which input" in skips[0].reason
    assert skips[0].location.startswith("test_hvp_semantics.py:") and skips[0].location.endswith("<lambda>)")


def test_same_typed_meta_parameters_told_apart():
    """iMAML-style: eta has theta's shape and enters the inner loss; the derivation tells them apart."""
    args = small_toy(T=3)
    expected = jax.jit(jax.grad(mf.imaml_meta_loss()))(*args)
    handwritten = jax.jit(jax.grad(mf.imaml_meta_loss(mode="fwdrev")))
    closed = jax.make_jaxpr(mf.imaml_meta_loss())(*args)
    assert linearize_hook(closed, None) is not closed
    for fn in (hlopass.jit(jax.grad(mf.imaml_meta_loss()), passes="hvp"),
               jax.jit(jax.grad(hlopass.jit(mf.imaml_meta_loss(), passes="hvp")))):
        compiled = fn.lower(*args).compile()
        assert rel_err(compiled(*args), expected) < RTOL
        assert compiled.memory_analysis().temp_size_in_bytes <= 1.25 * (
            handwritten.lower(*args).compile().memory_analysis().temp_size_in_bytes)


@jax.custom_jvp
def damped(x):
    """Identity whose derivative is declared as 0.5 (a custom rule the primal ops do not show)."""
    return x


damped.defjvp(lambda primals, tangents: (primals[0], 0.5 * tangents[0]))


def test_custom_jvp_in_inner_loss_is_respected():
    """The loss rebuilt from primal ops would miss the custom rule: it must not be trusted for mixed products."""
    def meta_loss(meta, x, t):
        theta, eta = meta

        def inner(theta):
            return jnp.mean((jnp.tanh(x @ theta) - t) ** 2) + jnp.sum(damped(theta * eta) ** 2)

        theta = theta - 0.5 * jax.grad(inner)(theta)
        return jnp.mean((jnp.tanh(x @ theta) - t) ** 2)

    rng = np.random.default_rng(3)
    meta = (jnp.asarray(rng.standard_normal((5, 3)) / 3, jnp.float32), jnp.asarray(rng.standard_normal(3), jnp.float32))
    x, t = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in ((4, 5), (4, 3)))
    expected = jax.jit(jax.grad(meta_loss))(meta, x, t)
    assert rel_err(jax.jit(jax.grad(hlopass.jit(meta_loss, passes="hvp")))(meta, x, t), expected) < RTOL
    assert rel_err(hlopass.jit(jax.grad(meta_loss), passes="hvp")(meta, x, t), expected) < RTOL
    from hlopass.interpreter import inline_calls
    flat = inline_calls(jax.make_jaxpr(meta_loss)(meta, x, t))
    plans = [hvp_regions.plan_region(flat.jaxpr, r) for r in hvp_regions.find_regions(flat.jaxpr)]
    assert plans and all(not isinstance(p, str) and p.loss is None for p in plans)


# -- still true after the rewrite ------------------------------------------------------------------

@pytest.mark.slow
def test_result_differentiable_further_form1():
    args = small_toy(5, 7)
    task = mf.toy_task(1, "loop", lr=1.0)

    def scalar_of(f):
        return lambda p, *rest: jnp.sum(jnp.sin(f(p, *rest)))

    third = jax.jit(jax.grad(scalar_of(hlopass.jit(task, passes="hvp"))))(*args)
    assert rel_err(third, jax.jit(jax.grad(scalar_of(task)))(*args)) < RTOL
    tangents = (jnp.ones_like(args[0]),) + tuple(jnp.zeros_like(a) for a in args[1:])
    jvp_of = lambda f: jax.jit(lambda a, t: jax.jvp(f, a, t)[1])  # noqa: E731
    forward = jvp_of(hlopass.jit(task, passes="hvp"))(args, tangents)
    assert rel_err(forward, jvp_of(task)(args, tangents)) < RTOL


@pytest.mark.slow
def test_result_differentiable_further_form2():
    args = small_toy(5, 7)
    meta_loss = mf.toy_meta_loss(1, "scan", lr=1.0)

    def grad_of_grad(f):
        return jax.grad(lambda p, *rest: jnp.sum(jnp.sin(jax.grad(f)(p, *rest))))

    got = jax.jit(grad_of_grad(hlopass.jit(meta_loss, passes="hvp")))(*args)
    assert rel_err(got, jax.jit(grad_of_grad(meta_loss))(*args)) < RTOL
    tangents = (jnp.ones_like(args[0]),) + tuple(jnp.zeros_like(a) for a in args[1:])
    jvp_of = lambda f: jax.jit(lambda a, t: jax.jvp(f, a, t)[1])  # noqa: E731
    forward = jvp_of(jax.grad(hlopass.jit(meta_loss, passes="hvp")))(args, tangents)
    assert rel_err(forward, jvp_of(jax.grad(meta_loss))(args, tangents)) < RTOL


def _aux_meta_loss(p, xs, ts, vx, vt):
    """value_and_grad with has_aux; both the value and the aux feed the outer loss."""
    def step(p, xt):
        (val, aux), g = jax.value_and_grad(lambda p, x, t: (mse(p, x, t), jnp.sum(p ** 2)), has_aux=True)(p, *xt)
        return p - 0.7 * g * (1 + val) + 0.01 * aux, val
    p, vals = jax.lax.scan(step, p, (xs, ts))
    return mse(p, vx, vt) + jnp.sum(vals)


def _checkpoint_meta_loss(p, xs, ts, vx, vt):
    """The inner step under jax.checkpoint (the paper's per-step rematerialisation)."""
    @jax.checkpoint
    def step(p, xt):
        return p - 0.7 * jax.grad(mse)(p, *xt), ()
    p, _ = jax.lax.scan(step, p, (xs, ts))
    return mse(p, vx, vt)


def _python_loop_meta_loss(p, xs, ts, vx, vt):
    """Inner steps unrolled in Python (one region per step)."""
    for i in range(xs.shape[0]):
        p = p - 0.7 * jax.grad(mse)(p, xs[i], ts[i])
    return mse(p, vx, vt)


@pytest.mark.parametrize("meta_loss", [_aux_meta_loss, _checkpoint_meta_loss, _python_loop_meta_loss],
                         ids=["value_and_grad_aux", "checkpoint", "python_loop"])
def test_inner_gradient_constructs_both_forms(meta_loss):
    args = small_toy(T=3)
    expected = jax.jit(jax.grad(meta_loss))(*args)
    form1 = hlopass.jit(jax.grad(meta_loss), passes="hvp")
    assert rel_err(form1(*args), expected) < RTOL
    assert hvp_rewrites(form1, *args)
    form2 = jax.jit(jax.grad(hlopass.jit(meta_loss, passes="hvp")))
    assert rel_err(form2(*args), expected) < RTOL
    closed = jax.make_jaxpr(meta_loss)(*args)
    assert linearize_hook(closed, None) is not closed


@pytest.mark.slow
def test_float64_and_batched():
    with jax.enable_x64(True):
        args = small_toy(5, 7, dtype=jnp.float64)
        task = mf.toy_task(2, "scan", lr=1.0)
        expected = jax.jit(task)(*args)
        got = hlopass.jit(task, passes="hvp")(*args)
        assert got.dtype == jnp.float64
        assert rel_err(got, expected) < 1e-10
        got = jax.jit(jax.grad(hlopass.jit(mf.toy_meta_loss(2, "scan", lr=1.0), passes="hvp")))(*args)
        assert got.dtype == jnp.float64
        assert rel_err(got, expected) < 1e-10
    # a batch of tasks: vmap over the meta-gradient
    batch = [small_toy()[0] * s for s in (1.0, 0.5, 2.0)]
    params = jnp.stack(batch)
    rest = small_toy()[1:]
    task = mf.toy_task(2, "loop", lr=1.0)
    got = jax.vmap(hlopass.jit(task, passes="hvp"), in_axes=(0, None, None, None, None))(params, *rest)
    expected = jax.jit(jax.vmap(task, in_axes=(0, None, None, None, None)))(params, *rest)
    assert rel_err(got, expected) < RTOL
    form2 = jax.grad(hlopass.jit(mf.toy_meta_loss(2, "loop", lr=1.0), passes="hvp"))
    got = jax.jit(jax.vmap(form2, in_axes=(0, None, None, None, None)))(params, *rest)
    assert rel_err(got, expected) < RTOL


def test_user_vjp_idiom_form1():
    """jax.vjp with a cotangent that depends on the outer variable: the cotangent gets its own cotangent."""
    def f(x):
        return jnp.sin(x) * jnp.sum(x ** 2)

    def outer(x):
        _, pullback = jax.vjp(f, x)
        return jnp.sum(pullback(jnp.cos(x))[0] ** 2)

    x = jnp.linspace(-1.0, 1.3, 11)
    fn = hlopass.jit(jax.grad(outer), passes="hvp")
    assert rel_err(fn(x), jax.jit(jax.grad(outer))(x)) < RTOL
    assert hvp_rewrites(fn, x)


@pytest.mark.slow
@settings(max_examples=2, deadline=None)
@given(M=st.integers(1, 2), lr=st.floats(0.1, 2.0), variant=st.sampled_from(["loop", "scan"]),
       seed=st.integers(0, 1000))
def test_property_toy_matches_default(M, lr, variant, seed):
    args = mf.toy_inputs(5, 7, 2, seed=seed)
    task = mf.toy_task(M, variant, lr=lr)
    expected = jax.jit(task)(*args)
    assert rel_err(hlopass.jit(task, passes="hvp")(*args), expected) < 1e-3
    assert rel_err(jax.jit(jax.grad(hlopass.jit(mf.toy_meta_loss(M, variant, lr=lr), passes="hvp")))(*args),
                   expected) < 1e-3
