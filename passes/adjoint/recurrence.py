"""Which scans are linear recurrences: the carry's tangent map probed on the scan body's jaxpr.

A scan body maps ``(consts, carry, xs_t)`` to ``(carry', ys_t)``. Its carry
update is a linear recurrence ``h' = M_t h + b_t`` exactly when the tangent
map ``dh -> d(carry')`` does not depend on the carry itself:
:func:`classify` traces that map (a ``jax.jvp`` of the body in the carry),
removes dead code and checks which inputs it still reads. The readout
``ys_t`` may depend on the carry in any way (its VJP is taken as written).

The form follows from the same tangent jaxpr: *diagonal* when every carry's
tangent is an elementwise product of its own tangent by carry-independent
factors (``h' = a * h + b``, ``a`` real or complex), *dense* otherwise
(``h' = A @ h + b``, ``A`` shared or per step).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
from hlopass import internals as jx

from hlopass.interpreter import inline_calls
from hlopass.families import CALLS, INLINABLE
from hlopass.jaxpr_utils import aval_nbytes, call_body

#: Primitives through which a carry's tangent stays an elementwise multiple of itself.
_DIAGONAL_OPS = frozenset({"mul", "neg", "add", "add_any", "sub", "convert_element_type", "copy", "copy_p",
                           "select_n", "real", "imag", "complex", "conj"})
_COMPARISONS = frozenset({"gt", "ge", "lt", "le", "eq", "ne", "sign", "max", "min", "argmax", "argmin",
                          "clamp", "select_n", "round", "floor", "ceil", "while", "cond"})


@dataclasses.dataclass(frozen=True)
class Recurrence:
    """What :func:`classify` found about one scan: ``form`` is ``"diagonal"``, ``"complex"`` (a
    complex diagonal), ``"dense"``, or ``None`` with ``reason`` saying why it is not handled."""

    form: str | None
    reason: str = ""
    carry_bytes: int = 0   # bytes of one step's carry
    step_bytes: int = 0    # bytes of one step's intermediates (what plain reverse mode may keep)


def _eval_in_context(closed: jx.ClosedJaxpr):
    """``jaxpr_as_fun`` without each equation's own trace-time context (its mesh) and global
    shardings (``sharding=``/``out_sharding=`` params), calls evaluated inline the same way: for a
    body evaluated inside a ``shard_map``, whose values live on the manual mesh (a call re-entering
    the trace-time mesh would not fit them)."""
    jaxpr = closed.jaxpr

    def fun(*args):
        env = dict(zip(jaxpr.constvars, closed.consts))
        env.update(zip(jaxpr.invars, args))
        read = lambda a: a.val if isinstance(a, jx.Literal) else env[a]  # noqa: E731
        for eqn in jaxpr.eqns:
            body = call_body(eqn) if eqn.primitive.name in CALLS else None
            if body is not None:
                outs = _eval_in_context(body)(*map(read, eqn.invars))
            else:
                params = {k: (None if k in ("sharding", "out_sharding") else v) for k, v in eqn.params.items()}
                out = eqn.primitive.bind(*map(read, eqn.invars), **eqn.primitive.get_bind_params(params))
                outs = out if eqn.primitive.multiple_results else [out]
            env.update((v, o) for v, o in zip(eqn.outvars, outs) if not isinstance(v, jx.DropVar))
        return [read(v) for v in jaxpr.outvars]
    return fun


def body_function(body: jx.ClosedJaxpr, num_consts: int, num_carry: int, own_context: bool = True):
    """``(consts, carry, xs_t) -> (carry', ys_t)`` (lists) evaluating the scan body as written
    (``own_context=False``: in the caller's mesh context, as inside a ``shard_map``)."""
    if own_context:
        fun = jx.jaxpr_as_fun(body)
    else:   # custom-derivative calls as their primal: their rules re-enter the trace-time mesh
        fun = _eval_in_context(inline_calls(body, INLINABLE, deep=True))

    def step(consts: Sequence, carry: Sequence, xs: Sequence):
        outs = fun(*consts, *carry, *xs)
        return list(outs[:num_carry]), list(outs[num_carry:])
    return step


def _inexact(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def classify(eqn) -> Recurrence:
    """Whether the scan ``eqn`` is a linear recurrence in its carry, and of which form."""
    params = eqn.params
    body: jx.ClosedJaxpr = params["jaxpr"]
    nc, nk = jx.scan_num_consts(params), jx.scan_num_carry(params)
    avals = [v.aval for v in body.jaxpr.invars]
    c_avals, h_avals, x_avals = avals[:nc], avals[nc:nc + nk], avals[nc + nk:]
    carry_bytes = sum(aval_nbytes(a) for a in h_avals)
    step_bytes = sum(aval_nbytes(v.aval) for e in body.jaxpr.eqns for v in e.outvars)
    found = lambda form, reason="": Recurrence(form, reason, carry_bytes, step_bytes)  # noqa: E731
    if nk == 0:
        return found(None, "no carry")
    if not all(_inexact(a) for a in h_avals):
        return found(None, "an integer or boolean carry (a counter, a flag): not a linear state")
    if params.get("reverse"):
        return found(None, "a reverse scan")
    if jx.has_effects(body.jaxpr):
        return found(None, "side effects in the body")
    step = body_function(body, nc, nk)

    def tangent(consts, h, xs, dh):
        return jax.jvp(lambda hh: step(consts, hh, xs)[0], (list(h),), (list(dh),))[1]

    probe = inline_calls(jax.make_jaxpr(tangent)(*[
        [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in group] for group in (c_avals, h_avals, x_avals, h_avals)]))
    jaxpr = probe.jaxpr
    _, used = jx.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=False)
    h_vars = jaxpr.invars[nc:nc + nk]
    reads_h = [u for u, v in zip(used[nc:nc + nk], h_vars)]
    if any(reads_h):
        return found(None, _nonlinear_reason(body, nc, nk))
    live, _ = jx.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    return found(_form(jx.closed(live, probe.consts), nc, nk, len(x_avals), h_avals))


def _nonlinear_reason(body: jx.ClosedJaxpr, nc: int, nk: int) -> str:
    """Why the carry update is not linear: the primitives the carry reaches on its way out."""
    jaxpr = inline_calls(body).jaxpr
    tainted = set(jaxpr.invars[nc:nc + nk])
    prims: list[str] = []
    for e in jaxpr.eqns:
        if any(isinstance(a, jx.Var) and a in tainted for a in e.invars):
            tainted.update(e.outvars)
            if e.primitive.name not in ("mul", "add", "add_any", "sub", "neg", "dot_general",
                                        "convert_element_type", "broadcast_in_dim", "reshape",
                                        "transpose", "squeeze", "expand_dims", "reduce_sum"):
                prims.append(e.primitive.name)
    comparisons = sorted({p for p in prims if p in _COMPARISONS})
    if comparisons:
        return f"the state feeds a comparison or branch ({', '.join(comparisons)}): not a linear recurrence"
    others = sorted(set(prims)) or ["a product of the state with itself"]
    return f"the carry update is non-linear in the state (through {', '.join(others)})"


def _form(probe: jx.ClosedJaxpr, nc: int, nk: int, nx: int, h_avals) -> str:
    """``diagonal``/``complex`` when each carry tangent is an elementwise multiple of its own, else ``dense``."""
    jaxpr = probe.jaxpr
    dh_vars = jaxpr.invars[nc + nk + nx:]
    origin: dict = {v: {i} for i, v in enumerate(dh_vars)}
    for e in jaxpr.eqns:
        sources = set()
        touched = [a for a in e.invars if isinstance(a, jx.Var) and a in origin]
        for a in touched:
            sources |= origin[a]
        if not touched:
            continue
        name = e.primitive.name
        same_shape = all(getattr(v.aval, "shape", None) == getattr(touched[0].aval, "shape", None)
                         for v in list(touched) + list(e.outvars))
        if name not in _DIAGONAL_OPS or not same_shape or (name == "mul" and len(touched) > 1) \
                or (name == "select_n" and e.invars[0] in origin):
            return "dense"
        for v in e.outvars:
            origin[v] = sources
    for i, v in enumerate(jaxpr.outvars):
        if isinstance(v, jx.Var) and v in origin and origin[v] != {i}:
            return "dense"
    return "complex" if any(jnp.issubdtype(a.dtype, jnp.complexfloating) for a in h_avals) else "diagonal"
