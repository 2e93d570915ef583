"""Never worse than plain, and the memory check of a hlopass program compiled as part of another.

**The memory check holds whatever the composition.** Every compiled hlopass program is checked
against the memory limit once per (program, settings):

- a call with concrete arguments (:class:`~hlopass.checked.CheckedJit`: ``hlopass.jit`` functions,
  and the primitive's own implementation, which eager ``jax.grad`` / ``jax.vmap`` reach) compiles
  the program ahead of time and measures it whole: the compile ``jax.jit`` would make anyway, and
  the check the split and remat passes leave to it (:func:`hlopass.memory.deferring_checks`);
- anywhere else (under an outer ``jax.jit``, inside another hlopass function, in an ahead-of-time
  ``lower()``), the lowering rule measures the program by compiling it alone (:func:`settle`),
  unless a crude upper bound on its bytes (:func:`~hlopass.memory.upper_bound`) is below half the
  limit, as it is for most programs: those pay no second compile.

**Never worse than plain.** When the passes changed a program but could not bound it (temporaries
remain above the threshold, a Cholesky factor say), XLA's figures for the rewritten and
the original program decide which one runs (:func:`decide`); the report says which was kept, both
footprints and compile times, and what blocked the bound.

``result`` below is a :class:`~hlopass.pipeline.PipelineResult` (read and updated here, never built:
this module sits just above :mod:`hlopass.memory`, below the pipeline).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time

from hlopass import internals as jx

from hlopass import program_cache
from hlopass.memory import MemoryCheck, enforce, footprint, upper_bound
from hlopass.report import Comparison

logger = logging.getLogger("hlopass")


def settle(result, name: str, shardings: tuple | None = None) -> None:
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


def _enforce(result) -> None:
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


def decide(result, rewritten: MemoryCheck, rewritten_s: float | None,
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
    if kept == "original":  # a later process compiles the program as written without the passes
        program_cache.store(getattr(result, "cache_key", None), result.report)
    elif getattr(result, "exported", None) is not None:  # a later process lowers the program compared here
        program_cache.write_rewritten(result.cache_key, result.report, result.exported[1])
        result.exported = None
    return kept


def blocked_bound(result, most: int = 6) -> tuple[list[str], list[str]]:
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
