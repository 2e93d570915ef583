"""The split pass's options (:class:`SplitOptions`): rounds, retries and how steps are sized."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SplitOptions:
    """Tuning of the split pass (``SplitPass(max_rounds=4)``)."""

    #: Rewrite rounds per jaxpr level (each round splits non-overlapping regions).
    max_rounds: int = 16
    #: An even chunk (dividing the axis) is preferred when at least this fraction of the largest that fits:
    #: at most 1.5 times the iterations, and no remainder step to trace, split again and compile.
    even_chunk_fraction: float = 2 / 3
    #: Times the split is redone with half the sizes while XLA's footprint is over the memory limit.
    max_retries: int = 4
    #: Plannings one search for values to recompute (``recompute_where_it_helps``) may spend; past it the
    #: search keeps what it found and says so in the report. The split tests spend at most 8; a
    #: 2,090-equation gradient under a memory limit planned copies for over 30 minutes (fresh seed
    #: s443980463653, program 4; ``test_the_recompute_search_stops_at_its_budget``).
    max_recompute_plannings: int = 32
    #: ...and one that only looks for a copy that spares a nested loop (every region splits): in the
    #: split, remat and core tests such a search that keeps a copy keeps it by its 6th planning; on
    #: the forced Transformer step (``tools/bench_compile.py``) 15 plannings kept nothing (0.8 s).
    max_unnesting_plannings: int = 8
    #: A loop whose chunk does not divide its axis ends with a whole step moved back to end at the axis's
    #: end (overlapping the step before; the shared rows count once), where every loop recomputing the
    #: same product can (``plan.harmonise_tails``); else with a short step, which XLA compiles as a second
    #: copy of the loop body. ``False``: always the short step.
    overlap_last_step: bool = True
    #: One iteration's values live at once (estimated, fusion-aware) stay within this many split sizes.
    live_budget: float = 1.0
    #: Inside a step, reductions over a last axis this short are unrolled (0: never; see ``unroll.py``)...
    unroll_max_length: int = 16
    #: ...when their result has at least this many elements.
    unroll_min_elements: int = 1024
    #: On CPU, a step's live set is kept within this many bytes (half this machine's 32 MiB L3 cache)
    #: when the region is split anyway, even if the split size allows more: measured 1.2-1.7x faster
    #: on kNN L2 and the kernel mat-vec (README, chunk shapes). 0: the largest chunk that fits.
    step_cache_bytes: int = 16 * 2**20
    #: A step's ``top_k`` over a long row selects among group bests first, then among the chosen
    #: groups' elements: exact, and 4-12x faster than XLA:CPU's ``top_k`` in a kNN (``select.py``).
    grouped_top_k: bool = True
    #: On an accelerator (a GPU), where XLA fuses a step's elementwise work into its reductions, a
    #: step is sized by its largest value alone (not the estimated live set of every value) and a
    #: step's product with a thin operand (a vector, a few columns) is bound as a multiply and a sum,
    #: which XLA fuses with what computes the other operand: the slice is never stored. Measured on
    #: an H200 (README, *GPU*): a kernel mat-vec at 100 MB steps 0.0675 s as one thin dot per 10
    #: rows, 0.018 s written as a sum by hand over 250 rows, plain jax.jit 0.023 s.
    #: ``None``: on any backend but the CPU; ``True``/``False``: always/never.
    accelerator_steps: bool | None = None
    #: On an accelerator, a split loop runs up to this many steps per iteration (its ``fori_loop``
    #: unrolled), as many as keep what the steps store (XLA fuses their elementwise work into the
    #: reductions and thin products that read it) within the split size: each iteration costs a GPU
    #: a round trip to the host. Measured on an H100 (README, *GPU*): kernel mat-vec n = 10^5 at
    #: 100 MB 0.0247 s with 1, 0.0135 s with 4, 0.0120 s with 16 (plain jax.jit 0.0265 s); its
    #: gradient stores its steps' values, so 4 per iteration quadrupled its temp (0.21 -> 0.81 GB).
    accelerator_steps_per_iteration: int = 4
