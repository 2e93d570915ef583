"""Run the configured passes over a ClosedJaxpr, checking that each keeps the signature."""

from __future__ import annotations

import logging
import os
import time
import traceback
import weakref

from jax._src import core

from hlopass.config import Config
from hlopass.interpreter import inline_calls
from hlopass.jaxpr_utils import count_equations, largest_values
from hlopass.registry import get_pass
from hlopass.report import PassReport, PipelineReport

logger = logging.getLogger("hlopass")

#: Set to 1 to let exceptions inside passes propagate (the tests do); by
#: default a failing pass is skipped, logged and named in the report.
ENV_RAISE = "HLOPASS_RAISE_PASS_ERRORS"


class PipelineResult:
    """The rewritten jaxpr and the report of how it was obtained."""

    def __init__(self, original: core.ClosedJaxpr, jaxpr: core.ClosedJaxpr, report: PipelineReport):
        self.original = original
        self.jaxpr = jaxpr
        self.report = report


_cache: "weakref.WeakKeyDictionary[core.ClosedJaxpr, dict]" = weakref.WeakKeyDictionary()
#: The most recent pipeline results, newest last (for ``hlopass.last_reports()`` and dumps).
recent_results: list[PipelineResult] = []


def run_pipeline(closed: core.ClosedJaxpr, config: Config, label: str = "function") -> PipelineResult:
    """Run ``config.passes`` on ``closed``; cached per (jaxpr object, config)."""
    try:
        per_jaxpr = _cache.setdefault(closed, {})
    except TypeError:
        per_jaxpr = {}
    if config in per_jaxpr:
        return per_jaxpr[config]
    result = _run(closed, config, label)
    per_jaxpr[config] = result
    recent_results.append(result)
    del recent_results[:-64]
    return result


def _run(closed: core.ClosedJaxpr, config: Config, label: str) -> PipelineResult:
    report = PipelineReport(label=label, config_line=config.describe(),
                            equations_before=count_equations(closed))
    if not config.passes:
        report.equations_after = report.equations_before
        return PipelineResult(closed, closed, report)
    report.largest_before = largest_values(closed)
    current = inline_calls(closed)
    for name in config.passes:
        pass_ = get_pass(name)
        start = time.perf_counter()
        try:
            new, pass_report = pass_.run(current, config)
            _check_signature(current, new, name)
        except Exception as err:  # noqa: BLE001 - never crash on an unknown program
            if os.environ.get(ENV_RAISE, "") not in ("", "0"):
                raise
            logger.warning("hlopass: pass %s failed on %s and was skipped: %s", name, label, err)
            logger.debug("%s", traceback.format_exc())
            pass_report = PassReport(name)
            pass_report.skip("<pass>", name, f"pass raised {type(err).__name__}: {err}")
            new = current
        pass_report.seconds = time.perf_counter() - start
        report.passes.append(pass_report)
        for entry in pass_report.rewrites:
            logger.info("hlopass: %s", entry)
        current = new
    report.equations_after = count_equations(current)
    report.largest_after = largest_values(current)
    return PipelineResult(closed, current, report)


def _check_signature(before: core.ClosedJaxpr, after: core.ClosedJaxpr, name: str) -> None:
    def sig(avals):
        return [(a.shape, a.dtype) for a in avals]
    if sig(before.in_avals) != sig(after.in_avals) or sig(before.out_avals) != sig(after.out_avals):
        raise TypeError(f"pass {name} changed the program's signature: "
                        f"{before.in_avals}->{before.out_avals} became {after.in_avals}->{after.out_avals}")
