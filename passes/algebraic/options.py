"""The algebraic pass's options (its own module: the pass class needs them, not the machinery)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ExpansionLimits:
    """How far an expansion may go before matching gives up (``AlgebraicPass(max_terms=...)``)."""

    #: The most monomials an expansion may hold.
    max_terms: int = 32
    #: The most equations one expansion may visit. Every rewrite the tests, the fuzzer's seeds and the
    #: benchmark programs make visits at most 60 (each rewrite's ``visits`` in the report;
    #: ``test_rewrites_stay_well_within_the_visit_budget``); roots that find nothing go on until the budget
    #: stops them (a gradient's chains of sums and products), as on the Transformer blocks of
    #: ``tools/bench_remat.py``, where 400 cost the pass 0.8 s and 128 costs it 0.18 s.
    max_visits: int = 128
