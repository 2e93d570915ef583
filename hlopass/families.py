"""The vocabulary of primitives: families every pass and tool names the same way.

One table per family, keyed by primitive name, the way JAX keeps its rule
tables (``defvectorized``, ``dce_rules``). A pass that needs "every
elementwise primitive" or "the monoid of this reduction" reads it here, so
the split rules, the algebraic patterns, the drawings and the inliner cannot
drift apart. Per-pass knowledge (how an axis runs through a primitive, how a
polynomial expands) stays in the pass's own tables; a pass's set that is a family
with a few differences is written as the family plus or minus them, named.

Every name is a primitive of at least one supported JAX version (its manifest in
``tools/jax_api/manifests``), or hlopass's own: ``tests/core/test_vocabulary.py``
checks these tables and the passes' per-primitive tables. ``jnp.expand_dims`` is a
``broadcast_in_dim``, ``jax.checkpoint`` binds ``remat2``, ``jax.jit`` binds ``jit``.
"""

from __future__ import annotations

#: Primitives applied element by element (numpy broadcasting of size-1 axes and scalars).
ELEMENTWISE = frozenset("""
    abs acos acosh add add_any and asin asinh atan atan2 atanh bessel_i0e bessel_i1e cbrt ceil clamp clz conj
    convert_element_type copy cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt
    igamma igammac imag integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter
    not optimization_barrier or polygamma population_count pow real reduce_precision rem round rsqrt
    select_n shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square stop_gradient
    sub tan tanh xor zeta
""".split())

#: Reductions over ``axes`` and the monoid that combines partial results.
REDUCTIONS: dict[str, str] = {
    "reduce_sum": "add", "reduce_max": "max", "reduce_min": "min", "reduce_prod": "mul",
    "reduce_and": "and", "reduce_or": "or", "reduce_xor": "xor",
}

#: Reductions to an index; each names its own monoid (value and first index).
ARG_REDUCTIONS = frozenset({"argmax", "argmin"})

#: Cumulative operations along ``axis`` and the operation they accumulate with.
CUMULATIVE: dict[str, str] = {
    "cumsum": "add", "cumprod": "mul", "cummax": "max", "cummin": "min", "cumlogsumexp": "logaddexp",
}

#: Layout primitives: the operand's elements, moved, repeated or retyped, none computed (a new shape,
#: an axis order, broadcast copies, another dtype, a copy). What a walk looks through when it follows a
#: value rather than a computation; each user names what it adds or leaves out.
LAYOUT = frozenset({"reshape", "squeeze", "transpose", "broadcast_in_dim", "convert_element_type", "copy"})

#: What a chain of products is made of (the matrix-chain pass reorders such chains; the algebraic
#: pass leaves a plain sum of one to it): contractions, sums, a ``mul`` by a scalar and the layout
#: primitives but ``copy``.
CHAIN = (LAYOUT - {"copy"}) | {"dot_general", "reduce_sum", "mul"}

#: Plain calls of a sub-jaxpr: inlining one changes nothing. (JAX 0.10's ``call``, whose body is an open
#: jaxpr under ``call_jaxpr``, is left as it is: ``jaxpr_utils.call_body`` does not read such a body.)
CALLS = frozenset({"jit", "closed_call", "eval_jaxpr"})

#: Rematerialisation boundaries (``jax.checkpoint``): a call whose body JAX recomputes for the
#: backward pass. Once JAX has split a program into forward and backward calls it is a plain call.
REMAT = frozenset({"remat2"})

#: Calls with custom differentiation rules; their body is the primal computation.
CUSTOM_DERIVATIVE_CALLS = frozenset({"custom_jvp_call", "custom_vjp_call"})

#: Loops; their bodies run many times.
LOOPS = frozenset({"while", "scan"})

#: Control flow with sub-jaxprs.
CONTROL_FLOW = LOOPS | {"cond"}

#: Primitives that move a value between shardings and leave its value as it is.
RESHARDS = frozenset({"reshard", "sharding_constraint"})

#: Calls of another hlopass program (a ``hlopass.jit`` function called inside this one): its own
#: program with its own settings and pipeline. Passes and walkers do not enter it.
OWN_PROGRAMS = frozenset({"hlopass_call"})

#: What a rematerialised gradient recomputes instead of saving: cheap per element of the result,
#: and what the split pass can bound. Anything else (factorisations, solves, sorts, FFTs, loops,
#: custom calls) is saved as JAX would save it.
CHEAP_TO_RECOMPUTE = ELEMENTWISE | frozenset(REDUCTIONS) | ARG_REDUCTIONS | frozenset(CUMULATIVE) | LAYOUT | frozenset(
    "iota concatenate pad slice dynamic_slice rev select_n reduce_precision square".split())

#: Every primitive whose equation simply runs one sub-jaxpr on its operands.
INLINABLE = CALLS | REMAT | CUSTOM_DERIVATIVE_CALLS

#: Element-wise monoids: ``combine(monoid, a, b)`` is one elementwise op.
ELEMENTWISE_MONOIDS = ("add", "mul", "max", "min", "and", "or", "xor")


def dot_general_labels(dimension_numbers, lhs_rank: int, rhs_rank: int):
    """Label every axis of a ``dot_general`` like an einsum.

    Returns ``(lhs, rhs, out)``: lists of labels ``("batch", k)``,
    ``("contract", k)``, ``("lhs", d)`` (free axis ``d`` of the left operand)
    and ``("rhs", d)``; the result's axes are the batch axes, then the left's
    free axes, then the right's, as ``lax.dot_general`` orders them.
    """
    (lc, rc), (lb, rb) = dimension_numbers
    lhs: list = [None] * lhs_rank
    rhs: list = [None] * rhs_rank
    for k, (left, right) in enumerate(zip(lb, rb)):
        lhs[left] = rhs[right] = ("batch", k)
    for k, (left, right) in enumerate(zip(lc, rc)):
        lhs[left] = rhs[right] = ("contract", k)
    for d in range(lhs_rank):
        if lhs[d] is None:
            lhs[d] = ("lhs", d)
    for d in range(rhs_rank):
        if rhs[d] is None:
            rhs[d] = ("rhs", d)
    out = ([("batch", k) for k in range(len(lb))] + [label for label in lhs if label[0] == "lhs"]
           + [label for label in rhs if label[0] == "rhs"])
    return lhs, rhs, out


def dot_general_operand_labels(dimension_numbers, lhs_shape, rhs_shape, out_labels, fresh):
    """The operands' labels of a ``dot_general`` whose result axes carry ``out_labels``.

    Contracted axes get new labels from ``fresh(size)``. Returns
    ``(lhs_labels, rhs_labels, contracted_labels)``.
    """
    lhs, rhs, out = dot_general_labels(dimension_numbers, len(lhs_shape), len(rhs_shape))
    names = dict(zip(out, out_labels))
    for label, size in zip(lhs, lhs_shape):
        if label[0] == "contract":
            names[label] = fresh(int(size))
    contracted = [names[label] for label in lhs if label[0] == "contract"]
    return [names[label] for label in lhs], [names[label] for label in rhs], contracted
