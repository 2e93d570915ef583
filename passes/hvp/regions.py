"""Jaxpr half of the HVP rewrite: inner-gradient regions get a forward-over-reverse VJP rule.

Used as a linearize hook: when JAX differentiates a ``hlopass_call`` (for
``jax.grad(hlopass.jit(meta_loss))``), the primal jaxpr is rewritten first.
In a primal jaxpr an inner ``jax.grad`` / ``jax.value_and_grad`` appears as
a run of equations whose name stack starts with ``jvp(...)`` (the inner
forward pass, with the loss value and the residuals) followed by a run
starting with ``transpose(jvp(...))`` (the inner backward pass). Each such
region R: inputs -> gradients (and the loss value, when it is used) is
replaced by one ``jax.custom_vjp`` call:

- primal and forward rule: the region's own equations, evaluated as they
  were; the residuals are the region's inputs (and its outputs);
- backward rule, for cotangents ``ct`` of the gradients: ``jax.jvp`` of the
  region itself with respect to the parameters, in direction ``ct``, which by
  the symmetry of the Hessian is the parameters' cotangent ``H ct``; for the
  other differentiable inputs u (meta-parameters, loss weights), ``jax.jvp``
  of the gradient of the loss with respect to u (the loss rebuilt from the
  forward run, see :func:`_loss_function`), in the same direction: the mixed
  second derivatives ``d2L/du dtheta . ct``.

Both rest on the region being the derivative of its loss, which is
checked: ``jax.grad`` of the rebuilt loss must transpose the same operations
as the region does. When it does not (a ``custom_jvp`` rule inside the loss
changes the backward run) or no loss can be singled out, the mixed products
come from a local VJP of the region (exact, recomputed in the backward
rule), while the parameters' ``H ct`` is still the jvp: custom_jvp rules are
trusted to be derivatives, as :mod:`.trace` trusts them. A ``custom_vjp``
rule is not trusted (a hand-written backward pass need not be the
derivative of anything, and then its Jacobian is not symmetric): once the
user's ``jax.grad`` has run it leaves no primitive, only equations whose
tracebacks pass through JAX's ``process_custom_vjp_call``; a region with
such equations (or without tracebacks) and no verified loss gets a local
VJP for every input (reported as ``recomputed_hvp``).

A gradient output is matched to the parameter it differentiates by type:
the region input with the same shape and dtype that the loss reads. When
several inputs qualify, the one for which ``jax.grad`` of the rebuilt loss
transposes the same operations as the region does is taken; when that does
not single one out either, the region is left alone (it would be a guess).

Each replaced region becomes a ``fwdrev_hvp`` (or ``recomputed_hvp``) note,
each region left alone a ``skip`` note with the reason, all at the inner
loss's source line; the notes travel with the program to the pass's report.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from hlopass import internals as jx
from jax.custom_derivatives import SymbolicZero

from hlopass.interpreter import Replacement, inline_calls, rewrite, rewrite_nested
from hlopass.families import CUSTOM_DERIVATIVE_CALLS
from hlopass.jaxpr_utils import iter_eqns, subjaxprs
from hlopass.report import Note, source_line

from .fwdrev import SCOPE, add_note, forward_differentiable, own_derivatives

FORWARD, BACKWARD = "forward", "backward"


def _transforms(eqn) -> list[str]:
    stack = getattr(eqn.source_info.name_stack, "stack", ())
    return [item.name for item in stack if type(item).__name__ == "Transform"]


def _role(eqn) -> str | None:
    """FORWARD for ``jvp(...)`` equations, BACKWARD for ``transpose(jvp(...))`` ones, else None."""
    names = _transforms(eqn)
    if names[:1] == ["jvp"]:
        return FORWARD
    if names[:2] == ["transpose", "jvp"]:
        return BACKWARD
    return None


@dataclasses.dataclass
class GradRegion:
    """An inner gradient: ``forward`` then ``backward`` equation indices of one jaxpr level."""

    forward: list[int]
    backward: list[int]

    @property
    def eqns(self) -> list[int]:
        return self.forward + self.backward


def _constant(eqn) -> bool:
    """Reads no variables (zeros and iotas JAX emits between transformed equations)."""
    return not any(isinstance(a, jx.Var) for a in eqn.invars) and not eqn.effects


def find_regions(jaxpr: jx.Jaxpr) -> list[GradRegion]:
    """Runs of forward equations immediately followed by runs of backward equations.

    Constant equations (no inputs) between them are taken into the run.
    """
    roles = [_role(eqn) for eqn in jaxpr.eqns]
    constant = [_constant(eqn) for eqn in jaxpr.eqns]
    regions, i, n = [], 0, len(roles)

    def run_end(start, role):
        end = start
        while end < n and (roles[end] == role or (constant[end] and roles[end] is None)):
            end += 1
        while end > start and roles[end - 1] != role:  # trailing constants belong to what follows
            end -= 1
        return end

    while i < n:
        if roles[i] != FORWARD:
            i += 1
            continue
        j = run_end(i, FORWARD)
        k = j
        while k < n and roles[k] is None and constant[k]:
            k += 1
        k_end = run_end(k, BACKWARD) if k < n and roles[k] == BACKWARD else j
        if k_end > j:
            regions.append(GradRegion(list(range(i, j)), list(range(j, k_end))))
            i = k_end
        else:
            i = j
    return regions


def _float_aval(aval) -> bool:
    return hasattr(aval, "dtype") and jnp.issubdtype(aval.dtype, jnp.floating)


def _same_type(a, b) -> bool:
    return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype


@dataclasses.dataclass
class RegionPlan:
    """What replacing one region needs: its inputs, outputs and the parameter each gradient belongs to."""

    region: GradRegion
    inputs: list[jx.Var]
    grads: list[jx.Var]
    params: list[int]  # for each gradient, the index of its parameter in ``inputs``
    value: jx.Var | None  # the loss value, when the program uses it
    loss: jx.Var | None  # the loss value var (used or not), if the region provably derives from it
    extras: list[jx.Var]  # other values of the inner forward pass used outside (aux outputs)
    location: str
    symmetric: bool = True  # whether the Hessian products may be taken forward-over-reverse


def plan_region(jaxpr: jx.Jaxpr, region: GradRegion) -> RegionPlan | str:
    """A :class:`RegionPlan`, or the reason the region is left alone."""
    eqns = [jaxpr.eqns[i] for i in region.eqns]
    if any(eqn.effects for eqn in eqns):
        return "the region has side effects"
    if not forward_differentiable(eqns):
        return "the region calls a custom_vjp function, which forward mode cannot differentiate"
    inside = set(region.eqns)
    defined = {v for eqn in eqns for v in eqn.outvars if not isinstance(v, jx.DropVar)}
    inputs: list[jx.Var] = []
    for eqn in eqns:
        for atom in eqn.invars:
            if isinstance(atom, jx.Var) and atom not in defined and atom not in inputs:
                inputs.append(atom)
    read_outside = {a for i, eqn in enumerate(jaxpr.eqns) if i not in inside
                    for a in eqn.invars if isinstance(a, jx.Var)} | {
                        v for v in jaxpr.outvars if isinstance(v, jx.Var)}
    read_inside = {a for eqn in eqns for a in eqn.invars if isinstance(a, jx.Var)}
    forward_defined = [v for i in region.forward for v in jaxpr.eqns[i].outvars if not isinstance(v, jx.DropVar)]
    backward_defined = [v for i in region.backward for v in jaxpr.eqns[i].outvars if not isinstance(v, jx.DropVar)]
    grads = [v for v in backward_defined if v in read_outside]
    if not grads:
        return "the gradient is not used"
    losses = [v for v in forward_defined if v not in read_inside and v.aval.shape == () and _float_aval(v.aval)]
    loss = losses[0] if len(losses) == 1 else None
    forward_out = [v for v in forward_defined if v in read_outside]
    value = loss if loss is not None and loss in forward_out else None
    extras = [v for v in forward_out if v is not value]
    loss_inputs = _inputs_read_by(jaxpr, region.forward, loss, inputs) if loss is not None else inputs
    params = []
    for g in grads:
        matches = [k for k, v in enumerate(inputs)
                   if _float_aval(v.aval) and _same_type(v.aval, g.aval) and v in loss_inputs]
        if len(matches) > 1 and loss is not None and len(grads) == 1:
            matches = _matching_derivations(jaxpr, region, inputs, loss, matches)
        if len(matches) != 1:
            return (f"cannot tell which input the gradient {g.aval.str_short()} belongs to "
                    f"({len(matches)} candidates of that type)")
        params.append(matches[0])
    if len(set(params)) != len(params):
        return "two gradients match the same input"
    verified = [v for v in losses if _derives_region(jaxpr, region, inputs, v, params)]
    # the loss is the one candidate that jax.grad re-derives the region from; none (a custom_jvp or
    # custom_vjp rule inside, say) means the Hessian's symmetry is not established either
    loss = verified[0] if len(verified) == 1 else None
    value = loss if loss is not None and loss in forward_out else None
    extras = [v for v in forward_out if v is not value]
    symmetric = loss is not None or not _may_hold_custom_vjp(eqns)
    anchor = jaxpr.eqns[region.forward[0]]
    return RegionPlan(region, inputs, grads, params, value, loss, extras, source_line(anchor), symmetric)


def _may_hold_custom_vjp(eqns) -> bool:
    """Whether a hand-written VJP (a ``custom_vjp`` rule) may have produced some of ``eqns``.

    Once the user's ``jax.grad`` has run, a ``custom_vjp`` leaves no primitive
    behind, only its rules' equations, whose tracebacks pass through JAX's
    ``process_custom_vjp_call``. An equation without a traceback may be one too.
    """
    for eqn in eqns:
        traceback = eqn.source_info.traceback
        if traceback is None or any("process_custom_vjp_call" in frame.function_name for frame in traceback.frames):
            return True
    return False


def _backward_signature(eqns) -> list[str]:
    """The primitives of the backward (transposed) equations, constants left out."""
    return [eqn.primitive.name for eqn in eqns if _role(eqn) == BACKWARD and not _constant(eqn)]


def _derives_region(jaxpr, region: GradRegion, inputs, loss, params: list[int]) -> bool:
    """Whether ``jax.grad`` of the rebuilt loss w.r.t. ``params`` transposes what the region does."""
    target = _backward_signature([jaxpr.eqns[i] for i in region.backward])
    evaluate = _as_function([jaxpr.eqns[i] for i in region.forward], inputs, [loss])

    def grads(*args):
        return jax.grad(lambda *ps: evaluate(*_replace(args, params, ps))[0],
                        argnums=tuple(range(len(params))))(*(args[p] for p in params))
    try:
        derived = jax.make_jaxpr(grads)(*[v.aval for v in inputs])
    except Exception:  # noqa: BLE001 - what cannot be re-derived is not trusted
        return False
    return _backward_signature(derived.jaxpr.eqns) == target


def _matching_derivations(jaxpr, region: GradRegion, inputs, loss, candidates: list[int]) -> list[int]:
    """The candidates k for which ``jax.grad`` of the rebuilt loss w.r.t. input k transposes the same
    primitives, in the same order, as the region's backward run.

    Differentiating with respect to another input of the same type transposes
    a different set of the loss's operations, so at most the true parameter
    matches unless the loss treats the candidates symmetrically (then all
    match and the region is left alone).
    """
    target = _backward_signature([jaxpr.eqns[i] for i in region.backward])
    evaluate = _as_function([jaxpr.eqns[i] for i in region.forward], inputs, [loss])
    avals = [v.aval for v in inputs]
    found = []
    for k in candidates:
        def grad_k(*args, k=k):
            return jax.grad(lambda x: evaluate(*_replace(args, [k], [x]))[0])(args[k])
        try:
            derived = jax.make_jaxpr(grad_k)(*avals)
        except Exception:  # noqa: BLE001 - a candidate that cannot be derived does not match
            continue
        if _backward_signature(derived.jaxpr.eqns) == target:
            found.append(k)
    return found


def _inputs_read_by(jaxpr, forward: list[int], loss, inputs) -> set:
    """The region inputs that the loss value depends on."""
    sub = _jaxpr([jaxpr.eqns[i] for i in forward], inputs, [loss])
    _, used = jx.dce_jaxpr(sub, [True])
    return {v for v, u in zip(inputs, used) if u}


def _jaxpr(eqns, inputs, outputs) -> jx.Jaxpr:
    debug = jx.DebugInfo("hvp region", "<hvp region>", None, None)
    return jx.Jaxpr([], list(inputs), list(outputs), list(eqns), debug_info=debug)


def _as_function(eqns: Sequence[jx.JaxprEqn], inputs: Sequence[jx.Var], outputs: Sequence[jx.Var]) -> Callable:
    """Evaluate ``eqns`` (only those the outputs need) as a function of ``inputs``."""
    sub = _jaxpr(eqns, inputs, outputs)
    sub, _ = jx.dce_jaxpr(sub, [True] * len(outputs), instantiate=True)
    return lambda *args: jx.eval_jaxpr(sub, [], *args)


def _loss_function(jaxpr, plan: RegionPlan) -> Callable | None:
    """The inner loss as a function of the region's inputs, rebuilt from the forward run."""
    if plan.loss is None:
        return None
    evaluate = _as_function([jaxpr.eqns[i] for i in plan.region.forward], plan.inputs, [plan.loss])
    return lambda *args: evaluate(*args)[0]


def _zero(ct) -> bool:
    return isinstance(ct, SymbolicZero) or ct is None


def fwdrev_region(region_fn: Callable, loss_fn: Callable | None, extras_fn: Callable | None, params: list[int],
                  num_inputs: int, has_value: bool, symmetric: bool = True) -> Callable:
    """A custom_vjp function ``(*inputs) -> (*grads[, value], *extras)`` with a forward-over-reverse VJP.

    ``extras`` (other values of the inner forward pass the program uses, such
    as ``has_aux`` outputs) get an ordinary, local VJP through ``extras_fn``.
    Without ``symmetric`` the gradients' cotangents get a local VJP too (see
    :func:`_hessian_products`).
    """
    num_grads = len(params)
    first_extra = num_grads + int(has_value)

    @jax.custom_vjp
    def call(*inputs):
        return tuple(region_fn(*inputs))

    def fwd(*primals):
        values = [p.value for p in primals]
        perturbed = [p.perturbed and _float_aval(jx.typeof(v)) for p, v in zip(primals, values)]
        outs = tuple(region_fn(*values))
        return outs, (values, perturbed, outs)

    def bwd(residuals, cts):
        with own_derivatives():
            return _bwd(residuals, cts)

    def _bwd(residuals, cts):
        values, perturbed, outs = residuals
        ct_grads = list(cts[:num_grads])
        ct_value = cts[num_grads] if has_value else None
        total: list[Any] = [None] * num_inputs
        others = [i for i in range(num_inputs) if perturbed[i] and i not in params]
        directions = [(k, p) for k, p in enumerate(params) if not _zero(ct_grads[k])]
        if directions:
            _add(total, _hessian_products(region_fn, loss_fn, symmetric, values, params,
                                          others, directions, ct_grads,
                                          num_grads))
        if has_value and not _zero(ct_value):
            for k, p in enumerate(params):
                _add(total, {p: ct_value * outs[k]})
            if others:
                _add(total, _value_cotangents(loss_fn, values, others, ct_value))
        ct_extras = cts[first_extra:]
        if extras_fn is not None and not all(_zero(ct) for ct in ct_extras):
            _add(total, _extras_cotangents(extras_fn, values, perturbed, ct_extras, outs[first_extra:]))
        return tuple(None if (t is None or not perturbed[i]) else t for i, t in enumerate(total))

    call.defvjp(fwd, bwd, symbolic_zeros=True)
    return call


def _add(total: list, contributions: dict) -> None:
    for i, ct in contributions.items():
        total[i] = ct if total[i] is None else total[i] + ct


def _replace(values, positions, new):
    full = list(values)
    for p, v in zip(positions, new):
        full[p] = v
    return full


def _hessian_products(region_fn, loss_fn, symmetric, values, params, others, directions, ct_grads,
                      num_grads) -> dict:
    """The inputs' cotangents from the gradients' cotangents ``ct_grads``.

    When the region's Jacobian is ``symmetric`` (a Hessian): ``H ct`` for the
    parameters as a jvp of the region, and for ``others`` the mixed products
    as a jvp of the gradient of the loss (``loss_fn``) in them, or a local
    VJP of the region without one. Otherwise (a hand-written VJP inside may
    make the "gradient" no gradient of anything) a local VJP of the region
    for all of them: exact, recomputed here, nothing of the inner backward
    pass kept.
    """
    full_cts = tuple(ct if not _zero(ct) else jnp.zeros_like(values[params[k]]) for k, ct in enumerate(ct_grads))

    def local_vjp(wanted):
        _, pullback = jax.vjp(lambda *o: tuple(region_fn(*_replace(values, wanted, o))[:num_grads]),
                              *(values[i] for i in wanted))
        return dict(zip(wanted, pullback(full_cts)))

    if not symmetric:
        return local_vjp([*params, *others])
    moved = [p for _, p in directions]
    tangents = tuple(ct_grads[k] for k, _ in directions)
    primals = tuple(values[p] for p in moved)
    result: dict[int, Any] = {}

    def grads_at(*new):
        return tuple(region_fn(*_replace(values, moved, new))[:num_grads])

    _, hvp = jax.jvp(grads_at, primals, tangents)
    for k, p in enumerate(params):
        result[p] = hvp[k]
    if not others:
        return result
    if loss_fn is None:
        result.update(local_vjp(others))
        return result

    def other_grads_at(*new):
        at = _replace(values, moved, new)
        return jax.grad(lambda *o: loss_fn(*_replace(at, others, o)),
                        argnums=tuple(range(len(others))))(*(at[i] for i in others))
    _, mixed = jax.jvp(other_grads_at, primals, tangents)
    result.update(zip(others, mixed))
    return result


def _value_cotangents(loss_fn, values, others, ct_value) -> dict:
    """``ct_value * dL/du`` for the other inputs."""
    grads = jax.grad(lambda *o: loss_fn(*_replace(values, others, o)),
                     argnums=tuple(range(len(others))))(*(values[i] for i in others))
    return {i: ct_value * g for i, g in zip(others, grads)}


def _extras_cotangents(extras_fn, values, perturbed, ct_extras, extras) -> dict:
    """The ordinary VJP of the extra forward outputs (recomputed locally)."""
    wanted = [i for i, p in enumerate(perturbed) if p]
    if not wanted:
        return {}
    cts = tuple(jnp.zeros_like(x) if _zero(ct) else ct for ct, x in zip(ct_extras, extras))
    _, pullback = jax.vjp(lambda *o: tuple(extras_fn(*_replace(values, wanted, o))),
                          *(values[i] for i in wanted))
    return dict(zip(wanted, pullback(cts)))


def _replacement(jaxpr: jx.Jaxpr, plan: RegionPlan) -> Replacement:
    outputs = [*plan.grads, *([plan.value] if plan.value is not None else []), *plan.extras]
    region_eqns = [jaxpr.eqns[i] for i in plan.region.eqns]
    region_fn = _as_function(region_eqns, plan.inputs, outputs)
    loss_fn = _loss_function(jaxpr, plan)
    extras_fn = _as_function([jaxpr.eqns[i] for i in plan.region.forward], plan.inputs, plan.extras) \
        if plan.extras else None
    call = fwdrev_region(region_fn, loss_fn, extras_fn, plan.params, len(plan.inputs), plan.value is not None,
                         plan.symmetric)

    def build(*inputs):
        with jax.named_scope(SCOPE):
            return list(call(*inputs))

    return Replacement(plan.region.eqns, plan.inputs, outputs, build, anchor=plan.region.forward[0])


def rewrite_level(closed: jx.ClosedJaxpr, notes: list[Note]) -> jx.ClosedJaxpr:
    """Replace every inner-gradient region of one jaxpr level (the same object if there is none).

    Appends a note for each region, replaced or left alone.
    """
    if not any(_role(eqn) == BACKWARD for eqn in iter_eqns(closed)):
        return closed
    flat = inline_calls(closed)
    replacements = []
    for region in find_regions(flat.jaxpr):
        plan = plan_region(flat.jaxpr, region)
        if isinstance(plan, str):
            add_note(notes, Note("hvp", "skip", source_line(flat.jaxpr.eqns[region.forward[0]]),
                                 f"{plan} (Hessian products left reverse-over-reverse)", "inner gradient"))
            continue
        replacements.append(_replacement(flat.jaxpr, plan))
        if plan.symmetric:
            add_note(notes, Note("hvp", "fwdrev_hvp", plan.location,
                                 f"gradient of the inner loss at {plan.location} differentiated again: Hessian "
                                 f"products taken forward-over-reverse (inner backward activations not kept)"))
        else:
            add_note(notes, Note("hvp", "recomputed_hvp", plan.location,
                                 f"gradient of the inner loss at {plan.location} differentiated again: its backward "
                                 f"run may hold a custom_vjp rule (not provably the derivative of its loss), so "
                                 f"its Hessian products are recomputed reverse-over-reverse in the backward pass "
                                 f"(inner backward activations not kept)"))
    if not replacements:
        return closed
    return rewrite(flat, replacements, name="hvp")


def _bodies_not_differentiated(closed: jx.ClosedJaxpr) -> set[int]:
    """``id`` of every jaxpr (at any depth) inside a ``custom_jvp``/``custom_vjp`` body or a nested
    ``hlopass_call``: JAX differentiates the former by their rules, never their bodies (so a gradient
    there is never differentiated again), and the latter by their own linearisation, which runs
    this hook on them with their own notes."""
    found: set[int] = set()

    def mark(jaxpr: jx.Jaxpr) -> None:
        found.add(id(jaxpr))
        for eqn in jaxpr.eqns:
            for sub in subjaxprs(eqn):
                mark(sub)

    for eqn in iter_eqns(closed):
        if eqn.primitive.name in CUSTOM_DERIVATIVE_CALLS or eqn.primitive.name == "hlopass_call":
            for sub in subjaxprs(eqn):
                mark(sub)
    return found


def linearize_hook(jaxpr: jx.ClosedJaxpr, config=None, notes: list[Note] | None = None) -> jx.ClosedJaxpr:
    """Before JAX linearises a ``hlopass_call``: give its inner gradients forward-over-reverse VJPs.

    Returns ``jaxpr`` itself when it has no inner gradient; what was replaced
    or left alone is appended to ``notes``. Gradients inside ``custom_jvp``/``custom_vjp``
    bodies (the trace-time replacements among them) and nested ``hlopass_call`` s are left to
    their own rules.
    """
    notes = [] if notes is None else notes
    if not any(_role(eqn) == BACKWARD for eqn in iter_eqns(jaxpr)):
        return jaxpr
    skipped = _bodies_not_differentiated(jaxpr)

    def level(closed: jx.ClosedJaxpr) -> jx.ClosedJaxpr:
        return closed if id(closed.jaxpr) in skipped else rewrite_level(closed, notes)

    with own_derivatives():  # the analysis's own jax.grad calls are not the user's
        return rewrite_nested(jaxpr, level)
