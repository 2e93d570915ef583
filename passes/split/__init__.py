"""The size-threshold splitting pass (eXLA's tensor splitter, on jaxprs).

Matches: a size-reducing equation (``dot_general``, ``reduce_sum``/``max``/
``min``/``prod``/``and``/``or``/``xor``, ``argmax``/``argmin``, ``top_k``, a
cumulative op along another axis, ``triangular_solve``, ``gather``, a
scatter, a slice) with an operand larger than ``config.threshold``, together
with the region that computes that operand from small inputs through the
primitives of :data:`.rules.AXIS_RULES` (elementwise ops, broadcasts,
``iota``, transposes, axis-keeping reshapes, contractions, reductions over
other axes, triangular solves, gathers and scatters, dynamic slices, sorts
along another axis...). Several reducers reading one large value join one
region. At every program level, calls holding a large value (``pjit``,
``closed_call``, ``checkpoint``, ``custom_jvp``/``custom_vjp``) are inlined
first, and the bodies of loops, branches and linear solves are split on
their own (innermost first). A large value read both before and after its
own reduction is recomputed once per pass its readers need
(:mod:`.recompute`), one loop per pass: a softmax's rows reduced and read
again split along the rows are one pass, its gradient's backward pass another.

Emits: one ``fori_loop`` per region over slices of a split axis (when the
chunk does not divide it, a last whole step overlapping the one before, or a
shorter remainder step where a step depends on the ones before), each iteration
recomputing the region on ``dynamic_slice`` s of its inputs and writing
(``dynamic_update_slice``) or combining (sum, product, max, min, and, or,
xor, first-index argmax/argmin, running top-k, a scatter's running result)
its results. The chunk keeps the largest value of one iteration within
``config.split_size``, and on CPU within ``step_cache_bytes`` (16 MiB) when the
region is split anyway, which runs faster from the cache; when no single axis
can, one iteration is split again along a second axis (nested loops).

Sharded programs: an axis cut across devices (by an explicit sharding in the
value's type, or by the sharding of a ``jax.jit`` argument) is never split,
so every device loops over its own shard along another axis and the
results keep the shardings jax.jit gives; loop carries take the varying
manual axes and explicit sharding of the values they build; ``shard_map``
bodies are split with their manual axes bound, collectives left in place. The
threshold and the split size bound one device's share of each value
(:mod:`.shares`); a ``shard_map`` reading a large per-device result of the one
before it is joined to it first (:mod:`.fuse`: a gradient's recomputed forward
and transposed bodies), so the split covers the value between them.

Carried state (:mod:`.online`): a region reducing the split axis in two
dependent steps (a maximum, then sums of ``exp(x - max)``: logsumexp, softmax)
is one loop carrying a running maximum and rescaled running sums; a
cumulative op along the split axis carries its running total from slice to
slice (from the end with ``reverse``). The report says what each loop carries.

Leaves alone: what cannot be split (no rule, random numbers, sort along the
axis, a factorisation of a large matrix, cumulative ops along the axis in
both directions, a value not linear in ``exp(-max)``...),
reported with its source line; a region whose loop cannot be built and a
sub-program that cannot be rebuilt are left as they are and reported, the
rest is still split.

Where it is done: :mod:`.driver` walks the program levels (sub-programs first) and runs rounds of
planning (:mod:`.plan`: regions, axes, chunks) and rewriting (:mod:`.emit`: the loops), and
:mod:`.report` says what was split and what was left; :class:`SplitPass` adds the memory-limit check.
"""

from __future__ import annotations

import dataclasses

from hlopass import internals as jx

from hlopass.config import Config
from hlopass.jaxpr_utils import largest_values
from hlopass.memory import defer_check, footprint as measure_alone, upper_bound
from hlopass.pass_base import Pass, exported_lazily
from hlopass.report import PassReport
from hlopass.sharding import input_shardings
from hlopass.sizes import format_size

from .options import SplitOptions

__all__ = ["MAX_NESTING", "SplitOptions", "SplitPass", "carried_state", "choose_chunk", "inline_calls_holding_large",
           "sharded_values", "split_level", "split_nested"]
__getattr__ = exported_lazily(__name__, {
    "inline_calls_holding_large": ".driver", "split_level": ".driver", "split_nested": ".driver",
    "MAX_NESTING": ".plan", "choose_chunk": ".plan", "carried_state": ".report", "sharded_values": ".shares"})


class SplitPass(Pass):
    """Rewrite regions that build a tensor over the threshold only to reduce it into loops over slices.

    With a memory limit, the split program is compiled and XLA's footprint checked (only when a
    crude upper bound exceeds the limit); while it is over, the split is redone with half the
    threshold and split size, at most ``options.max_retries`` times, and the report says what remains.
    For a caller that compiles the whole program and measures it anyway (``hlopass.jit``), that
    compile is the check: the passes run again, checking as above, only when it is over the limit.
    """

    name = "split"
    Options = SplitOptions
    #: Regions over the threshold, wherever they are written (branch bodies too), become loops.
    provides = frozenset({"split_regions"})

    def applies(self, closed: jx.ClosedJaxpr, config: Config, facts) -> bool:
        """Only where some value (sub-programs included) is over the threshold: a region starts at one."""
        return facts.above(config.threshold)

    def run(self, closed: jx.ClosedJaxpr, config: Config) -> tuple[jx.ClosedJaxpr, PassReport]:
        from .shares import analyses_kept, top_program
        # the jit arguments' shardings are this program's inputs'; values' sizes and equations' maps asked once
        with top_program(closed.jaxpr), analyses_kept():
            return self._run(closed, config)

    def _run(self, closed: jx.ClosedJaxpr, config: Config) -> tuple[jx.ClosedJaxpr, PassReport]:
        from .report import error_text
        from .shares import device_bytes
        new, report = self.run_once(closed, config)
        limit = config.memory_limit
        if limit is None or config.threshold is None or not report.rewrites or upper_bound(new, device_bytes(new.jaxpr), own_values_only=True) <= limit:
            return new, report
        if defer_check(self.name):  # the caller compiles the whole program and measures it anyway
            return new, report
        retries: list = []
        shardings = _input_shardings(closed)
        try:
            footprint = measure_alone(new, shardings, typed=False).footprint
        except Exception as err:  # noqa: BLE001 - a diagnostic compile must not lose the split
            report.skip("<memory limit>", "split", f"could not compile the split program alone to check its "
                        f"memory (the whole program is still checked): {error_text(err)}")
            return new, report
        current = config
        while footprint > limit and len(retries) < self.options.max_retries and current.split_size > 1:
            smaller = dataclasses.replace(current, threshold=max(1, current.threshold // 2),
                                          split_size=max(1, current.split_size // 2))
            retries.append((current, smaller, footprint))
            new, report = self.run_once(closed, smaller)
            footprint, current = measure_alone(new, shardings, typed=False).footprint, smaller
        for before, after, seen in retries:
            report.rewrite("retry", "<memory limit>",
                           f"XLA footprint {format_size(seen)} over the limit {format_size(limit)}: "
                           f"split again at threshold {format_size(after.threshold)}, "
                           f"split size {format_size(after.split_size)}",
                           footprint=seen, limit=limit, split_size=after.split_size, threshold=after.threshold)
        if footprint > limit:
            remains = ", ".join(f"{ty} ({format_size(n)}, {where})" for ty, n, where in largest_values(new, 3))
            report.skip("<memory limit>", "split", f"XLA footprint {format_size(footprint)} still over the limit "
                        f"{format_size(limit)} after {len(retries)} retries; largest values: {remains}")
        else:
            report.rewrite("memory_check", "<memory limit>", f"XLA footprint {format_size(footprint)} within "
                           f"the limit {format_size(limit)}", footprint=footprint, limit=limit)
        return new, report

    def run_once(self, closed: jx.ClosedJaxpr, config: Config) -> tuple[jx.ClosedJaxpr, PassReport]:
        """One split of ``closed`` and every sub-program, without the memory-limit loop."""
        from .driver import split_nested
        from .shares import top_program
        report = PassReport(self.name)
        if config.threshold is None or config.split_size is None:
            return closed, report
        with top_program(closed.jaxpr):
            return split_nested(closed, config, report, self.options), report



def _input_shardings(closed: jx.ClosedJaxpr) -> tuple | None:
    """The jax.jit arguments' ``NamedSharding`` s of ``closed``'s inputs, when known."""
    shardings = input_shardings()
    return shardings if shardings is not None and len(shardings) == len(closed.in_avals) else None
