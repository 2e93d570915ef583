"""``hlopass_call``: a call primitive whose body goes through the pass pipeline when lowered, the
memory check of every compiled hlopass program, and the checked call that compiles it once per
signature.

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

**The memory check holds whatever the composition.** Every compiled hlopass program is checked
against the memory limit once per (program, settings):

- a call with concrete arguments (:class:`CheckedJit`: ``hlopass.jit`` functions, and the
  primitive's own implementation, which eager ``jax.grad`` / ``jax.vmap`` reach) compiles the
  program ahead of time and measures it whole: the compile ``jax.jit`` would make anyway;
- anywhere else (under an outer ``jax.jit``, inside another hlopass function, in an ahead-of-time
  ``lower()``), the lowering rule measures the program by compiling it alone, unless a crude upper
  bound on its bytes (:func:`~hlopass.memory.upper_bound`) is below half the limit, as
  it is for most programs: those pay no second compile.

**Never worse than plain.** When the passes changed a program but could not bound it (temporaries
remain above the threshold, a Cholesky factor say), XLA's figures for the rewritten and
the original program decide which one runs (:func:`decide`); the report says which was kept, both
footprints and compile times, and what blocked the bound.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import os
import time
import weakref
from typing import Callable, NamedTuple

import jax
from hlopass import internals as jx

from hlopass import sharding
from hlopass.families import CHEAP_TO_RECOMPUTE
from hlopass.jaxpr_utils import aval_nbytes, trace_flat
from hlopass.memory import MemoryCheck, enforce, footprint, measure, upper_bound
from hlopass.pipeline import PipelineResult, before_linearize, run_pipeline
from hlopass.report import Comparison

logger = logging.getLogger("hlopass")

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

class _WholeProgram:
    """Set by :meth:`CheckedJit.check` while it lowers a hlopass function's trace (one
    ``hlopass_call``, lowered first): that program is compiled and measured whole by the caller, so
    its lowering makes no check of its own and hands over its pipeline result."""

    __slots__ = ("result",)

    def __init__(self):
        self.result = None


_measured_by_caller: contextvars.ContextVar = contextvars.ContextVar("hlopass_measured_by_caller", default=None)


def _lowering(ctx, *args, jaxpr, config, name, notes):
    # the passes see how the jit arguments are sharded, and re-trace inside shard_map with its axes bound
    shardings = sharding.operand_shardings(ctx, args)
    with sharding.inputs_sharded(sharding.operand_shards(ctx, args), shardings), sharding.manual_context(ctx):
        result = run_pipeline(jaxpr, config, label=name, notes=notes)
    whole = _measured_by_caller.get()
    if whole is not None and whole.result is None:
        whole.result = result
    else:
        settle(result, name, shardings)
    return jx.core_call_lowering(ctx, *args, name=f"hlopass_{_safe(name)}", call_jaxpr=result.program)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name)[:60] or "call"


jx.register_lowering(hlopass_call_p, _lowering, cacheable=False)


def settle(result: PipelineResult, name: str, shardings: tuple | None = None) -> None:
    """Check a hlopass program compiled as part of another against the limit, once (compiled alone
    with its operands' ``shardings`` when known: one device's figures).

    A changed program that is not bounded is compiled both ways and the better kept
    (:func:`decide`). Otherwise it is compiled alone only when a crude bound on its bytes does
    not already show that it fits within half the limit. Warns, or raises
    :class:`~hlopass.MemoryLimitError` in strict mode, each time it is lowered.
    """
    if not result.settled:
        limit = result.config.memory_limit
        try:
            if result.needs_comparison:
                rewritten, rewritten_s = _compile_alone(result.jaxpr, result.config, name, shardings)
                original, original_s = _compile_alone(result.original, result.config, f"{name} (original)",
                                                      shardings)
                decide(result, rewritten, rewritten_s, original, original_s)
            elif limit is not None and 2 * upper_bound(result.program) > limit:
                result.check, _ = _compile_alone(result.program, result.config, name, shardings)
        except Exception as err:  # noqa: BLE001 - a diagnostic compile must not break the user's
            logger.warning("hlopass: could not compile %s alone to check its memory: %s: %s",
                           name, type(err).__name__, err)
        result.settled = True
    _enforce(result)


#: While set (:func:`inspecting`), lowering rules measure but neither warn nor raise.
_inspecting: contextvars.ContextVar = contextvars.ContextVar("hlopass_inspecting", default=False)


@contextlib.contextmanager
def inspecting():
    """Lower hlopass programs for inspection (``hlopass.explain``): checks are made and recorded in
    the reports, but the caller reports them; nothing warns or raises."""
    token = _inspecting.set(True)
    try:
        yield
    finally:
        _inspecting.reset(token)


def _enforce(result: PipelineResult) -> None:
    if result.check is None or _inspecting.get():
        return
    if result.config.strict:
        enforce(result.check, True)
    elif not result.warned:
        result.warned = True
        enforce(result.check, False)


def _compile_alone(closed: jx.ClosedJaxpr, config, label: str,
                   shardings: tuple | None = None) -> tuple[MemoryCheck, float]:
    """Compile ``closed`` on its own (its inputs placed with ``shardings`` where given); its memory
    figures and the seconds lowering and compiling took."""
    start = time.perf_counter()
    check = footprint(closed, shardings, limit=config.memory_limit, label=label)
    return check, time.perf_counter() - start


#: The rewritten program is kept only if XLA says it needs at most this fraction of the original's
#: memory (or it fits the limit and the original does not); otherwise the original, which is
#: bit-identical to jax.jit's and usually faster to compile, runs.
KEEP_REWRITTEN_BELOW = 0.95


def decide(result: PipelineResult, rewritten: MemoryCheck, rewritten_s: float | None,
           original: MemoryCheck, original_s: float | None) -> str:
    """Keep the rewritten or the original program of a changed, unbounded ``result``; record why."""
    limit = result.config.memory_limit
    fits_rewritten = limit is None or rewritten.footprint <= limit
    fits_original = limit is None or original.footprint <= limit
    if fits_rewritten != fits_original:
        kept = "rewritten" if fits_rewritten else "original"
    else:
        kept = "rewritten" if rewritten.footprint <= KEEP_REWRITTEN_BELOW * original.footprint else "original"
    result.kept = kept
    result.check = rewritten if kept == "rewritten" else original
    blocked, reasons = blocked_bound(result)
    result.report.comparison = Comparison(
        kept=kept, rewritten_bytes=rewritten.footprint, original_bytes=original.footprint,
        rewritten_compile_s=rewritten_s, original_compile_s=original_s, blocked=blocked, reasons=reasons)
    logger.info("hlopass: %s: kept the %s program (%s)", result.report.label, kept, result.report.comparison.line())
    return kept


def blocked_bound(result: PipelineResult, most: int = 6) -> tuple[list[str], list[str]]:
    """The values above the threshold left in the rewritten program, and what the passes said
    (their skips) at those source lines."""
    from hlopass.sizes import format_size
    skips = result.report.skipped
    values, reasons = [], []
    for type_, nbytes, where in result.unbounded:
        values.append(f"{format_size(nbytes)} {type_} {where}")
        _, _, location = where.partition(" at ")
        for s in skips:
            reason = f"{s.pass_name} at {s.location}: left {s.primitive} alone: {s.reason}"
            if s.location == location and reason not in reasons:
                reasons.append(reason)
    return values[:most], reasons[:most]


def _to_lojax(*hi_args, jaxpr, config, name, notes):
    # As jax.jit's rule: a program holding high-level types or primitives (the remat3 checkpoint,
    # hijax types) becomes a hlopass_call of its low-level form.
    def bind(lo_args, lo_jaxpr):
        return hlopass_call_p.bind(*lo_args, jaxpr=lo_jaxpr, config=config, name=name, notes=notes)
    return jx.lower_high_level_call(jaxpr, hi_args, bind)


hlopass_call_p.to_lojax = _to_lojax


# -- transformation rules ----------------------------------------------------------------------

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


# -- calling compiled hlopass programs -------------------------------------------------------

def leaf_signature(leaf):
    """What of an argument leaf decides a recompile: shape, dtype, weak type, sharding (or the Python type)."""
    if isinstance(leaf, jax.Array):
        return leaf.shape, leaf.dtype, getattr(leaf, "weak_type", False), getattr(leaf, "sharding", None)
    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    if shape is not None and dtype is not None:
        return tuple(shape), dtype
    return type(leaf)


_UNCOMPARABLE = object()


class _StaticArgumentError(Exception):
    """Tracing failed for a call with static arguments: let jax.jit's call raise its own error."""


#: jax.jit keywords that place or lay out data: calls with them always go through jax.jit itself.
_PLACEMENT_KEYWORDS = frozenset({"in_shardings", "out_shardings", "device", "backend", "compiler_options"})


class CheckedJit:
    """``jax.jit`` of ``staged`` whose first compile for each signature is checked against the limit.

    A call computes a cheap signature (tree structure, shapes, dtypes, static
    values; static arguments resolved as ``jax.jit`` resolves them). For a new
    one it lowers and compiles ahead of time (``lower().compile()``, which fills
    jax.jit's caches), measures the program whole, keeps the better of the
    rewritten and the original program when the passes could not bound it
    (``plain`` is jax.jit of the original), warns or raises, then calls
    through jax.jit's usual fast path. Calls inside a trace (tracer arguments,
    an outer ``jax.jit``, eager ``jax.grad`` / ``jax.vmap``) take jax.jit's
    cached trace of ``staged`` and bind its ``hlopass_call`` there, so that
    JAX transforms the primitive (and nothing is traced again); its
    lowering rule or its implementation then checks the derived programs.
    """

    def __init__(self, staged, jit_kwargs: dict, config, label: str, on_first_compile=None,
                 plain: Callable | None = None, result: PipelineResult | None = None):
        self.unjitted = staged
        self.jitted = jax.jit(staged, **jit_kwargs)
        self.plain = plain
        self.result = result
        self.config = config
        self.label = label
        self.on_first_compile = on_first_compile
        info = self.jitted._jit_info
        self.static_argnums = tuple(info.static_argnums)
        self.static_argnames = tuple(info.static_argnames)
        self._bind_directly = not (_PLACEMENT_KEYWORDS & set(jit_kwargs))
        self._entries: dict = {}

    @property
    def checks(self) -> list[MemoryCheck]:
        return [check for check, _ in self._entries.values()]

    def signature(self, args, kwargs):
        """The cache key of a call, or ``None`` when an argument is a tracer."""
        if not kwargs and not self.static_argnums and all(type(a) is jx.ArrayImpl for a in args):
            return tuple((a.shape, a.dtype, a.weak_type, a.sharding) for a in args)  # common case: no flattening
        static = ()
        if self.static_argnums or self.static_argnames:
            static = (tuple(args[i] for i in self.static_argnums if i < len(args)),
                      tuple((k, kwargs[k]) for k in self.static_argnames if k in kwargs))
            args = tuple(a for i, a in enumerate(args) if i not in self.static_argnums)
            kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        for leaf in leaves:
            if isinstance(leaf, jx.Tracer):
                return None
        return treedef, tuple(map(leaf_signature, leaves)), static

    def __call__(self, *args, **kwargs):
        key = self.signature(args, kwargs)
        if key is None:
            return self.in_trace(args, kwargs)
        try:
            entry = self._entries.get(key)
        except Exception:  # noqa: BLE001 - a static argument that cannot be hashed or compared
            entry = _UNCOMPARABLE
        if entry is _UNCOMPARABLE:  # jax.jit raises its own error for it
            return self.jitted(*args, **kwargs)
        if entry is None:
            if self.result is None and not jx.trace_state_clean():
                return self.in_trace(args, kwargs)  # concrete arguments, but staged into a trace
            try:
                entry = self.check(args, kwargs)
            except _StaticArgumentError:  # raise what jax.jit's call raises for them
                return self.jitted(*args, **kwargs)
            self._entries[key] = entry
        target = entry[1]
        if not kwargs:  # jax.jit's C++ fast path is only taken without a kwargs dict
            return target(*args)
        return target(*args, **kwargs)

    def in_trace(self, args, kwargs):
        """Bind the ``hlopass_call`` of jax.jit's cached trace in the current trace."""
        if not self._bind_directly:
            return self.jitted(*args, **kwargs)
        params, args_flat = jx.jit_infer_params(self.jitted._fun, self.jitted._jit_info, args, kwargs)
        closed = params.params["jaxpr"]
        return jx.tree_unflatten(params.out_tree, _bind_here(closed, args_flat))

    def check(self, args, kwargs) -> tuple[MemoryCheck, Callable]:
        """Lower and compile for these arguments, measure, keep the better program if the passes
        could not bound it, warn or raise if over the limit. Returns the check and what to call."""
        try:
            traced = self.jitted.trace(*args, **kwargs)
        except Exception as err:  # noqa: BLE001
            if self.static_argnums or self.static_argnames:
                # jax.jit's call (not its trace) says what is wrong with a static argument
                raise _StaticArgumentError() from err
            raise
        result = self.result
        target = self.jitted
        if result is not None and result.kept == "original" and self.plain is not None:
            check, _, lowered = self._compile(self.plain.trace(*args, **kwargs), "original")
            target = self.plain
        else:
            whole = _WholeProgram() if result is None else None
            token = _measured_by_caller.set(whole)
            try:
                check, seconds, lowered = self._compile(traced)
            finally:
                _measured_by_caller.reset(token)
            if whole is not None:
                result = whole.result
            if result is not None and not result.settled:
                if result.needs_comparison and self.plain is not None:
                    plain_check, plain_seconds, plain_lowered = self._compile(self.plain.trace(*args, **kwargs),
                                                                              "original")
                    if decide(result, check, seconds, plain_check, plain_seconds) == "original":
                        check, target, lowered = plain_check, self.plain, plain_lowered
                else:
                    result.check = check
                result.settled = True
        if self.on_first_compile is not None:
            self.on_first_compile(args, kwargs, lowered, None, check)
        enforce(check, self.config.strict)
        return check, target

    def _compile(self, traced, which: str = "") -> tuple[MemoryCheck, float, object]:
        start = time.perf_counter()
        lowered = traced.lower()
        compiled = lowered.compile()
        seconds = time.perf_counter() - start
        label = f"{self.label} ({which})" if which else self.label
        return measure(compiled, lowered, self.config.memory_limit, label, list_largest="over_limit"), seconds, lowered


_primitive_calls: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def checked_primitive_call(jaxpr: jx.ClosedJaxpr, config, name: str, notes: tuple = ()) -> CheckedJit:
    """A checked, compiled callable for a ``hlopass_call`` met outside any trace (eager AD, eager vmap).

    It compiles the pipeline's result itself (and ``jaxpr`` when the passes could not bound it), as
    functions that hold the programs weakly: the cache is keyed by ``jaxpr``.
    """
    per_config = _primitive_calls.setdefault(jaxpr, {})
    key = (config, notes)
    checked = per_config.get(key)
    if checked is None:
        result = run_pipeline(jaxpr, config, name, notes)
        plain = jax.jit(_evaluator(jaxpr, name)) if result.changed else None
        checked = per_config[key] = CheckedJit(_evaluator(result.jaxpr, name), {}, config, name, plain=plain,
                                               result=result)
    return checked


def _bind_here(closed: jx.ClosedJaxpr, args) -> list:
    """Evaluate ``closed`` in the current trace, each equation under the caller's source line (as
    jax.jit's own equation would be), not under the line recorded when it was traced."""
    env = dict(zip(closed.jaxpr.constvars, closed.consts))
    env.update(zip(closed.jaxpr.invars, args))

    def read(atom):
        return atom.val if isinstance(atom, jx.Literal) else env[atom]

    for eqn in closed.jaxpr.eqns:
        params = eqn.primitive.get_bind_params(eqn.params)
        outs = eqn.primitive.bind(*map(read, eqn.invars), **params)
        env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]))
    return [read(v) for v in closed.jaxpr.outvars]


def _evaluator(closed: jx.ClosedJaxpr, name: str) -> Callable:
    """``jaxpr_as_fun(closed)`` holding ``closed`` weakly (as ``jx._get_jaxpr_as_fun`` does)."""
    ref = weakref.ref(closed)

    def evaluate(*args):
        program = ref()
        return jx.eval_jaxpr(program.jaxpr, program.consts, *args)

    evaluate.__name__ = evaluate.__qualname__ = f"hlopass_{_safe(name)}"
    return evaluate


# hlopass's own frames are JAX-internal: source lines in reports, jaxprs and StableHLO name the user's
# (the registry does the same for the passes' folder when it loads them).
jx.register_exclusion(os.path.dirname(os.path.abspath(__file__)) + os.sep)
