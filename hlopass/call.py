"""``hlopass_call``: a call primitive whose body goes through the pass pipeline when lowered,
and the checked call that compiles it once per signature against the memory limit.

``hlopass.jit`` stages the user's function as one ``hlopass_call`` equation
holding the *original* jaxpr. JAX transforms it like any call: the JVP rule
makes a ``hlopass_call`` of the JVP jaxpr, linearisation and partial
evaluation split it into ``hlopass_call`` s of the primal and tangent parts,
transposition makes a ``hlopass_call`` of the backward jaxpr, and vmap one of
the batched jaxpr. Only the lowering rule runs the passes, so the forward
program, its derivatives (the backward pass included) and its batched forms
are all rewritten. The rules follow ``jax._src.compute_on``.

Its parameters: ``jaxpr`` (the program, before any pass), ``config``,
``name`` (for reports) and ``notes`` (what the passes' extension points
found while tracing or before linearising it; they go to its report).

:class:`CheckedJit` is how compiled hlopass programs are called: one
ahead-of-time compile and memory check per input signature, then
``jax.jit``'s fast path.
"""

from __future__ import annotations

import weakref

import jax
from jax._src import core, source_info_util
from jax._src.array import ArrayImpl
from jax._src import effects as effects_lib
from jax._src.interpreters import ad, batching, mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.tree_util import tree_flatten, tree_unflatten
from jax._src.util import merge_lists, split_list, subs_list, weakref_lru_cache
from jax._src import linear_util as lu

from hlopass.jaxpr_utils import aval_nbytes, trace_flat
from hlopass.memory import MemoryCheck, enforce, measure
from hlopass.pipeline import before_linearize, run_pipeline

hlopass_call_p = core.Primitive("hlopass_call")
hlopass_call_p.multiple_results = True


def bind(args, *, jaxpr: core.ClosedJaxpr, config, name: str, notes: tuple = ()):
    """Stage (or run) ``jaxpr`` on ``args`` as a ``hlopass_call``."""
    return hlopass_call_p.bind(*args, jaxpr=jaxpr, config=config, name=name, notes=tuple(notes))


def _impl(*args, jaxpr, config, name, notes):
    return checked_primitive_call(jaxpr, config, name, notes)(*args)


hlopass_call_p.def_impl(_impl)


def _abstract_eval(*in_avals, jaxpr, config, name, notes):
    return jaxpr.out_avals, core.positional_effects(jaxpr) if hasattr(core, "positional_effects") else jaxpr.effects


hlopass_call_p.def_effectful_abstract_eval(_abstract_eval)


def _lowering(ctx, *args, jaxpr, config, name, notes):
    rewritten = run_pipeline(jaxpr, config, label=name, notes=notes).jaxpr
    return mlir.core_call_lowering(ctx, *args, name=f"hlopass_{_safe(name)}", call_jaxpr=rewritten)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name)[:60] or "call"


mlir.register_lowering(hlopass_call_p, _lowering, cacheable=False)


def _batcher(axis_data, vals_in, dims_in, *, jaxpr, config, name, notes):
    batched_jaxpr, dims_out = batching.batch_jaxpr2(jaxpr, axis_data, dims_in)
    outs = hlopass_call_p.bind(*vals_in, jaxpr=batched_jaxpr, config=config, name=f"vmap({name})", notes=notes)
    return outs, dims_out


batching.fancy_primitive_batchers[hlopass_call_p] = _batcher


def _jvp(primals, tangents, *, jaxpr, config, name, notes):
    nzs = [not isinstance(t, ad.Zero) for t in tangents]
    jaxpr_jvp, out_nzs = ad.jvp_jaxpr(jaxpr, nzs, False)
    nz_tangents = [t for t in tangents if not isinstance(t, ad.Zero)]
    outs = hlopass_call_p.bind(*primals, *nz_tangents, jaxpr=jaxpr_jvp, config=config, name=f"jvp({name})",
                               notes=notes)
    primals_out, nz_tangents_out = outs[:len(out_nzs)], outs[len(out_nzs):]
    nz_outs = iter(nz_tangents_out)
    tangents_out = [next(nz_outs) if nz else ad.Zero(aval.to_tangent_aval())
                    for aval, nz in zip(jaxpr.out_avals, out_nzs)]
    return primals_out, tangents_out


ad.primitive_jvps[hlopass_call_p] = _jvp


def _linearize(is_vjp, nzs, *primals, jaxpr, config, name, notes):
    if is_vjp:  # the hooks may emit custom_vjp functions, which forward mode (jax.linearize) cannot run
        jaxpr, hook_notes = before_linearize(jaxpr, config)
        notes = (*notes, *hook_notes)
    jaxpr, primal_jaxpr, num_res_out, nzs_out, in_fwd_res, tangent_jaxpr = primal_tangent_split(
        jaxpr, nzs, is_vjp, config)
    tangent_avals_out = [a.to_tangent_aval() for a in jaxpr.out_avals]

    def tangent_fun(residuals, *tangents):
        tangents_nz = [t for nz, t in zip(nzs, tangents) if nz]
        nz_outs = hlopass_call_p.bind(*residuals, *tangents_nz, jaxpr=tangent_jaxpr, config=config,
                                      name=f"lin({name})", notes=())
        nz_outs_ = iter(nz_outs)
        return [next(nz_outs_) if nz else ad.Zero(a) for nz, a in zip(nzs_out, tangent_avals_out)]

    ans = hlopass_call_p.bind(*primals, jaxpr=primal_jaxpr, config=config, name=name, notes=notes)
    primal_ans, residuals_ans = split_list(ans, [len(ans) - num_res_out])
    residuals_ans = subs_list(in_fwd_res, [*jaxpr.consts, *primals], residuals_ans)
    return primal_ans, nzs_out, residuals_ans, tangent_fun


ad.primitive_linearizations[hlopass_call_p] = _linearize


def primal_tangent_split(jaxpr, nzs, is_vjp, config):
    """``(jaxpr used, *ad.linearize_jaxpr(...))``.

    When JAX's own linearisation would save a residual larger than the
    threshold for the backward pass (the n x m x d difference of a naive
    distance, say), ``jaxpr`` is linearised under ``jax.checkpoint`` instead:
    only the inputs are saved and the backward ``hlopass_call`` recomputes
    the forward values it needs, so the passes can split that recomputation.
    """
    split = ad.linearize_jaxpr(jaxpr, nzs, is_vjp=is_vjp)
    primal_jaxpr, num_res_out = split[0], split[1]
    residual_avals = primal_jaxpr.out_avals[len(primal_jaxpr.out_avals) - num_res_out:]
    if config.threshold is not None and any(aval_nbytes(a) > config.threshold for a in residual_avals):
        jaxpr = rematerialized(jaxpr)
        split = ad.linearize_jaxpr(jaxpr, nzs, is_vjp=is_vjp)
    return (jaxpr, *split)


def rematerialized(jaxpr: core.ClosedJaxpr) -> core.ClosedJaxpr:
    """``jaxpr`` wrapped in ``jax.checkpoint`` with nothing saveable (same signature)."""
    body = jax.checkpoint(core.jaxpr_as_fun(jaxpr), policy=jax.checkpoint_policies.nothing_saveable,
                          prevent_cse=False)
    return trace_flat(lambda *args: body(*args), jaxpr.in_avals, "remat")


def _partial_eval(trace, *in_tracers, jaxpr, config, name, notes):
    in_pvals = [t.pval for t in in_tracers]
    unknown_ins = tuple(not pv.is_known() for pv in in_pvals)
    known_jaxpr, unknown_jaxpr, unknown_outs, res_out_avals, in_fwd_res = \
        pe.partial_eval_jaxpr_nounits_fwd(jaxpr, unknown_ins, instantiate=False)
    known_inputs = [pv.get_known() for pv in in_pvals if pv.is_known()]
    all_known_outs = hlopass_call_p.bind(*known_inputs, jaxpr=known_jaxpr, config=config, name=name, notes=notes)
    known_out_vals, residual_vals = split_list(all_known_outs, [len(all_known_outs) - len(res_out_avals)])
    residual_vals_ = iter(residual_vals)
    residual_vals = [next(residual_vals_) if f is None else [*jaxpr.consts, *known_inputs][f] for f in in_fwd_res]
    residual_tracers = [trace.new_instantiated_const(r) for r in residual_vals]
    unknown_params = dict(jaxpr=unknown_jaxpr, config=config, name=f"staged({name})", notes=())
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


def _transpose(cts_in, *primals_in, jaxpr, config, name, notes):
    in_flat, in_tree = tree_flatten((primals_in, cts_in))
    in_avals = tuple(core.typeof(x) for x in in_flat)
    trans_jaxpr, out_tree = _transpose_jaxpr(jaxpr, in_avals, in_tree)
    cts_out = hlopass_call_p.bind(*in_flat, jaxpr=trans_jaxpr, config=config, name=f"transpose({name})", notes=())
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


# -- calling compiled hlopass programs -------------------------------------------------------

def leaf_signature(leaf):
    """What of an argument leaf decides a recompile: shape, dtype, weak type (or the Python type)."""
    if isinstance(leaf, jax.Array):
        return leaf.shape, leaf.dtype, getattr(leaf, "weak_type", False)
    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    if shape is not None and dtype is not None:
        return tuple(shape), dtype
    return type(leaf)


def _as_tuple(value) -> tuple:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


class CheckedJit:
    """``jax.jit`` of ``staged`` whose first compile for each signature is checked against the limit.

    A call computes a cheap signature (tree structure, shapes, dtypes, static
    values). For a new one it lowers and compiles ahead of time
    (``lower().compile()``, which fills jax.jit's caches), checks the memory
    figures, then calls through jax.jit's usual fast path. (Interrupting
    jax.jit's own trace instead would be cheaper, but jax.jit never takes its
    C++ fast path for a signature whose first trace raised.) Calls under a
    transformation (tracer arguments) call ``staged`` directly so that the
    ``hlopass_call`` it binds meets the transformation: under eager
    ``jax.grad`` its primal and backward parts then run through the checked
    primitive implementation.
    """

    def __init__(self, staged, jit_kwargs: dict, config, label: str, on_first_compile=None):
        self.unjitted = staged
        self.jitted = jax.jit(staged, **jit_kwargs)
        self.config = config
        self.label = label
        self.on_first_compile = on_first_compile
        self.static_argnums = _as_tuple(jit_kwargs.get("static_argnums"))
        self.static_argnames = _as_tuple(jit_kwargs.get("static_argnames"))
        self.checked: dict = {}

    @property
    def checks(self) -> list[MemoryCheck]:
        return list(self.checked.values())

    def signature(self, args, kwargs):
        """The cache key of a call, or ``None`` when an argument is a tracer."""
        if not kwargs and not self.static_argnums and all(type(a) is ArrayImpl for a in args):
            return tuple((a.shape, a.dtype, a.weak_type) for a in args)  # the common case, without flattening
        static = ()
        if self.static_argnums or self.static_argnames:
            static = (tuple(args[i] for i in self.static_argnums if i < len(args)),
                      tuple((k, kwargs[k]) for k in self.static_argnames if k in kwargs))
            args = tuple(a for i, a in enumerate(args) if i not in self.static_argnums)
            kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        for leaf in leaves:
            if isinstance(leaf, core.Tracer):
                return None
        return treedef, tuple(map(leaf_signature, leaves)), static

    def __call__(self, *args, **kwargs):
        key = self.signature(args, kwargs)
        if key is None:
            return self.unjitted(*args, **kwargs)
        try:
            known = key in self.checked
        except TypeError:  # an unhashable static argument: jax.jit will say so
            return self.jitted(*args, **kwargs)
        if not known:
            self.checked[key] = self.check(*args, **kwargs)
        if not kwargs:  # jax.jit's C++ fast path is only taken without a kwargs dict
            return self.jitted(*args)
        return self.jitted(*args, **kwargs)

    def check(self, *args, **kwargs) -> MemoryCheck:
        """Lower and compile for these arguments, measure, warn or raise if over the limit."""
        lowered = self.jitted.lower(*args, **kwargs)
        compiled = lowered.compile()
        check = measure(compiled, lowered, self.config.memory_limit, self.label)
        if self.on_first_compile is not None:
            self.on_first_compile(args, kwargs, lowered, compiled, check)
        enforce(check, self.config.strict)
        return check


_primitive_calls: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def checked_primitive_call(jaxpr: core.ClosedJaxpr, config, name: str, notes: tuple = ()) -> CheckedJit:
    """A checked, compiled callable for a ``hlopass_call`` met outside any trace (eager AD, eager vmap)."""
    per_config = _primitive_calls.setdefault(jaxpr, {})
    key = (config, notes)
    if key not in per_config:
        def call(*args):
            return hlopass_call_p.bind(*args, jaxpr=jaxpr, config=config, name=name, notes=notes)
        per_config[key] = CheckedJit(call, {}, config, name)
    return per_config[key]
