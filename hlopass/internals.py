"""The one door to JAX's internals.

Every name hlopass takes from ``jax._src``, ``jax.interpreters`` or ``jax.extend`` is imported
here and nowhere else (``tests/core/test_internals.py`` fails otherwise), so a JAX release that
moves or changes one is met in this file alone. The supported range is declared in
``pyproject.toml``; ``tools/jax_api/`` keeps a manifest of each supported version's API and
checks every name, call and attribute read in this file against each of them, in CI, with no
JAX of that version installed.

Where versions differ, the difference is found by a **feature check**, never a version number
(JAX changes its internals inside a minor series too):

- ``JAXPRS_CARRY_CONSTS``: a ``Jaxpr`` may carry its constants (``ClosedJaxpr`` became an alias
  of ``Jaxpr``), so the type of a sub-jaxpr no longer tells an open body from a closed one;
- :func:`flatten_tree`: ``FlatTree.flatten`` became the module function ``flattree.flatten``;
- :func:`lower_high_level_call`: the high-level (``to_lojax``) rule lost its mutable-constant
  conversion;
- :func:`linearize_jaxpr` and :func:`register_linearization`: linearisation gained structured
  residuals, and linearisation rules a fifth result.

Feature-checked names are read with :func:`_optional`, which the API check accepts when the name
exists in at least one supported version. Conventions the check relies on: JAX modules are
imported under a private alias (``from jax._src import core as _core``); what the rest of
hlopass uses is re-exported under a plain name or wrapped in a function here; attributes read on
JAX objects are listed in :data:`ATTRIBUTES_READ`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
from jax._src import api as _api
from jax._src import api_util as _api_util
from jax._src import config as _config
from jax._src import core as _core
from jax._src import effects as _effects
from jax._src import linear_util as _lu
from jax._src import mesh as _mesh
from jax._src import pjit as _pjit
from jax._src import source_info_util as _source_info_util
from jax._src import tree_util as _tree_util
from jax._src import util as _util
from jax._src.array import ArrayImpl
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import mlir as _mlir
from jax._src.interpreters import partial_eval as _pe
from jax._src.lax import lax as _lax
from jax._src.lib.mlir import ir
from jax._src.numpy import einsum as _einsum
from jax._src.export import _export as _export
from jax.extend.core import primitives as _primitives

try:  # newer JAX: flat trees have their own module
    from jax._src import flattree as _flattree
except ImportError:
    _flattree = None

__all__ = ["ArrayImpl", "ir"]  # the rest is listed by the groups below


def _optional(module, name: str):
    """``module.name``, or ``None`` where this JAX version has no such name (a feature check)."""
    return getattr(module, name, None)


# -- hlopass's own part of JAX's trace-cache keys ---------------------------------------------------

#: A JAX user context (``jax.make_user_context``: its value is part of the key of every trace cache,
#: ``jax.jit``'s and ``lax.scan`` bodies'), set by the ``hvp`` pass while it traces with its own rules
#: so that what it traces never reaches plain calls. Made here, when hlopass is imported: making one
#: changes every cache key, so a later one would have every function JAX had traced before (numpyro's
#: 62 jitted helpers, traced by ``initialize_model``) traced again at hlopass's first call.
TRACE_KEY = jax.make_user_context(default_value=None)


# -- jaxprs and their parts ----------------------------------------------------------------------

Jaxpr = _core.Jaxpr
ClosedJaxpr = _core.ClosedJaxpr
JaxprEqn = _core.JaxprEqn
Var = _core.Var
Literal = _core.Literal
DropVar = _core.DropVar
DebugInfo = _core.DebugInfo
Primitive = _core.Primitive
ShapedArray = _core.ShapedArray
AbstractToken = _core.AbstractToken
Tracer = _core.Tracer

typeof = _core.typeof
jaxpr_as_fun = _core.jaxpr_as_fun
eval_jaxpr = _core.eval_jaxpr
check_jaxpr = _core.check_jaxpr
positional_effects = _core.positional_effects
eqn_effects = _core.eqn_effects
filter_named_axis_effects = _core.filter_named_axis_effects
extend_axis_env_nd = _core.extend_axis_env_nd
trace_state_clean = _core.trace_state_clean
closed_call_p = _primitives.closed_call_p

#: Whether a ``Jaxpr`` carries its own constants (``ClosedJaxpr`` is then the same class).
JAXPRS_CARRY_CONSTS = ClosedJaxpr is Jaxpr

#: Equations whose ``jaxpr`` parameter is an open body, its constants passed as operands.
#: Where jaxprs carry constants, the type no longer says so and this table does.
OPEN_BODIES = frozenset({"remat2", "shard_map"})  # jax.checkpoint binds remat2


def is_closed_jaxpr(value) -> bool:
    """Whether ``value`` is a closed jaxpr (a body together with its constants)."""
    return isinstance(value, ClosedJaxpr)


def is_open_body(primitive_name: str, key: str, value) -> bool:
    """Whether ``value``, the parameter ``key`` of a ``primitive_name`` equation, is an open jaxpr:
    one that must stay without constants of its own."""
    if not isinstance(value, Jaxpr):
        return False
    if not JAXPRS_CARRY_CONSTS:
        return not isinstance(value, ClosedJaxpr)
    return key == "jaxpr" and primitive_name in OPEN_BODIES and not value.consts


def scan_num_consts(params: dict) -> int:
    """How many leading operands of a ``scan`` equation are constants (``num_consts``, or the first
    part of the flat tree ``ft_in`` where JAX describes the operands by one)."""
    if "num_consts" in params:
        return params["num_consts"]
    return len(params["ft_in"].unpack()[0])


def scan_num_carry(params: dict) -> int:
    """How many operands of a ``scan`` equation after its constants are carried (``num_carry``, or
    the second part of ``ft_in``)."""
    if "num_carry" in params:
        return params["num_carry"]
    return len(params["ft_in"].unpack()[1])


def closed(jaxpr, consts: Sequence[Any] = ()) -> ClosedJaxpr:
    """``jaxpr`` (open) closed over ``consts``."""
    return ClosedJaxpr(jaxpr, list(consts))


# -- tracing and rewriting ----------------------------------------------------------------------

wrap_init = _lu.wrap_init
tracing_debug_info = _api_util.debug_info
trace_to_jaxpr_dynamic = _pe.trace_to_jaxpr_dynamic
dce_jaxpr = _pe.dce_jaxpr
convert_constvars_jaxpr = _pe.convert_constvars_jaxpr
new_jaxpr_eqn = _pe.new_jaxpr_eqn
#: ``primitive -> rule(constants or None per operand, params, out_avals) -> values | None``: what tracing
#: folds when an operand is a constant (``convert_element_type`` of a literal)
const_fold_rules = _pe.const_fold_rules
is_literalable = _core.is_literalable
has_effects = _pe.has_effects
cached_call_dce = _pe._cached_closed_call_dce
partial_eval_jaxpr_nounits_fwd = _pe.partial_eval_jaxpr_nounits_fwd
closed_call_partial_eval_custom_rule = _pe.closed_call_partial_eval_custom_rule
new_eqn_recipe = _pe.new_eqn_recipe
JaxprTracer = _pe.JaxprTracer
PartialVal = _pe.PartialVal
EffectHandle = _pe.EffectHandle
partial_eval_kept_effects = _effects.partial_eval_kept_effects

jnp_einsum = _einsum._einsum


# -- rule tables of JAX's transformations -------------------------------------------------------

primitive_jvps = _ad.primitive_jvps
primitive_transposes = _ad.primitive_transposes
Zero = _ad.Zero
UndefinedPrimal = _ad.UndefinedPrimal
jvp_jaxpr = _ad.jvp_jaxpr
backward_pass = _ad.backward_pass
fancy_primitive_batchers = _batching.fancy_primitive_batchers
batch_jaxpr2 = _batching.batch_jaxpr2
custom_partial_eval_rules = _pe.custom_partial_eval_rules
partial_eval_jaxpr_custom_rules = _pe.partial_eval_jaxpr_custom_rules
dce_rules = _pe.dce_rules
register_lowering = _mlir.register_lowering
core_call_lowering = _mlir.core_call_lowering
lower_fun = _mlir.lower_fun
make_ir_context = _mlir.make_ir_context


def linearize_jaxpr(jaxpr: ClosedJaxpr, nonzeros: Sequence[bool], *, is_vjp: bool):
    """JAX's ``ad.linearize_jaxpr``, always in its first form:
    ``(primal_jaxpr, num_res_out, nzs_out, in_fwd_res, tangent_jaxpr)``.

    ``primal_jaxpr`` returns the primal outputs, then ``num_res_out`` residuals; ``in_fwd_res``
    names, for each residual the tangent program reads, the input it forwards (``None``: the
    next computed one); ``tangent_jaxpr`` takes the residuals, then the nonzero tangents. Where
    JAX also returns structured residuals, they are appended to the computed residuals and the
    tangent program's inputs are put in that order.
    """
    primal, res_info, nzs_out, in_fwd_res, tangent = _ad.linearize_jaxpr(jaxpr, nonzeros, is_vjp=is_vjp)
    if isinstance(res_info, int):
        return primal, res_info, nzs_out, in_fwd_res, tangent
    _, unstructured, structured = res_info.unpack()
    num_structured = len(structured)
    num_res_out = len(unstructured) + num_structured
    if num_structured:
        in_fwd_res = [*in_fwd_res, *([None] * num_structured)]
        invars = list(tangent.invars)
        num_plain = len(in_fwd_res) - num_structured
        num_tangents = len(invars) - len(in_fwd_res)
        tangent = tangent.replace(invars=[*invars[:num_plain], *invars[num_plain + num_tangents:],
                                          *invars[num_plain:num_plain + num_tangents]])
    return primal, num_res_out, nzs_out, list(in_fwd_res), tangent


@functools.lru_cache(maxsize=None)
def _rules_return_structured_residuals() -> bool:
    """Whether linearisation rules return structured residuals (a fifth result): probed on the
    linearisation of ``x * x``, whose residual information is then not a plain count."""
    probe = _pe.trace_to_jaxpr_dynamic(
        _lu.wrap_init(lambda x: [x * x], debug_info=_api_util.debug_info("probe", lambda x: x, (1.0,), {})),
        [ShapedArray((), _probe_dtype())])
    probe_jaxpr, _, consts = probe
    _, res_info, *_ = _ad.linearize_jaxpr(ClosedJaxpr(probe_jaxpr, consts), [True], is_vjp=True)
    return not isinstance(res_info, int)


def _probe_dtype():
    import numpy as np
    return np.dtype("float32")


def register_linearization(primitive, rule: Callable) -> None:
    """Register ``rule(is_vjp, nzs, *primals, **params) -> (primals_out, nzs_out, residuals,
    tangent_fun(residuals, *tangents))`` as ``primitive``'s linearisation, in the form this JAX
    version's linearisation calls."""
    def structured(is_vjp, nzs, *primals, **params):
        primals_out, nzs_out, residuals, tangent_fun = rule(is_vjp, nzs, *primals, **params)
        return primals_out, nzs_out, residuals, None, lambda res, _structured, *t: tangent_fun(res, *t)

    def dispatch(is_vjp, nzs, *primals, **params):
        if _rules_return_structured_residuals():
            return structured(is_vjp, nzs, *primals, **params)
        return rule(is_vjp, nzs, *primals, **params)

    _ad.primitive_linearizations[primitive] = dispatch


# -- high-level types (the remat3 checkpoint, hijax types) --------------------------------------

_convert_const_himutables = _optional(_pe, "convert_const_himutables")


def flatten_tree(tree):
    """JAX's ``FlatTree`` of ``tree`` (a module function in newer JAX, a class method before)."""
    if _flattree is not None:
        return _flattree.flatten(tree)
    return _optional(_tree_util, "FlatTree").flatten(tree)


def lower_high_level_call(jaxpr: ClosedJaxpr, hi_args: Sequence[Any],
                          bind: Callable[[list, ClosedJaxpr], list]) -> list:
    """Run ``jaxpr`` (which holds high-level types) on ``hi_args`` through its low-level form:
    ``bind(lo_args, lo_jaxpr)`` stages the low-level call. As ``jax.jit``'s ``to_lojax`` rule."""
    if _convert_const_himutables is not None:  # mutable constants become leading arguments
        jaxpr, closed_over = _convert_const_himutables(jaxpr)
        hi_args = [*closed_over, *hi_args]
        lo_args_lol = [aval.read_loval_in(x) if aval.has_qdd else aval.lower_val(x)
                       for aval, x in zip(jaxpr.in_aval_qdds, hi_args)]
    else:
        lo_args_lol = [aval.lower_val(x) for aval, x in zip(jaxpr.in_avals, hi_args)]
    in_avals = flatten_tree(([[typeof(x) for x in xs] for xs in lo_args_lol], {}))
    lo_jaxpr, out_avals = _pe.lower_jaxpr(jaxpr, in_avals)
    outs = out_avals.update(bind([x for xs in lo_args_lol for x in xs], lo_jaxpr))
    if _convert_const_himutables is not None:
        out_mut, outs = outs.unpack()
        for a, x, u in zip(jaxpr.final_aval_qdds, hi_args, out_mut.unpack()):
            if a.has_qdd:
                a.aval.update_from_loval2(a.qdd, x, u)
    return [a.raise_val2(y) for a, y in zip(jaxpr.out_avals, outs.unpack())]


# -- jax.jit's own machinery ------------------------------------------------------------------

api_module = _api  # whose ``vjp``/``jit`` the hvp pass and the peer tests route
jit_infer_params = _pjit._infer_params
disable_jit = _config.disable_jit
remat3 = _config.remat3
check_vma = _config._check_vma


def count_jit_and_pmap_lowerings():
    """JAX's test utility counting lowerings (imported when used: it is for tests)."""
    from jax._src import test_util as _test_util
    return _test_util.count_jit_and_pmap_lowerings()


# -- exported programs ----------------------------------------------------------------------------

#: The module whose ``_ensure_backends_initialized(platforms)`` JAX's lowering of a call of an exported
#: program runs first, loading the kernels the program may call (on CPU LAPACK's, which imports scipy:
#: 0.06 s, whatever the program); ``None`` where this JAX has no such function (nothing to skip).
export_backends = _export if callable(_optional(_export, "_ensure_backends_initialized")) else None


@functools.lru_cache(maxsize=None)
def lapack_kernel_names() -> tuple[bytes, ...]:
    """The custom-call targets of the CPU kernels that set-up loads (what a module names when it calls
    one: ``lapack_spotrf_ffi``...), and ``b"lapack"``, which names them all but one."""
    try:
        from jaxlib import lapack as _jaxlib_lapack
        names = tuple(name.encode() for name in _jaxlib_lapack._lapack.registrations())
    except Exception:  # noqa: BLE001 - a jaxlib without the table: the common part of the names
        names = ()
    return (b"lapack", *(n for n in names if b"lapack" not in n))


# -- meshes ---------------------------------------------------------------------------------------

AxisType = _mesh.AxisType
use_abstract_mesh = _mesh.use_abstract_mesh


# -- source lines -----------------------------------------------------------------------------

user_frame = _source_info_util.user_frame
user_context = _source_info_util.user_context
current_name_stack = _source_info_util.current_name_stack
current_source_info = _source_info_util.current
register_exclusion = _source_info_util.register_exclusion


# -- pytrees and list helpers ---------------------------------------------------------------------

tree_flatten = _tree_util.tree_flatten
tree_unflatten = _tree_util.tree_unflatten
merge_lists = _util.merge_lists
split_list = _util.split_list
subs_list = _util.subs_list
weakref_lru_cache = _util.weakref_lru_cache


# -- reductions -----------------------------------------------------------------------------------

_IDENTITIES = {
    "add": _lax._get_sum_identity, "mul": _lax._get_prod_identity,
    "max": _lax._get_max_identity, "min": _lax._get_min_identity,
    "and": _lax._get_bitwise_and_identity, "or": _lax._get_bitwise_or_identity,
    "xor": _lax._get_bitwise_or_identity,
}


def reduction_identity(monoid: str, dtype):
    """The identity element of ``monoid`` (``add``, ``mul``, ``max``, ``min``, ``and``, ``or``,
    ``xor``) for ``dtype``, as JAX's reductions use it."""
    return _IDENTITIES[monoid](dtype)


#: Attributes hlopass reads on JAX's objects, by class: checked against every supported version.
ATTRIBUTES_READ = {
    "jax._src.core.Jaxpr": ("constvars", "invars", "outvars", "eqns", "effects", "debug_info", "replace"),
    "jax._src.core.ClosedJaxpr": ("jaxpr", "consts", "in_avals", "out_avals", "effects"),
    "jax._src.core.JaxprEqn": ("invars", "outvars", "primitive", "params", "effects", "source_info", "ctx",
                               "replace"),
    "jax._src.core.Var": ("aval",),
    "jax._src.core.Literal": ("val", "aval"),
    "jax._src.core.Primitive": ("name", "multiple_results", "bind", "def_impl", "def_effectful_abstract_eval"),
    "jax._src.core.DebugInfo": ("with_unknown_names",),
    "jax._src.interpreters.partial_eval.JaxprTracer": ("pval", "recipe"),
    "jax._src.interpreters.partial_eval.PartialVal": ("is_known", "get_known", "unknown"),
}

#: Attributes read only where the feature check above finds them.
ATTRIBUTES_OPTIONAL = {
    "jax._src.core.ClosedJaxpr": ("in_aval_qdds", "final_aval_qdds"),
}
