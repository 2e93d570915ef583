"""Rematerialisation under the memory limit: optimal checkpointing as a pass.

Matches: a gradient whose compiled footprint (XLA's ``memory_analysis``:
temporaries, arguments and outputs) is over ``config.memory_limit`` while it
keeps forward values alive for its backward pass:

- ``jax.grad`` inside the hlopass function (:meth:`RematPass.run`): the
  program holds both passes; the values the backward equations (those JAX's
  transposition emitted) read from the forward pass are the residuals;
- ``jax.grad`` of a hlopass function (:meth:`RematPass.before_linearize`):
  the program JAX is about to differentiate, before JAX decides what its
  forward call hands to its backward call.

Emits: a recomputation schedule chosen by dynamic programming over the
forward chain (:mod:`.schedule`: least recomputation time within a byte
budget, nested recomputation allowed) with per-stage times from FLOP and
byte counts at measured machine rates (:mod:`.cost`), cut at the program's
small cuts (:mod:`.chain`). Inside a program, the recomputed forward
equations are re-emitted in the backward pass (:mod:`.emit`), each block
inside a conditional that waits for the cotangent it serves, so that XLA
neither merges it with the forward pass nor runs it early (:mod:`.gate`;
``jax.checkpoint`` alone saves nothing on XLA:CPU). Before linearisation,
the chosen blocks become ``custom_vjp`` functions that keep their inputs and
recompute under the same gate (:mod:`.primal`). A ``lax.scan`` over layers
gets a checkpointed schedule: its carry kept every k steps, k and the kept
prefix chosen by the same DP (:mod:`.scans`). The program is compiled and
measured after each choice, and the budget adjusted until it fits or nothing
more can be recomputed (:mod:`.loop`); the report lists what was
recomputed (source lines), the predicted and measured footprint and the
predicted extra time.

Leaves alone: programs without a memory limit, programs that fit (the same
jaxpr object is returned; one the split pass took as fitting, leaving the check to the compile of the
whole program, see :func:`hlopass.memory.deferring_checks`, is taken as fitting here too), programs with no backward pass or no residuals,
stages with side effects (never recomputed); when no schedule fits, the
program with the smallest footprint found is kept and the report says so
(the memory check then warns, or raises ``MemoryLimitError`` under
``strict``, naming that footprint).
"""

from __future__ import annotations

import dataclasses

from hlopass import internals as jx

from hlopass.config import Config
from hlopass.jaxpr_utils import UnnamedProgram, dce, program_text
from hlopass.memory import checks_deferred, defer_check, footprint, upper_bound
from hlopass.pass_base import Pass
from hlopass.report import Note, PassReport
from hlopass.sharding import explicit_mesh
from hlopass.sizes import format_size



@dataclasses.dataclass(frozen=True)
class RematOptions:
    """Tuning of the remat pass (``RematPass(max_rounds=6)``)."""

    #: Compilations of the closed loop (besides the one that measures the original program).
    max_rounds: int = 6
    #: Stages a forward chain is cut into (the DP is cubic in it).
    max_stages: int = 64
    #: Memory buckets of a flat chain's DP (the seed's 5 MB buckets cost ~1% extra compute); a
    #: scan's DP is small and uses 1024.
    buckets: int = 128
    #: Nesting of recomputation in flat chains (a scan gets one level: nested scans).
    depth: int = 3
    #: Stop once a fitting program is within this fraction below the limit.
    slack: float = 0.15


class RematPass(Pass):
    """Recompute forward values in the backward pass when the gradient does not fit the memory
    limit (see the module docstring)."""

    name = "remat"
    Options = RematOptions
    provides = frozenset({"rematerialize"})

    def applies(self, closed: jx.ClosedJaxpr, config: Config, facts) -> bool:
        """Only where the crude bound on the program's bytes is over the memory limit (below it,
        :meth:`run` returns the program as it is)."""
        return facts.over(config.memory_limit)

    def run(self, closed: jx.ClosedJaxpr, config: Config) -> tuple[jx.ClosedJaxpr, PassReport]:
        from .chain import keeps_residuals
        limit = config.memory_limit
        if limit is None or not keeps_residuals(closed) or upper_bound(closed, own_values_only=True) <= limit:
            return closed, PassReport(self.name)
        if "split" in checks_deferred() and defer_check(self.name):
            return closed, PassReport(self.name)  # the split took its program as fitting: so does this pass
        key = (structure(closed), config, self)
        if key not in _done:
            _done[key] = self._run(closed, config)
            while len(_done) > 16:
                _done.pop(next(iter(_done)))
        new, report = _done[key]
        copy = PassReport(report.name, list(report.rewrites), list(report.skipped), report.seconds)
        return (closed if new is None else new), copy

    def _run(self, closed: jx.ClosedJaxpr, config: Config) -> tuple[jx.ClosedJaxpr | None, PassReport]:
        """:meth:`run` past the cheap checks; ``None`` for "unchanged"."""
        from .chain import analyse
        from .cost import rates
        from .emit import emit
        from .loop import ChainProblem, ScanProblem, closed_loop
        from .report import describe_outcome
        from .scans import block_lengths, segments
        report = PassReport(self.name)
        limit = config.memory_limit
        if explicit_mesh(closed) is not None:
            report.skip("<memory limit>", "remat", "explicitly sharded types (jax.sharding.AxisType.Explicit): "
                        "the pass measures and emits programs without their mesh, so it leaves them as written")
            return None, report
        footprint0 = footprint(closed, typed=False).footprint
        if footprint0 <= limit:
            return None, report
        machine = rates()
        analysis = analyse(closed, machine, max_stages=self.options.max_stages)
        problems, names = [], []
        if analysis is not None and analysis.flat is not None:
            problems.append(ChainProblem("flat", analysis.flat.chain, buckets=self.options.buckets,
                                         depth=self.options.depth))
            names.append(("flat", None))
        for pair in (analysis.pairs if analysis is not None else []):
            n = pair.length(closed.jaxpr)
            problems.append(ScanProblem(f"scan{pair.forward}",
                                        lambda k, pair=pair: pair.chain(closed.jaxpr, machine, k), n,
                                        block_lengths(n, self.options.max_stages)))
            names.append(("scan", pair))
        if not problems or not sum(p.store_all for p in problems):
            report.skip("<memory limit>", "remat", f"XLA footprint {format_size(footprint0)} is over the limit "
                        f"{format_size(limit)} but the backward pass keeps no forward values to recompute")
            return None, report

        def emit_plan(plan):
            flat_items, scan_plans = None, {}
            for (kind, pair), sol in zip(names, plan.solutions):
                if kind == "flat":
                    flat_items = sol.items
                else:
                    scan_plans[pair.forward] = segments(sol.items, sol.group, pair.length(closed.jaxpr))
            return emit(analysis, flat_items, scan_plans)

        outcome = closed_loop(problems, emit_plan, lambda new: footprint(new, typed=False).footprint, footprint0, limit,
                              max_rounds=self.options.max_rounds, slack=self.options.slack)
        describe_outcome(report, outcome, names, analysis, footprint0, limit, machine)
        if outcome.chosen is None or (not outcome.fits and outcome.chosen.footprint >= footprint0):
            return None, report
        return outcome.chosen.jaxpr, report

    def before_linearize(self, closed: jx.ClosedJaxpr, config: Config, notes: list[Note]) -> jx.ClosedJaxpr:
        """For ``jax.grad`` of a hlopass function: choose what the forward call keeps before JAX
        linearises it (see :mod:`.primal`)."""
        if config.memory_limit is None:
            return closed
        from .primal import rematerialize_primal
        key = (structure(closed), config, self)
        if key not in _done:
            found: list[Note] = []
            new = rematerialize_primal(closed, config, found, self.options)
            _done[key] = (None if new is closed else new, tuple(found))
            while len(_done) > 16:
                _done.pop(next(iter(_done)))
        new, found = _done[key]
        notes.extend(found)
        return closed if new is None else new


#: Recent results by program structure (JAX traces the same program again for each eager
#: ``jax.grad`` call and for ``trace``, ``lower`` and calls): the closed loop compiles, so it runs
#: once per program, settings and pass options.
_done: dict = {}


def structure(closed: jx.ClosedJaxpr) -> tuple:
    """A key equal for programs that compute the same, dead code aside: their text and the values of
    their constants, sub-programs' included (:func:`hlopass.jaxpr_utils.program_text`; a constant that
    is not an array is told apart by its identity)."""
    live = dce(closed)
    try:
        return (program_text(live),)
    except UnnamedProgram:
        return str(live.jaxpr), tuple(id(c) for c in closed.consts)
