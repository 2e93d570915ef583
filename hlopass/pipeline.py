"""Run the configured passes over a ClosedJaxpr, and call their extension points.

:func:`run_pipeline` is what the ``hlopass_call`` lowering rule calls: the
passes of ``config.passes`` in order, each checked to keep the program's
signature (and, when checks are on, its well-typedness); a pass that raises
is skipped, logged and named in the report. :func:`trace_contexts` and
:func:`before_linearize` call the passes' other extension points (see
:class:`~hlopass.pass_base.Pass`).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import time
import traceback
import weakref
from typing import Iterator, Sequence

import jax
from hlopass import internals as jx

from hlopass import program_cache, progress
from hlopass.config import Config
from hlopass.interpreter import inline_calls
from hlopass.jaxpr_utils import count_equations, largest_values, values_above
from hlopass.memory import checks_deferred
from hlopass.pass_base import Pass, ProgramFacts
from hlopass.report import Note, PassReport, PipelineReport
from hlopass.sharding import input_shards
from hlopass.sizes import format_size

logger = logging.getLogger("hlopass")

#: Set to 1 to let exceptions inside passes propagate (the tests do); by
#: default a failing pass is skipped, logged and named in the report.
ENV_RAISE = "HLOPASS_RAISE_PASS_ERRORS"
#: Set to 1 to type-check every pass's result with ``jax.core.check_jaxpr`` (the tests do;
#: also on under ``jax_enable_checks``).
ENV_CHECK = "HLOPASS_CHECK_PASSES"


class PipelineResult:
    """The rewritten jaxpr and the report of how it was obtained.

    ``jaxpr`` is the original object itself when no pass rewrote anything. When the passes changed
    the program but could not bound it (values above the threshold remain), XLA's figures for the
    rewritten and the original program decide which one is compiled (:attr:`kept`, set by
    :func:`hlopass.never_worse.decide`; the report says why). The original is held weakly: this
    object lives in a cache keyed by it.
    """

    def __init__(self, original: jx.ClosedJaxpr, rewritten: jx.ClosedJaxpr | None, report: PipelineReport,
                 config: Config):
        self._original = weakref.ref(original)
        self._rewritten = rewritten
        self.report = report
        self.config = config
        #: "rewritten" or "original" once XLA's figures decided (only for changed, unbounded programs)
        self.kept: str | None = None
        #: the memory check of the program compiled alone, once made (see :mod:`hlopass.never_worse`)
        self.check = None
        self.settled = False
        self.warned = False
        #: the name of this program's entry in the persistent cache (:mod:`hlopass.program_cache`)
        self.cache_key: str | None = None
        #: the passes that took the program as fitting the limit, leaving the check to the caller's
        #: compile of the whole program (:func:`hlopass.memory.deferring_checks`); see :meth:`confirm`
        self.unconfirmed: tuple[str, ...] = ()
        self._key = None  # its entry in run_pipeline's cache (see forget)
        #: the rewritten program as stored in the persistent cache (exported; see
        #: :func:`hlopass.program_cache.export_rewritten`), lowered in its place; ``None`` when not stored
        self.lowered: jx.ClosedJaxpr | None = None
        #: ``(program, bytes)`` of the exported rewritten program waiting for XLA's figures to decide
        #: (:func:`hlopass.never_worse.decide` stores it if they keep it): compared in the exported form,
        #: a later process that reads it lowers the module XLA's cache holds
        self.exported: tuple | None = None

    @property
    def original(self) -> jx.ClosedJaxpr:
        return self._original()

    @property
    def changed(self) -> bool:
        """Whether a pass rewrote the program."""
        return self._rewritten is not None

    @property
    def jaxpr(self) -> jx.ClosedJaxpr:
        """The program after the passes (the original object when nothing was rewritten)."""
        return self._rewritten if self._rewritten is not None else self._original()

    @property
    def program(self) -> jx.ClosedJaxpr:
        """What goes to XLA: the rewritten program, unless the original was kept."""
        return self._original() if self.kept == "original" else self.jaxpr

    @property
    def to_lower(self) -> jx.ClosedJaxpr:
        """:attr:`program`, in the form stored in the persistent cache when it is (the same module in
        every process that lowers it, which XLA's cache then serves)."""
        return self.lowered if self.lowered is not None and self.kept != "original" else self.program

    @functools.cached_property
    def unbounded(self) -> list[tuple[str, int, str]]:
        """Values of the rewritten program above the threshold (its inputs and outputs aside: a
        temporary as large as an input still adds to what the program holds)."""
        if not self.changed or self.config.threshold is None or self.report.from_cache:
            return []  # (a program read from the cache was stored with the comparison settled, if it needed one)
        return values_above(self._rewritten, self.config.threshold)

    def confirm(self, check) -> bool:
        """Settle the checks the passes left to the caller with its measurement of the whole program:
        ``False`` when it is over the limit (then :func:`forget` the result and run the passes again,
        checking); when within, each such pass's report says so, as if it had compiled the program."""
        if not self.unconfirmed:
            return True
        if check.over_limit:
            return False
        for pass_report in self.report.passes:
            if pass_report.name in self.unconfirmed and pass_report.rewrites:
                pass_report.rewrite("memory_check", "<memory limit>", f"XLA footprint {format_size(check.footprint)} "
                                    f"within the limit {format_size(check.limit)} (the whole program compiled)",
                                    footprint=check.footprint, limit=check.limit)
        self.unconfirmed = ()
        return True

    @property
    def needs_comparison(self) -> bool:
        """Whether XLA's figures must decide between the rewritten and the original program."""
        return self.config.never_worse and self.changed and bool(self.unbounded)


_cache: "weakref.WeakKeyDictionary[jx.ClosedJaxpr, dict]" = weakref.WeakKeyDictionary()


def run_pipeline(closed: jx.ClosedJaxpr, config: Config, label: str = "function",
                 notes: Sequence[Note] = ()) -> PipelineResult:
    """Run ``config.passes`` on ``closed``; cached per (jaxpr object, config, notes, input shardings).

    ``notes`` are findings the passes' extension points made for this program;
    each goes to the report of the pass that made it.
    """
    try:
        per_jaxpr = _cache.setdefault(closed, {})
    except TypeError:
        per_jaxpr = {}
    key = (config, tuple(notes), input_shards())
    if key not in per_jaxpr:
        per_jaxpr[key] = _run(closed, config, label, notes, key[2])
        per_jaxpr[key]._key = key
    return per_jaxpr[key]


def forget(result: PipelineResult) -> None:
    """Drop ``result`` from :func:`run_pipeline`'s cache: the next run of its program runs the passes."""
    original = result.original
    per_jaxpr = _cache.get(original) if original is not None else None
    if per_jaxpr is not None and per_jaxpr.get(result._key) is result:
        del per_jaxpr[result._key]


def placed(config: Config) -> list[Pass]:
    """The configured passes, each told which passes come after it."""
    passes = list(config.passes)
    return [_copy(p).placed_before(passes[k + 1:]) for k, p in enumerate(passes)]


def _copy(pass_: Pass) -> Pass:
    clone = object.__new__(type(pass_))
    clone.__dict__.update(pass_.__dict__)
    return clone


def _raise_errors() -> bool:
    return os.environ.get(ENV_RAISE, "") not in ("", "0")


def _check_enabled() -> bool:
    return os.environ.get(ENV_CHECK, "") not in ("", "0") or bool(jax.config.jax_enable_checks)


def _run(closed: jx.ClosedJaxpr, config: Config, label: str, notes: Sequence[Note], shards=None) -> PipelineResult:
    report = PipelineReport(label=label, config_line=config.describe(),
                            equations_before=count_equations(closed))
    if not config.passes:
        report.equations_after = report.equations_before
        return PipelineResult(closed, None, report, config)
    report.largest_before = largest_values(closed)
    passes = placed(config)
    facts = ProgramFacts(closed)
    if not any(_applies(pass_, closed, config, facts) for pass_ in passes):
        # nothing to do: XLA gets the program as written, and no pass, inlining or re-trace ran
        report.passes = [_not_run(pass_, notes) for pass_ in passes]
        report.equations_after = report.equations_before
        report.largest_after = report.largest_before
        logger.debug("hlopass: %s: no pass applies (largest value %s); compiled as written", label,
                     format_size(facts.largest_bytes))
        return PipelineResult(closed, None, report, config)
    cache_key = program_cache.key(closed, config, tuple(notes), shards)
    cached = program_cache.load(cache_key, closed.in_avals)
    if cached is not None:  # an earlier process's program: as written, or rewritten and exported
        cached.report.label = label
        logger.debug("hlopass: %s: the passes' decision read from the persistent cache", label)
        result = PipelineResult(closed, cached.program, cached.report, config)
        result.lowered = cached.program
        return result
    with progress.program(label, [p.name for p in passes]) as work, collector_paused():
        current, rewrote = _run_passes(closed, config, label, notes, passes, facts, report, work)
    if not rewrote:  # nothing rewritten: XLA gets the user's program itself (not its inlined re-trace)
        report.equations_after = report.equations_before
        report.largest_after = report.largest_before
        program_cache.store(cache_key, report)
        return PipelineResult(closed, None, report, config)
    report.equations_after = count_equations(current)
    report.largest_after = largest_values(current)
    result = PipelineResult(closed, current, report, config)
    result.cache_key = cache_key
    result.unconfirmed = checks_deferred()
    exported = program_cache.export_rewritten(cache_key, current, sharded=shards is not None or _in_manual_context())
    if exported is not None and not result.needs_comparison:
        result.lowered = exported[0] if program_cache.write_rewritten(cache_key, report, exported[1]) else None
    elif exported is not None:  # never_worse.decide stores it, or the original, once XLA's figures decide
        result.lowered, result.exported = exported[0], exported
    return result


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while hlopass traces the function and runs the passes
    (as ``timeit`` pauses it).

    Both build and drop tens of thousands of containers (tracers and equations; a dataflow graph,
    dimension maps and grown regions per trial planning). Enough of them outlived two young collections
    that Python ran a full collection over every object of the process in the middle: 0.05-0.06 s of a
    first call of 1.1 s on the Transformer blocks under their memory limit (in the split), 0.12-0.18 s
    of the Sinkhorn solve's 1.0 s with rewrites forced (in the trace). Paused, they are freed by
    reference counting as they go, and are never promoted to the old generation that a full collection
    scans; what forms cycles waits for the next collection after. Left as it is where the collector is
    already off or another thread paused it."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _in_manual_context() -> bool:
    """Whether the program is lowered inside a ``shard_map`` body (its mesh has manual axes)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and bool(getattr(mesh, "manual_axes", ()))


def _run_passes(closed, config, label, notes, passes, facts, report, work) -> tuple[jx.ClosedJaxpr, bool]:
    """Inline calls, run each pass that applies; the program and whether a pass rewrote it."""
    current = inline_calls(closed)
    rewrote = False
    for index, pass_ in enumerate(passes):
        if current is not facts.closed:
            facts = ProgramFacts(current)
        if not _applies(pass_, current, config, facts):
            report.passes.append(_not_run(pass_, notes))
            continue
        work.start_pass(index)
        start = time.perf_counter()
        try:
            new, pass_report = pass_.run(current, config)
            _check_signature(current, new, pass_.name)
            if new is not current and _check_enabled():
                jx.check_jaxpr(new.jaxpr)
        except Exception as err:  # noqa: BLE001 - never crash on an unknown program
            if _raise_errors():
                raise
            logger.warning("hlopass: pass %s failed on %s and was skipped: %s", pass_.name, label, err)
            logger.debug("%s", traceback.format_exc())
            pass_report = PassReport(pass_.name)
            pass_report.skip("<pass>", pass_.name, f"pass raised {type(err).__name__}: {err}")
            new = current
        rewrote = rewrote or (new is not current and bool(pass_report.rewrites))
        for note in notes:
            if note.pass_name == pass_.name:
                pass_report.add_note(note)
        pass_report.seconds = time.perf_counter() - start
        report.passes.append(pass_report)
        for entry in pass_report.rewrites:
            logger.info("hlopass: %s", entry)
        current = new
    return current, rewrote


def _applies(pass_: Pass, closed: jx.ClosedJaxpr, config: Config, facts: ProgramFacts) -> bool:
    """The pass's own answer; a pass whose gate raises is run (its errors are handled there)."""
    try:
        return bool(pass_.applies(closed, config, facts))
    except Exception as err:  # noqa: BLE001 - a broken gate must not hide the pass
        if _raise_errors():
            raise
        logger.debug("hlopass: %s.applies raised %s: %s; the pass runs", pass_.name, type(err).__name__, err)
        return True


def _not_run(pass_: Pass, notes: Sequence[Note]) -> PassReport:
    """The report of a pass the pipeline did not run: the notes it made while tracing, if any."""
    pass_report = PassReport(pass_.name, ran=False)
    for note in notes:
        if note.pass_name == pass_.name:
            pass_report.add_note(note)
    return pass_report


def _check_signature(before: jx.ClosedJaxpr, after: jx.ClosedJaxpr, name: str) -> None:
    def sig(avals):
        return [(getattr(a, "shape", None), getattr(a, "dtype", None), type(a)) for a in avals]  # tokens too
    if sig(before.in_avals) != sig(after.in_avals) or sig(before.out_avals) != sig(after.out_avals):
        raise TypeError(f"pass {name} changed the program's signature: "
                        f"{before.in_avals}->{before.out_avals} became {after.in_avals}->{after.out_avals}")


@contextlib.contextmanager
def trace_contexts(config: Config, notes: list[Note], again: Sequence[str] = ()) -> Iterator[None]:
    """Enter the enabled passes' :meth:`~hlopass.pass_base.Pass.trace_context` s, in pipeline order;
    the passes named in ``again`` enter their :meth:`~hlopass.pass_base.Pass.retrace_context`."""
    with contextlib.ExitStack() as stack:
        for pass_ in placed(config):
            if pass_.name in again:
                context = pass_.retrace_context(config, notes)
            else:
                context = pass_.trace_context(config, notes)
            if context is not None:
                stack.enter_context(context)
        yield


def retrace_wanted(closed: jx.ClosedJaxpr, config: Config) -> tuple[str, ...]:
    """The enabled passes that want the function traced to ``closed`` traced again
    (:meth:`~hlopass.pass_base.Pass.wants_retrace`)."""
    return tuple(p.name for p in placed(config) if p.wants_retrace(closed, config))


def before_linearize(closed: jx.ClosedJaxpr, config: Config) -> tuple[jx.ClosedJaxpr, tuple[Note, ...]]:
    """Apply the enabled passes' :meth:`~hlopass.pass_base.Pass.before_linearize` in pipeline order.

    A pass that raises there is skipped (its failure becomes a note), as in :func:`run_pipeline`.
    """
    notes: list[Note] = []
    for pass_ in placed(config):
        try:
            new = pass_.before_linearize(closed, config, notes)
            if new is not closed:
                _check_signature(closed, new, pass_.name)
        except Exception as err:  # noqa: BLE001 - never crash on an unknown program
            if _raise_errors():
                raise
            notes.append(Note(pass_.name, "skip", "<before linearize>",
                              f"pass raised {type(err).__name__}: {err}", pass_.name))
            continue
        closed = new
    return closed, tuple(notes)
