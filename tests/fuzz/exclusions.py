"""Known-failing piece combinations the fuzzer does not draw, each tied to the regression test that
reproduces it in ``tests/fuzz/test_regressions.py`` (an ``xfail(strict=True)`` test).

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


NAN_SEEING_REDUCERS = ("reduce:max", "reduce:min", "reduce:logsumexp", "reduce:softmax_matvec")

EXCLUSIONS: list[Exclusion] = [
    # engine: custom_linear_solve cannot be re-emitted by split, matrix_chain, algebraic
    Exclusion("test_linalg_solve_passes_through", lambda p, mode: p.has("post:linalg_solve")),
    # split: strided slices inside or after a split region
    Exclusion("test_strided_slice_inside_a_split_region_before_sum", lambda p, mode: p.has("map:strided")),
    Exclusion("test_strided_slice_after_a_split_region", lambda p, mode: p.has("post:strided_slice")),
    Exclusion("test_strided_slice_of_an_input_of_a_split_region", lambda p, mode: p.has("input:strided_rows")),
    # split: NaN semantics of split max/min (logsumexp and softmax reduce a max first)
    Exclusion("test_split_max_and_min_follow_jax_jit_nan_semantics",
              lambda p, mode: bool(p.specials) and any(p.has(r) for r in NAN_SEEING_REDUCERS)),
    # algebraic: the expanded distance turns an infinite coordinate into NaN
    Exclusion("test_expanded_distance_keeps_infinity",
              lambda p, mode: "inf" in p.specials and p.has("expand:") and not p.has("expand:l1")),
    # algebraic: iota == iota on a non-square tensor
    Exclusion("test_iota_equality_mask_on_a_non_square_tensor", lambda p, mode: p.has("map:diag_mask")),
]


def excluded(program: Program, mode: str) -> str | None:
    """The regression test name of the first exclusion matching ``program`` in ``mode``, or None."""
    for exclusion in EXCLUSIONS:
        if exclusion.matches(program, mode):
            return exclusion.regression
    return None
