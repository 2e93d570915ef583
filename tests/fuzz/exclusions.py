"""Known-failing piece combinations the fuzzer does not draw, each tied to the regression test that
reproduces it in ``tests/fuzz/test_regressions.py`` (an ``xfail(strict=True)`` test), or to a
documented deviation from this backend's ``jax.jit`` (its test asserts the documented rule).

When a fix lands, its regression test starts passing, its xfail marker is removed, and
``test_fuzz.py::test_every_exclusion_names_a_failing_regression_test`` then asks for the exclusion
here to be deleted too: one line each.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from tests.fuzz.programs import Program


@dataclasses.dataclass(frozen=True)
class Exclusion:
    regression: str                          # test function in tests/fuzz/test_regressions.py
    matches: Callable[[Program, str], bool]  # (program, batch mode) -> excluded?
    #: Non-empty for a deliberate, documented difference from this backend's ``jax.jit`` (the README
    #: section that says so); its regression test then asserts the documented rule and passes.
    deviation: str = ""


NAN_SEEING_REDUCERS = ("reduce:max", "reduce:min", "reduce:argmax", "reduce:logsumexp", "reduce:softmax_matvec",
                       "reduce:top_k", "post:top_k", "map:clip", "map:relu")

#: Pieces that take a logsumexp of their operand.
LOGSUMEXPS = ("reduce:logsumexp", "frontier:contrastive_lse", "frontier:lse_minus_diag", "frontier:masked_lse",
              "frontier:ott_logsumexp", "frontier:custom_vjp_logsumexp")

EXCLUSIONS: list[Exclusion] = [
    # split: max/min/clip propagate NaN and top_k ranks it first, as JAX documents; XLA:CPU's fused large
    # kernels sometimes skip it (a NaN made inside the program from Inf·0 too, so any special input)
    Exclusion("test_split_max_and_min_propagate_nan",
              lambda p, mode: bool(p.specials) and any(p.has(r) for r in NAN_SEEING_REDUCERS),
              deviation="README, The split pass, NaN"),
    # split: XLA:CPU's tanh is not correctly rounded and its last bit depends on the fusion it lands in, so
    # an argmax over saturated values on grid points can pick another near-tied index (as a hand loop does)
    Exclusion("test_split_tanh_argmax_follows_xla_tanh",
              lambda p, mode: p.grid and p.has("expand:sqdist") and p.has("reduce:argmax"),
              deviation="README, The split pass, Transcendental rounding"),
    # split: XLA:CPU contracts v*v*v - max into one fused multiply-add inside a loop body, so a softmax of a
    # cube whose logits' float32 step is large gets a weight off by exp(that step) (not on the grid: exact)
    Exclusion("test_split_softmax_of_a_cube_follows_xla_fma_contraction",
              lambda p, mode: not p.grid and p.has("map:cube") and p.has("reduce:softmax_matvec"),
              deviation="README, The split pass, Fused multiply-add"),
    # split: a logsumexp of a cube off the grid (logits to 417,000, step 0.03): the split recomputes the cube
    # in a second loop and rounds as the same two loops written by hand (r310525650708)
    # (also the logsumexps the frontier pieces take: a contrastive loss's, s779259237893, logits to 2.2e5)
    Exclusion("test_split_logsumexp_of_a_cube_rounds_as_chunked_by_hand",
              lambda p, mode: not p.grid and p.has("map:cube") and any(p.has(r) for r in LOGSUMEXPS),
              deviation="README, The split pass, Fused multiply-add"),
    # split: the same with a square, whose logits reach the tens of thousands: a chunk of rows rounds
    # otherwise than the whole in XLA:CPU's kernels and fusions, by hand as in hlopass (r73655148886)
    Exclusion("test_split_softmax_of_squared_logits_rounds_as_chunked_by_hand",
              lambda p, mode: not p.grid and p.has("map:square") and p.has("reduce:softmax_matvec"),
              deviation="README, The split pass, Fused multiply-add"),
    # split: on the grid, columns holding the same values in another order tie exactly; a cumulative
    # logsumexp or product carried across chunks rounds them in another order than jax.jit's, so top_k or
    # argmax can rank the tied columns otherwise (every differing index an exact tie; s676920774220)
    Exclusion("test_top_k_after_a_split_cumulative_logsumexp_differs_only_at_exact_ties",
              lambda p, mode: p.grid and any(p.has(c) for c in ("frontier:cumlogsumexp_long", "frontier:cumprod_long"))
              and any(p.has(r) for r in ("reduce:top_k", "post:top_k", "reduce:argmax")),
              deviation="docs/passes/split.md, Ties"),
    # split: a 16-bit cumulative sum carried by the split is the exact sum rounded once, jax.jit's
    # reduce_window rounds as it goes; a softmax downstream weighs a last-bit difference by exp(spacing),
    # a selection picks the other of two near-tied entries (s616536329601, s172236491516, s732137007931)
    Exclusion("test_a_16_bit_prefix_sum_rounded_once_moves_a_near_tie_as_plain_jax_does",
              lambda p, mode: p.dtype in ("bfloat16", "float16")
              and any(p.has(c) for c in ("frontier:cumsum_long", "post:cumsum"))
              and any(p.has(r) for r in ("post:softmax", "reduce:softmax_matvec", "frontier:softmax_minus_col",
                                         "reduce:argmax", "reduce:top_k", "post:top_k", "post:sort")),
              deviation="docs/testing.md, The soak round by round"),
    # algebraic: on the grid, the cotangent of expanded distances reaches them only where a .at[idx].min
    # (or .max) ties with the zero it starts from, at x_i == y_j: the written gradient sums exact zeros, the
    # expanded one rounds, and jax.jit's gradient is all zeros (s664863178853, s758966966329)
    Exclusion("test_an_expanded_gradient_through_a_tie_rounds_where_the_written_one_is_zero",
              lambda p, mode: p.grid and (mode.startswith("grad") or mode == "sharded_grad" or p.has("wrap:grad"))
              and p.has("expand:sqdist") and p.has("frontier:scatter_reduce")
              and any(op in p.description for op in (".min(", ".max(")),
              deviation="docs/passes/algebraic.md, A gradient through a tie at equal points"),
    # algebraic: XLA:CPU keeps a float16 product unrounded inside the fusion of exp(v*v - max) while the
    # max holds it rounded, so a row whose max rounds down overflows to NaN; the expanded distances differ
    # from jax.jit's in the last bit, so other rows than jax.jit's own do (s169357533700)
    Exclusion("test_float16_softmax_of_squared_logits_overflows_in_xla_fusions",
              lambda p, mode: p.dtype == "float16" and p.has("map:square") and any(
                  p.has(s) for s in ("reduce:softmax_matvec", "frontier:softmax_minus_col", "post:softmax")),
              deviation="docs/passes/algebraic.md, float16"),
]


def excluded(program: Program, mode: str) -> str | None:
    """The regression test name of the first exclusion matching ``program`` in ``mode``, or None."""
    for exclusion in EXCLUSIONS:
        if exclusion.matches(program, mode):
            return exclusion.regression
    return None
