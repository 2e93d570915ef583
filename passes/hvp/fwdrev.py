"""Gradients whose own VJP is forward-over-reverse (Mix Flow-MG, Kemaev et al. 2025, listing A.4).

``fwdrev_value_and_grad(loss, argnums)`` computes what ``jax.value_and_grad``
computes, but wrapped in a ``jax.custom_vjp`` whose backward rule, given the
cotangent ``ct`` of the gradient, returns ``H ct`` for every differentiable
input of ``loss`` (the parameters *and* everything else the loss reads, the
mixed second derivatives included) as ``jax.jvp`` of the gradient of ``loss``
with respect to all of them, in direction ``ct`` on the parameters. By the
symmetry of the Hessian this equals what reverse-over-reverse autodiff
computes, without keeping the inner backward pass's activations: the rule
saves only the loss's inputs.

Values the loss closes over that are tracers of an outer transformation are
hoisted into explicit inputs (:func:`closure_convert_traced`), so that they
receive their cotangents too and none is read by the backward rule after its
trace has ended.

Both ways into the pass (:mod:`.trace`, :mod:`.regions`) trace their
replacements under the named scope :data:`SCOPE` and report them with
:func:`add_note`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from hlopass import internals as jx
from hlopass.jaxpr_utils import iter_eqns, subjaxprs
from hlopass.report import Note

#: The named scope every replacement is traced under (visible in the jaxpr's name stacks and
#: in the HLO's op names).
SCOPE = "hlopass_hvp"


def add_note(notes: list[Note], note: Note) -> None:
    """Append ``note`` unless an equal one is there: one note per place, kind and reason
    (a gradient traced twice, or called at one line in a Python loop, is one finding)."""
    if note not in notes:
        notes.append(note)


_machinery = threading.local()


def in_machinery() -> bool:
    """Whether the derivatives being taken now are this module's own (not the user's)."""
    return getattr(_machinery, "depth", 0) > 0


@contextlib.contextmanager
def own_derivatives():
    """Mark the derivatives taken inside as this pass's machinery: the interception leaves them alone."""
    _machinery.depth = getattr(_machinery, "depth", 0) + 1
    try:
        yield
    finally:
        _machinery.depth -= 1


def forward_differentiable(eqns) -> bool:
    """Whether ``jax.jvp`` can differentiate these equations (no ``custom_vjp`` call, at any depth)."""
    for eqn in eqns:
        for sub in (eqn, *(e for body in subjaxprs(eqn) for e in iter_eqns(body))):
            if "custom_vjp" in sub.primitive.name or "custom_lin" in sub.primitive.name:
                return False
    return True


def _is_differentiable(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _normalize_argnums(argnums, nargs: int) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    return tuple(n % nargs for n in nums)


def fwdrev_value_and_grad(loss: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable:
    """Like ``jax.value_and_grad(loss, argnums, has_aux)``; its VJP is forward-over-reverse.

    Returns ``((value, aux), grads)`` when ``has_aux``, else ``(value, grads)``,
    exactly as ``jax.value_and_grad`` does.
    """

    @functools.wraps(loss)
    def value_and_grad(*args, **kwargs):
        nums = _normalize_argnums(argnums, len(args))
        leaves, in_tree = jax.tree_util.tree_flatten(args)
        positions = _leaf_positions(args, nums)

        def flat_loss(*flat):
            out = loss(*jax.tree_util.tree_unflatten(in_tree, flat), **kwargs)
            return out if has_aux else (out, None)

        converted, hoisted = closure_convert_traced(flat_loss, *leaves)
        value, aux, grads = _fwdrev_call(converted, len(leaves), positions, has_aux)(*leaves, *hoisted)
        grads_tree = _grads_like(args, nums, grads)
        return ((value, aux), grads_tree) if has_aux else (value, grads_tree)

    return value_and_grad


def fwdrev_grad(loss: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable:
    """Like ``jax.grad``; its VJP is forward-over-reverse (see :func:`fwdrev_value_and_grad`)."""
    value_and_grad = fwdrev_value_and_grad(loss, argnums, has_aux)

    @functools.wraps(loss)
    def grad(*args, **kwargs):
        (value_aux, grads) = value_and_grad(*args, **kwargs)
        return (grads, value_aux[1]) if has_aux else grads

    return grad


def closure_convert_traced(fun: Callable, *flat_args) -> tuple[Callable, list[Any]]:
    """``jax.closure_convert`` of ``fun`` (flat arguments), hoisting every traced value it closes
    over, whatever its type. ``jax.closure_convert`` hoists only values that may carry a tangent, so
    an integer index batched by an outer ``vmap`` stayed inside and escaped its trace when the
    backward rule ran (fresh seed s213490826529, ``shard_map`` of ``vmap`` of a gradient)."""
    closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*flat_args)
    traced = [isinstance(c, jx.Tracer) for c in closed.consts]
    kept = [c for c, t in zip(closed.consts, traced) if not t]
    hoisted = [c for c, t in zip(closed.consts, traced) if t]
    out_tree = jax.tree_util.tree_structure(out_shape)

    def converted(*args_and_hoisted):
        split = len(args_and_hoisted) - len(hoisted)
        kept_it, hoisted_it = iter(kept), iter(args_and_hoisted[split:])
        consts = [next(hoisted_it) if t else next(kept_it) for t in traced]
        outs = jx.jaxpr_as_fun(jx.ClosedJaxpr(closed.jaxpr, consts))(*args_and_hoisted[:split])
        return jax.tree_util.tree_unflatten(out_tree, list(outs))
    return converted, hoisted


def _leaf_positions(args: tuple, nums: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Flat leaf indices of each differentiated argument."""
    start, spans = 0, []
    for i, arg in enumerate(args):
        n = len(jax.tree_util.tree_leaves(arg))
        spans.append(tuple(range(start, start + n)))
        start += n
    return tuple(spans[i] for i in nums)


def _grads_like(args, nums, grads_flat):
    flat = iter(grads_flat)
    trees = []
    for i in nums:
        treedef = jax.tree_util.tree_structure(args[i])
        trees.append(jax.tree_util.tree_unflatten(treedef, [next(flat) for _ in range(treedef.num_leaves)]))
    return trees[0] if len(trees) == 1 else tuple(trees)


def _fwdrev_call(converted: Callable, num_args: int, positions, has_aux: bool):
    """A custom_vjp function ``(*leaves, *hoisted) -> (value, aux, grads)``."""
    param_positions = [p for span in positions for p in span]

    def call_loss(flat):
        return converted(*flat[:num_args], *flat[num_args:])

    def value_aux_grads(*flat):
        with own_derivatives():
            return _value_aux_grads(*flat)

    def _value_aux_grads(*flat):
        def of_params(*params):
            full = list(flat)
            for p, v in zip(param_positions, params):
                full[p] = v
            return call_loss(full)
        (value, aux), grads = jax.value_and_grad(of_params, argnums=tuple(range(len(param_positions))),
                                                 has_aux=True)(*(flat[p] for p in param_positions))
        return value, aux, list(grads)

    @jax.custom_vjp
    def primal(*flat):
        return value_aux_grads(*flat)

    def fwd(*flat):
        values = [x.value for x in flat]
        perturbed = [x.perturbed for x in flat]
        return value_aux_grads(*values), (values, perturbed)

    def bwd(residuals, cts):
        values, perturbed = residuals
        ct_value, ct_aux, ct_grads = cts
        wanted = [i for i, (v, p) in enumerate(zip(values, perturbed)) if p and _is_differentiable(v)]
        total: list[Any] = [None] * len(values)
        if not wanted:
            return tuple(total)
        with own_derivatives():
            _accumulate(total, wanted, _hvp(call_loss, values, wanted, param_positions, ct_grads))
            _accumulate(total, wanted, _first_order(call_loss, values, wanted, ct_value, ct_aux, has_aux))
        return tuple(total)

    primal.defvjp(fwd, bwd, symbolic_zeros=True)
    return primal


def _accumulate(total: list, wanted: list[int], cotangents) -> None:
    if cotangents is None:
        return
    for i, ct in zip(wanted, cotangents):
        total[i] = ct if total[i] is None else total[i] + ct


def _hvp(call_loss, values, wanted, param_positions, ct_grads):
    """``H ct``: jvp of the gradient w.r.t. every wanted input, direction ``ct_grads`` on the parameters."""
    directions = [(p, ct) for p, ct in zip(param_positions, ct_grads) if not isinstance(ct, SymbolicZero)]
    if not directions:
        return None

    def grad_all(*moved):
        full = list(values)
        for (p, _), v in zip(directions, moved):
            full[p] = v

        def scalar(*selected):
            inner = list(full)
            for i, v in zip(wanted, selected):
                inner[i] = v
            return call_loss(inner)[0]
        return jax.grad(scalar, argnums=tuple(range(len(wanted))))(*(full[i] for i in wanted))

    primals = tuple(values[p] for p, _ in directions)
    tangents = tuple(jnp.asarray(ct, dtype=values[p].dtype) for p, ct in directions)
    _, hvp = jax.jvp(grad_all, primals, tangents)
    return hvp


def _first_order(call_loss, values, wanted, ct_value, ct_aux, has_aux):
    """The ordinary VJP of the loss value (and aux) when their cotangents are not zero."""
    aux_zero = not has_aux or all(isinstance(c, SymbolicZero) or c is None
                                  for c in jax.tree_util.tree_leaves(ct_aux, is_leaf=lambda x: x is None))
    if isinstance(ct_value, SymbolicZero) and aux_zero:
        return None

    def of_wanted(*selected):
        full = list(values)
        for i, v in zip(wanted, selected):
            full[i] = v
        return call_loss(full)

    (value, aux), vjp = jax.vjp(of_wanted, *(values[i] for i in wanted))
    ct_value = jnp.zeros_like(value) if isinstance(ct_value, SymbolicZero) else ct_value
    ct_aux = jax.tree_util.tree_map(
        lambda c, a: jnp.zeros_like(a) if isinstance(c, SymbolicZero) else c, ct_aux, aux,
        is_leaf=lambda x: isinstance(x, SymbolicZero)) if has_aux else None
    return vjp((ct_value, ct_aux))


__all__ = ["SCOPE", "add_note", "forward_differentiable", "fwdrev_grad", "fwdrev_value_and_grad", "in_machinery",
           "own_derivatives"]
