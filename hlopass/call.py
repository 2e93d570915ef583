"""``hlopass_call``: a call primitive whose body goes through the pass pipeline when lowered.

``hlopass.jit`` stages the user's function as one ``hlopass_call`` equation
holding the *original* jaxpr. JAX transforms it like any call: the JVP rule
makes a ``hlopass_call`` of the JVP jaxpr, linearisation and partial
evaluation split it into ``hlopass_call`` s of the primal and tangent parts,
transposition makes a ``hlopass_call`` of the backward jaxpr, and vmap one of
the batched jaxpr. Only the lowering rule runs the passes, so the forward
program, its derivatives (the backward pass included) and its batched forms
are all rewritten. The rules follow ``jax._src.compute_on``: each is
registered right under its definition.

Its parameters: ``jaxpr`` (the program, before any pass), ``config``,
``name`` (for reports) and ``notes`` (what the passes' extension points
found while tracing or before linearising it; they go to its report).

Called with concrete arguments it runs as a checked call (:mod:`hlopass.checked`); lowered as part
of another program, it is checked against the memory limit by :func:`hlopass.never_worse.settle`.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import jax
from hlopass import internals as jx

from hlopass import program_cache, sharding
from hlopass.checked import checked_primitive_call, measured_by_caller, program_name
from hlopass.families import CHEAP_TO_RECOMPUTE
from hlopass.jaxpr_utils import aval_nbytes, trace_flat
from hlopass.memory import deferring_checks
from hlopass.never_worse import settle
from hlopass.pipeline import before_linearize, forget, run_pipeline

hlopass_call_p = jx.Primitive("hlopass_call")
hlopass_call_p.multiple_results = True


def bind(args, *, jaxpr: jx.ClosedJaxpr, config, name: str, notes: tuple = ()):
    """Stage (or run) ``jaxpr`` on ``args`` as a ``hlopass_call``."""
    return hlopass_call_p.bind(*args, jaxpr=jaxpr, config=config, name=name, notes=tuple(notes))


def _impl(*args, jaxpr, config, name, notes):
    if jx.disable_jit.value:  # as jax.jit does under jax.disable_jit(): run op by op
        return jx.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, *args)
    return checked_primitive_call(jaxpr, config, name, notes)(*args)


hlopass_call_p.def_impl(_impl)


def _abstract_eval(*in_avals, jaxpr, config, name, notes):
    return jaxpr.out_avals, jx.positional_effects(jaxpr)


hlopass_call_p.def_effectful_abstract_eval(_abstract_eval)


# -- lowering: the passes, and the memory check of programs compiled as part of another -----------

def _lowering(ctx, *args, jaxpr, config, name, notes):
    # the passes see how the jit arguments are sharded, and re-trace inside shard_map with its axes bound
    shardings = sharding.operand_shardings(ctx, args)
    whole = measured_by_caller.get()
    mine = whole is not None and whole.result is None  # the caller compiles this program whole and measures it
    with sharding.inputs_sharded(sharding.operand_shards(ctx, args), shardings), sharding.manual_context(ctx):
        with deferring_checks(mine):
            result = run_pipeline(jaxpr, config, label=name, notes=notes)
        if result.unconfirmed and (not mine or result.needs_comparison):
            # made for a caller that measures, met elsewhere (or to be compared alone): check it now
            forget(result)
            result = run_pipeline(jaxpr, config, label=name, notes=notes)
    if mine and (whole.compares or not result.needs_comparison):
        whole.result = result
    else:
        settle(result, name, shardings)
    with program_cache.lowering(result.to_lower):
        return jx.core_call_lowering(ctx, *args, name=program_name(name), call_jaxpr=result.to_lower)


jx.register_lowering(hlopass_call_p, _lowering, cacheable=False)


# -- transformation rules ----------------------------------------------------------------------

def _to_lojax(*hi_args, jaxpr, config, name, notes):
    # As jax.jit's rule: a program holding high-level types or primitives (the remat3 checkpoint,
    # hijax types) becomes a hlopass_call of its low-level form.
    def bind(lo_args, lo_jaxpr):
        return hlopass_call_p.bind(*lo_args, jaxpr=lo_jaxpr, config=config, name=name, notes=notes)
    return jx.lower_high_level_call(jaxpr, hi_args, bind)


hlopass_call_p.to_lojax = _to_lojax


def _batcher(axis_data, vals_in, dims_in, *, jaxpr, config, name, notes):
    batched_jaxpr, dims_out = jx.batch_jaxpr2(jaxpr, axis_data, dims_in)
    outs = hlopass_call_p.bind(*vals_in, jaxpr=batched_jaxpr, config=config, name=f"vmap({name})", notes=notes)
    return outs, dims_out


jx.fancy_primitive_batchers[hlopass_call_p] = _batcher


def _jvp(primals, tangents, *, jaxpr, config, name, notes):
    nzs = [not isinstance(t, jx.Zero) for t in tangents]
    jaxpr_jvp, out_nzs = jx.jvp_jaxpr(jaxpr, nzs, False)
    nz_tangents = [t for t in tangents if not isinstance(t, jx.Zero)]
    outs = hlopass_call_p.bind(*primals, *nz_tangents, jaxpr=jaxpr_jvp, config=config, name=f"jvp({name})",
                               notes=notes)
    primals_out, nz_tangents_out = outs[:len(out_nzs)], outs[len(out_nzs):]
    nz_outs = iter(nz_tangents_out)
    tangents_out = [next(nz_outs) if nz else jx.Zero(aval.to_tangent_aval())
                    for aval, nz in zip(jaxpr.out_avals, out_nzs)]
    return primals_out, tangents_out


jx.primitive_jvps[hlopass_call_p] = _jvp


class _Linearized(NamedTuple):
    out_avals: tuple
    consts: tuple
    primal_jaxpr: jx.ClosedJaxpr
    num_res_out: int
    nzs_out: tuple
    in_fwd_res: tuple
    tangent_jaxpr: jx.ClosedJaxpr
    notes: tuple


@jx.weakref_lru_cache
def _linearized(jaxpr: jx.ClosedJaxpr, nzs: tuple, is_vjp: bool, config) -> _Linearized:
    """The passes' ``before_linearize`` rewrites and the primal/tangent split of ``jaxpr``, once per
    program (so that a gradient taken again finds the same programs and compiles nothing)."""
    used, notes = jaxpr, ()
    if is_vjp:  # the hooks may emit custom_vjp functions, which forward mode (jax.linearize) cannot run
        used, notes = before_linearize(jaxpr, config)
    used, primal_jaxpr, num_res_out, nzs_out, in_fwd_res, tangent_jaxpr = primal_tangent_split(
        used, list(nzs), is_vjp, config)
    return _Linearized(tuple(used.out_avals), tuple(used.consts), primal_jaxpr, num_res_out, tuple(nzs_out),
                       tuple(in_fwd_res), tangent_jaxpr, notes)


def _linearize(is_vjp, nzs, *primals, jaxpr, config, name, notes):
    lin = _linearized(jaxpr, tuple(nzs), is_vjp, config)
    notes = (*notes, *lin.notes)
    tangent_avals_out = [a.to_tangent_aval() for a in lin.out_avals]
    tangent_jaxpr, nzs_out = lin.tangent_jaxpr, lin.nzs_out

    def tangent_fun(residuals, *tangents):
        tangents_nz = [t for nz, t in zip(nzs, tangents) if nz]
        nz_outs = hlopass_call_p.bind(*residuals, *tangents_nz, jaxpr=tangent_jaxpr, config=config,
                                      name=f"lin({name})", notes=())
        nz_outs_ = iter(nz_outs)
        return [next(nz_outs_) if nz else jx.Zero(a) for nz, a in zip(nzs_out, tangent_avals_out)]

    ans = hlopass_call_p.bind(*primals, jaxpr=lin.primal_jaxpr, config=config, name=name, notes=notes)
    primal_ans, residuals_ans = jx.split_list(ans, [len(ans) - lin.num_res_out])
    residuals_ans = jx.subs_list(lin.in_fwd_res, [*lin.consts, *primals], residuals_ans)
    return primal_ans, list(nzs_out), residuals_ans, tangent_fun


jx.register_linearization(hlopass_call_p, _linearize)


def primal_tangent_split(jaxpr, nzs, is_vjp, config):
    """``(jaxpr used, *jx.linearize_jaxpr(...))``.

    When JAX's own linearisation would save a residual larger than the threshold for the backward
    pass (the n x m x d difference of a naive distance, say), ``jaxpr`` is linearised under
    ``jax.checkpoint`` instead, with a policy that recomputes only what is cheap to recompute
    (elementwise work, broadcasts, reductions, products over a short axis:
    :data:`~hlopass.families.CHEAP_TO_RECOMPUTE`) and saves the rest (a Cholesky factor, a
    solve, a sort), so the backward ``hlopass_call`` recomputes the large cheap values and the
    passes can split that recomputation. The rematerialised split is used only if it saves fewer
    residual bytes than JAX's own.
    """
    split = jx.linearize_jaxpr(jaxpr, nzs, is_vjp=is_vjp)
    if config.threshold is not None and any(aval_nbytes(a) > config.threshold for a in _residual_avals(split)):
        remat = rematerialized(jaxpr)
        remat_split = jx.linearize_jaxpr(remat, nzs, is_vjp=is_vjp)
        if _residual_bytes(remat_split) < _residual_bytes(split):
            return (remat, *remat_split)
    return (jaxpr, *split)


def _residual_avals(split):
    primal_jaxpr, num_res_out = split[0], split[1]
    return primal_jaxpr.out_avals[len(primal_jaxpr.out_avals) - num_res_out:]


def _residual_bytes(split) -> int:
    # residuals forwarded from the inputs cost nothing new
    in_fwd = split[3]
    return sum(aval_nbytes(a) for a, fwd in zip(_residual_avals(split), in_fwd) if fwd is None) \
        if len(in_fwd) == split[1] else sum(aval_nbytes(a) for a in _residual_avals(split))


#: ``dot_general`` s contracting at most this many elements per result element are recomputed.
RECOMPUTE_MAX_CONTRACTION = 128


def recompute_cheap_only(prim, *avals, **params) -> bool:
    """``jax.checkpoint`` policy: ``True`` (save) unless the primitive is cheap to recompute."""
    if prim.name == "dot_general":
        (contracting, _), _ = params["dimension_numbers"]
        shape = getattr(avals[0], "shape", ())
        return math.prod(shape[d] for d in contracting) > RECOMPUTE_MAX_CONTRACTION
    return prim.name not in CHEAP_TO_RECOMPUTE


def rematerialized(jaxpr: jx.ClosedJaxpr) -> jx.ClosedJaxpr:
    """``jaxpr`` wrapped in ``jax.checkpoint`` with :func:`recompute_cheap_only` (same signature)."""
    body = jax.checkpoint(jx.jaxpr_as_fun(jaxpr), policy=recompute_cheap_only, prevent_cse=False)
    return trace_flat(lambda *args: body(*args), jaxpr.in_avals, "remat")


def _partial_eval(trace, *in_tracers, jaxpr, config, name, notes):
    in_pvals = [t.pval for t in in_tracers]
    unknown_ins = tuple(not pv.is_known() for pv in in_pvals)
    known_jaxpr, unknown_jaxpr, unknown_outs, res_out_avals, in_fwd_res = \
        jx.partial_eval_jaxpr_nounits_fwd(jaxpr, unknown_ins, instantiate=False)
    known_inputs = [pv.get_known() for pv in in_pvals if pv.is_known()]
    all_known_outs = hlopass_call_p.bind(*known_inputs, jaxpr=known_jaxpr, config=config, name=name, notes=notes)
    known_out_vals, residual_vals = jx.split_list(all_known_outs, [len(all_known_outs) - len(res_out_avals)])
    residual_vals_ = iter(residual_vals)
    residual_vals = [next(residual_vals_) if f is None else [*jaxpr.consts, *known_inputs][f] for f in in_fwd_res]
    residual_tracers = [trace.new_instantiated_const(r) for r in residual_vals]
    unknown_params = dict(jaxpr=unknown_jaxpr, config=config, name=f"staged({name})", notes=())
    unknown_tracers_in = [*residual_tracers, *(t for t in in_tracers if not t.pval.is_known())]
    unknown_tracers_out = [jx.JaxprTracer(trace, jx.PartialVal.unknown(aval), None)
                           for aval in unknown_jaxpr.out_avals]
    eqn = jx.new_eqn_recipe(trace, unknown_tracers_in, unknown_tracers_out, hlopass_call_p, unknown_params,
                            jx.positional_effects(unknown_jaxpr), jx.current_source_info())
    for t in unknown_tracers_out:
        t.recipe = eqn
    if jx.partial_eval_kept_effects.filter_in(unknown_jaxpr.effects):
        trace.effect_handles.append(jx.EffectHandle(unknown_tracers_in, eqn))
    return jx.merge_lists(unknown_outs, known_out_vals, unknown_tracers_out)


jx.custom_partial_eval_rules[hlopass_call_p] = _partial_eval


def _params_updater(unks_in, inst_in, kept_outs_known, kept_outs_staged, num_res_out, num_res_in,
                    params_known, params_staged):
    return params_known, params_staged


jx.partial_eval_jaxpr_custom_rules[hlopass_call_p] = \
    lambda *a, **k: jx.closed_call_partial_eval_custom_rule("jaxpr", _params_updater, *a, **k)


@jx.weakref_lru_cache
def _transpose_jaxpr(jaxpr, in_avals, in_tree):
    cell = lambda: None  # noqa: E731

    def transposed(*in_flat):
        primals_in, cts_in = jx.tree_unflatten(in_tree, in_flat)
        out = jx.backward_pass(jaxpr.jaxpr, False, jaxpr.consts, primals_in, cts_in)
        out = [ct if not isinstance(ct, jx.Zero) else None for ct in out]
        cts_out, cell.out_tree = jx.tree_flatten(out)
        return cts_out

    dbg = jaxpr.jaxpr.debug_info.with_unknown_names()
    trans_jaxpr, _, consts = jx.trace_to_jaxpr_dynamic(jx.wrap_init(transposed, debug_info=dbg), in_avals)
    return jx.ClosedJaxpr(trans_jaxpr, consts), cell.out_tree


def _transpose(cts_in, *primals_in, jaxpr, config, name, notes):
    in_flat, in_tree = jx.tree_flatten((primals_in, cts_in))
    in_avals = tuple(jx.typeof(x) for x in in_flat)
    trans_jaxpr, out_tree = _transpose_jaxpr(jaxpr, in_avals, in_tree)
    cts_out = hlopass_call_p.bind(*in_flat, jaxpr=trans_jaxpr, config=config, name=f"transpose({name})", notes=())
    return jx.tree_unflatten(out_tree, cts_out)


jx.primitive_transposes[hlopass_call_p] = _transpose


def as_lowered(eqn) -> tuple[jx.ClosedJaxpr, list[bool]]:
    """The program a lowering of the ``hlopass_call`` ``eqn`` hands the passes when every result is
    used, and which inputs it keeps: JAX's dead-code elimination of the enclosing ``jax.jit`` goes
    through :func:`_dce_rule` first. (``f.trace(x).report`` then reports, and caches, what
    ``f(x)`` compiles.)"""
    used_inputs, new_eqn = _dce_rule([True] * len(eqn.outvars), eqn)
    return new_eqn.params["jaxpr"], used_inputs


def _dce_rule(used_outputs, eqn):
    if not any(used_outputs) and not jx.has_effects(eqn):
        return [False] * len(eqn.invars), None
    dced_jaxpr, used_inputs = jx.cached_call_dce(eqn.params["jaxpr"], tuple(used_outputs))
    unchanged = len(dced_jaxpr.jaxpr.eqns) == len(eqn.params["jaxpr"].jaxpr.eqns)
    if all(used_outputs) and all(used_inputs) and unchanged:
        return used_inputs, eqn  # nothing removed: the same program (its pipeline result is cached by it)
    new_params = dict(eqn.params, jaxpr=dced_jaxpr)
    new_invars = [v for v, used in zip(eqn.invars, used_inputs) if used]
    new_eqn = jx.new_jaxpr_eqn(new_invars, [v for v, used in zip(eqn.outvars, used_outputs) if used],
                               eqn.primitive, new_params, jx.eqn_effects(dced_jaxpr, new_invars),
                               eqn.source_info, eqn.ctx)
    return used_inputs, new_eqn


jx.dce_rules[hlopass_call_p] = _dce_rule


# hlopass's own frames are JAX-internal: source lines in reports, jaxprs and StableHLO name the user's
# (the registry does the same for the passes' folder when it loads them).
jx.register_exclusion(os.path.dirname(os.path.abspath(__file__)) + os.sep)
