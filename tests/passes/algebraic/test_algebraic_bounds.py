"""The algebraic pass's bounds (:mod:`passes.algebraic.bounds`): every root its expansion keeps or reports
is one the bounds let through, on random programs, their gradients and every covered form; and on a
Transformer block's gradient they leave out every root that expanding would not change."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hlopass import internals as jx
from hlopass.jaxpr_utils import subjaxprs
from hlopass.passes.algebraic import ROOT_PRIMITIVES, find_candidate, inline_calls_everywhere
from hlopass.passes.algebraic.bounds import RemovalBounds
from hlopass.passes.algebraic.expansion import Scope
from hlopass.passes.algebraic.match import may_save_exactly, reported_however, touches_large
from hlopass.report import PassReport
from tests.fuzz.pieces import PIECES
from tests.fuzz.programs import RandomDraw, draw_program, linear_loss
from tests.passes.algebraic.test_algebraic import LOOK_ALIKES, SQ_DISTANCE_SPELLINGS, D, M, N
from tests.passes.algebraic.test_algebraic_products import CONTRACTIONS

#: always, a small one, and one above every value (only exact rewrites fire, and no root is reported).
THRESHOLDS = (None, 1_000, 10**9)


def _levels(jaxpr: jx.Jaxpr):
    yield jaxpr
    for eqn in jaxpr.eqns:
        for sub in subjaxprs(eqn):
            yield from _levels(sub)


def _roots(closed: jx.ClosedJaxpr, threshold):
    """``(root, kept or reported by find_candidate, let through by the bounds)`` for every root the pass's
    cheaper filters pass, at every level."""
    flat = inline_calls_everywhere(closed)
    for jaxpr in _levels(flat.jaxpr):
        scope, bounds = Scope(jaxpr), RemovalBounds(jaxpr)
        for i, eqn in enumerate(jaxpr.eqns):
            if eqn.primitive.name not in ROOT_PRIMITIVES or not (
                    touches_large(eqn, threshold) or may_save_exactly(eqn, scope)):
                continue
            report = PassReport("algebraic")
            try:
                found = find_candidate(jaxpr, i, threshold, report, None, scope)
            except Exception:  # noqa: BLE001 - the pass reports these whatever the bounds say
                continue
            through = reported_however(eqn, threshold) or bounds.may_remove(eqn)
            yield eqn, found is not None or bool(report.skipped), through


def _assert_sound(closed, threshold):
    for eqn, kept, through in _roots(closed, threshold):
        assert through or not kept, f"the bounds leave out a root the expansion keeps or reports: {eqn}"


def _forms():
    """Every form the pass covers (and its look-alikes), with arguments."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(N, D)).astype(np.float32), rng.normal(size=(M, D)).astype(np.float32)
    a, b = rng.normal(size=(17, 17)).astype(np.float32), rng.normal(size=(17, 17)).astype(np.float32)
    for name, fun in {**SQ_DISTANCE_SPELLINGS, **{k: fun for k, (fun, _) in LOOK_ALIKES.items()}}.items():
        yield name, fun, (x, y)
    for name, (fun, shapes, _) in CONTRACTIONS.items():
        yield name, fun, tuple(rng.normal(size=s).astype(np.float32) for s in shapes)
    products = {
        "diag": lambda a, b: jnp.diag(a @ b), "diagonal": lambda a, b: jnp.diagonal(a @ b),
        "trace": lambda a, b: jnp.trace(a @ b),
        "eye_trace": lambda a, b: jnp.sum(jnp.eye(a.shape[0], dtype=a.dtype) * (a @ b)),
        "where_trace": lambda a, b: jnp.sum(jnp.where(jnp.eye(a.shape[0], dtype=bool), a @ b, 0)),
        "sum_rows": lambda a, b: jnp.sum(a @ b, axis=0), "sum_all": lambda a, b: jnp.sum(a.T @ b.T),
        "product_vector": lambda a, b: (a @ b) @ b[0], "vector_product": lambda a, b: a[:, 1] @ (a @ b.T),
        "pow_zero": lambda a, b: jnp.sum(jnp.power(a[:, None, :] - b[None], 0.0), -1),
        "square_outer": lambda a, b: jnp.sum(jnp.square(a[:, :, None] * b[:, None, :]), 1),
    }
    for name, fun in products.items():
        yield name, fun, (a, b)


@pytest.mark.parametrize("threshold", THRESHOLDS)
@pytest.mark.parametrize("name,fun,args", list(_forms()), ids=[name for name, *_ in _forms()])
def test_bounds_let_every_covered_form_through(name, fun, args, threshold):
    _assert_sound(jax.make_jaxpr(fun)(*args), threshold)
    _assert_sound(jax.make_jaxpr(jax.grad(lambda *a: linear_loss(fun(*a)), argnums=(0, 1)))(*args), threshold)


@pytest.mark.parametrize("seed", range(60))
def test_bounds_let_through_what_random_programs_keep(seed):
    program = draw_program(RandomDraw(f"bounds/{seed}"), 32_000, x64=True, frontier=True)
    inputs = program.make_inputs()
    float_args = [k for k, spec in enumerate(program.inputs) if jnp.issubdtype(jnp.dtype(spec.dtype), jnp.floating)]
    closed = jax.make_jaxpr(program.fn)(*inputs)
    differentiable = all(PIECES[p.split(":")[0]][p.split(":")[1]].differentiable for p in program.pieces)
    grads = []
    if float_args and differentiable:  # not through a while_loop (jax.grad refuses it)
        grads.append(jax.make_jaxpr(jax.grad(lambda *a: linear_loss(program.fn(*a)), argnums=tuple(float_args)))(
            *inputs))
    for threshold in THRESHOLDS + (32_000,):
        for each in (closed, *grads):
            _assert_sound(each, threshold)


def test_bounds_leave_out_a_transformer_blocks_roots():
    """A pre-norm attention and MLP block's gradient: the roots that pass the cheaper filters and are not
    reported anyway gain nothing from expanding, and the bounds leave every one out."""
    def block(x, wq, wk, wv, w1, w2):
        h = (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)
        a = jax.nn.softmax((h @ wq) @ (h @ wk).T / 8.0, axis=-1)
        x = x + a @ (h @ wv)
        return jnp.sum(x + jax.nn.gelu(x @ w1) @ w2)

    rng = np.random.default_rng(1)
    shapes = [(256, 64), (64, 64), (64, 64), (64, 64), (64, 128), (128, 64)]
    args = [rng.normal(size=s).astype(np.float32) for s in shapes]
    closed = jax.make_jaxpr(jax.grad(block, argnums=tuple(range(6))))(*args)
    roots = [(kept, through) for eqn, kept, through in _roots(closed, 100_000)
             if not reported_however(eqn, 100_000)]   # sums of a large tensor: expanded for the report
    assert len(roots) >= 10
    assert not any(kept for kept, _ in roots)
    assert not any(through for _, through in roots)
