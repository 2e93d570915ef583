"""``hlopass_call``: a call primitive whose body goes through the pass pipeline when lowered.

``hlopass.jit`` stages the user's function as one ``hlopass_call`` equation
holding the *original* jaxpr. JAX transforms it like any call: the JVP rule
makes a ``hlopass_call`` of the JVP jaxpr, linearisation and partial
evaluation split it into ``hlopass_call`` s of the primal and tangent parts,
transposition makes a ``hlopass_call`` of the backward jaxpr, and vmap one of
the batched jaxpr. Only the lowering rule runs the passes, so the forward
program, its derivatives (the backward pass included) and its batched forms
are all rewritten. The rules follow ``jax._src.compute_on``.
"""

from __future__ import annotations

from jax._src import core, source_info_util
from jax._src import effects as effects_lib
from jax._src.interpreters import ad, batching, mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.tree_util import tree_flatten, tree_unflatten
from jax._src.util import merge_lists, split_list, subs_list, weakref_lru_cache
from jax._src import linear_util as lu

from hlopass.pipeline import run_pipeline

hlopass_call_p = core.Primitive("hlopass_call")
hlopass_call_p.multiple_results = True


def bind(args, *, jaxpr: core.ClosedJaxpr, config, name: str):
    """Stage (or run) ``jaxpr`` on ``args`` as a ``hlopass_call``."""
    return hlopass_call_p.bind(*args, jaxpr=jaxpr, config=config, name=name)


def _impl(*args, jaxpr, config, name):
    from hlopass.execution import checked_primitive_call
    return checked_primitive_call(jaxpr, config, name)(*args)


hlopass_call_p.def_impl(_impl)


def _abstract_eval(*in_avals, jaxpr, config, name):
    return jaxpr.out_avals, core.positional_effects(jaxpr) if hasattr(core, "positional_effects") else jaxpr.effects


hlopass_call_p.def_effectful_abstract_eval(_abstract_eval)


def _lowering(ctx, *args, jaxpr, config, name):
    rewritten = run_pipeline(jaxpr, config, label=name).jaxpr
    return mlir.core_call_lowering(ctx, *args, name=f"hlopass_{_safe(name)}", call_jaxpr=rewritten)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name)[:60] or "call"


mlir.register_lowering(hlopass_call_p, _lowering, cacheable=False)


def _batcher(axis_data, vals_in, dims_in, *, jaxpr, config, name):
    batched_jaxpr, dims_out = batching.batch_jaxpr2(jaxpr, axis_data, dims_in)
    outs = hlopass_call_p.bind(*vals_in, jaxpr=batched_jaxpr, config=config, name=f"vmap({name})")
    return outs, dims_out


batching.fancy_primitive_batchers[hlopass_call_p] = _batcher


def _jvp(primals, tangents, *, jaxpr, config, name):
    nzs = [not isinstance(t, ad.Zero) for t in tangents]
    jaxpr_jvp, out_nzs = ad.jvp_jaxpr(jaxpr, nzs, False)
    nz_tangents = [t for t in tangents if not isinstance(t, ad.Zero)]
    outs = hlopass_call_p.bind(*primals, *nz_tangents, jaxpr=jaxpr_jvp, config=config, name=f"jvp({name})")
    primals_out, nz_tangents_out = outs[:len(out_nzs)], outs[len(out_nzs):]
    nz_outs = iter(nz_tangents_out)
    tangents_out = [next(nz_outs) if nz else ad.Zero(aval.to_tangent_aval())
                    for aval, nz in zip(jaxpr.out_avals, out_nzs)]
    return primals_out, tangents_out


ad.primitive_jvps[hlopass_call_p] = _jvp


def _linearize(is_vjp, nzs, *primals, jaxpr, config, name):
    from hlopass.linearize_hooks import primal_tangent_split
    jaxpr, primal_jaxpr, num_res_out, nzs_out, in_fwd_res, tangent_jaxpr = primal_tangent_split(
        jaxpr, nzs, is_vjp, config)
    tangent_avals_out = [a.to_tangent_aval() for a in jaxpr.out_avals]

    def tangent_fun(residuals, *tangents):
        tangents_nz = [t for nz, t in zip(nzs, tangents) if nz]
        nz_outs = hlopass_call_p.bind(*residuals, *tangents_nz, jaxpr=tangent_jaxpr, config=config,
                                      name=f"lin({name})")
        nz_outs_ = iter(nz_outs)
        return [next(nz_outs_) if nz else ad.Zero(a) for nz, a in zip(nzs_out, tangent_avals_out)]

    ans = hlopass_call_p.bind(*primals, jaxpr=primal_jaxpr, config=config, name=name)
    primal_ans, residuals_ans = split_list(ans, [len(ans) - num_res_out])
    residuals_ans = subs_list(in_fwd_res, [*jaxpr.consts, *primals], residuals_ans)
    return primal_ans, nzs_out, residuals_ans, tangent_fun


ad.primitive_linearizations[hlopass_call_p] = _linearize


def _partial_eval(trace, *in_tracers, jaxpr, config, name):
    in_pvals = [t.pval for t in in_tracers]
    unknown_ins = tuple(not pv.is_known() for pv in in_pvals)
    known_jaxpr, unknown_jaxpr, unknown_outs, res_out_avals, in_fwd_res = \
        pe.partial_eval_jaxpr_nounits_fwd(jaxpr, unknown_ins, instantiate=False)
    known_inputs = [pv.get_known() for pv in in_pvals if pv.is_known()]
    all_known_outs = hlopass_call_p.bind(*known_inputs, jaxpr=known_jaxpr, config=config, name=name)
    known_out_vals, residual_vals = split_list(all_known_outs, [len(all_known_outs) - len(res_out_avals)])
    residual_vals_ = iter(residual_vals)
    residual_vals = [next(residual_vals_) if f is None else [*jaxpr.consts, *known_inputs][f] for f in in_fwd_res]
    residual_tracers = [trace.new_instantiated_const(r) for r in residual_vals]
    unknown_params = dict(jaxpr=unknown_jaxpr, config=config, name=f"staged({name})")
    unknown_tracers_in = [*residual_tracers, *(t for t in in_tracers if not t.pval.is_known())]
    unknown_tracers_out = [pe.JaxprTracer(trace, pe.PartialVal.unknown(aval), None)
                           for aval in unknown_jaxpr.out_avals]
    eqn = pe.new_eqn_recipe(trace, unknown_tracers_in, unknown_tracers_out, hlopass_call_p, unknown_params,
                            core.positional_effects(unknown_jaxpr), source_info_util.current())
    for t in unknown_tracers_out:
        t.recipe = eqn
    if effects_lib.partial_eval_kept_effects.filter_in(unknown_jaxpr.effects):
        trace.effect_handles.append(pe.EffectHandle(unknown_tracers_in, eqn))
    return merge_lists(unknown_outs, known_out_vals, unknown_tracers_out)


pe.custom_partial_eval_rules[hlopass_call_p] = _partial_eval


def _params_updater(unks_in, inst_in, kept_outs_known, kept_outs_staged, num_res_out, num_res_in,
                    params_known, params_staged):
    return params_known, params_staged


pe.partial_eval_jaxpr_custom_rules[hlopass_call_p] = \
    lambda *a, **k: pe.closed_call_partial_eval_custom_rule("jaxpr", _params_updater, *a, **k)


@weakref_lru_cache
def _transpose_jaxpr(jaxpr, in_avals, in_tree):
    cell = lambda: None  # noqa: E731

    def transposed(*in_flat):
        primals_in, cts_in = tree_unflatten(in_tree, in_flat)
        out = ad.backward_pass(jaxpr.jaxpr, False, jaxpr.consts, primals_in, cts_in)
        out = [ct if not isinstance(ct, ad.Zero) else None for ct in out]
        cts_out, cell.out_tree = tree_flatten(out)
        return cts_out

    dbg = jaxpr.jaxpr.debug_info.with_unknown_names()
    trans_jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(lu.wrap_init(transposed, debug_info=dbg), in_avals)
    return core.ClosedJaxpr(trans_jaxpr, consts), cell.out_tree


def _transpose(cts_in, *primals_in, jaxpr, config, name):
    in_flat, in_tree = tree_flatten((primals_in, cts_in))
    in_avals = tuple(core.typeof(x) for x in in_flat)
    trans_jaxpr, out_tree = _transpose_jaxpr(jaxpr, in_avals, in_tree)
    cts_out = hlopass_call_p.bind(*in_flat, jaxpr=trans_jaxpr, config=config, name=f"transpose({name})")
    return tree_unflatten(out_tree, cts_out)


ad.primitive_transposes[hlopass_call_p] = _transpose


def _dce_rule(used_outputs, eqn):
    if not any(used_outputs) and not pe.has_effects(eqn):
        return [False] * len(eqn.invars), None
    dced_jaxpr, used_inputs = pe._cached_closed_call_dce(eqn.params["jaxpr"], tuple(used_outputs))
    new_params = dict(eqn.params, jaxpr=dced_jaxpr)
    new_invars = [v for v, used in zip(eqn.invars, used_inputs) if used]
    new_eqn = pe.new_jaxpr_eqn(new_invars, [v for v, used in zip(eqn.outvars, used_outputs) if used],
                               eqn.primitive, new_params, core.eqn_effects(dced_jaxpr, new_invars)
                               if hasattr(core, "eqn_effects") else dced_jaxpr.effects,
                               eqn.source_info, eqn.ctx)
    return used_inputs, new_eqn


pe.dce_rules[hlopass_call_p] = _dce_rule
