"""``hlopass.explain``: what the pipeline does to a function, without running it.

Built from the stages the API hands over (``trace``, ``lower``, ``compile``
of a ``hlopass.jit`` function) next to ``jax.jit``'s of the original.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from hlopass.api import HlopassFunction
from hlopass.api import jit as hlopass_jit
from hlopass.call import hlopass_call_p
from hlopass.jaxpr_utils import iter_eqns
from hlopass.memory import MemoryCheck, measure
from hlopass.never_worse import inspecting
from hlopass.pipeline import run_pipeline
from hlopass.report import PipelineReport
from hlopass.sizes import format_size


@dataclasses.dataclass
class Explanation:
    """The program before and after the passes, the report, and XLA's memory figures for both."""

    label: str
    config: Any
    original_jaxpr: Any
    rewritten_jaxpr: Any
    report: Any
    stablehlo_before: str
    stablehlo_after: str
    memory_before: MemoryCheck | None
    memory_after: MemoryCheck | None

    def summary(self) -> str:
        """A few lines for a terminal."""
        lines = [str(self.report)]
        for title, check in (("before", self.memory_before), ("after", self.memory_after)):
            if check is None:
                continue
            lines.append(f"  XLA memory {title}: {check.summary()}")
            lines.extend(f"    {t}" for t in check.largest[:3])
        if self.memory_before and self.memory_after and self.memory_after.temp_bytes:
            ratio = self.memory_before.temp_bytes / max(self.memory_after.temp_bytes, 1)
            lines.append(f"  temp memory ratio before/after: {ratio:.1f}x "
                         f"({format_size(self.memory_before.temp_bytes)} -> {format_size(self.memory_after.temp_bytes)})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def to_dict(self) -> dict:
        return {
            "label": self.label,
            "config": self.config.describe(),
            "report": self.report.to_dict(),
            "memory_before": self.memory_before.to_dict() if self.memory_before else None,
            "memory_after": self.memory_after.to_dict() if self.memory_after else None,
        }


def explain(fun, *args, compile: bool = True, _config=None, **kwargs) -> Explanation:
    """Trace ``fun`` at ``args`` (arrays or ``jax.ShapeDtypeStruct``), run the passes, lower and
    (with ``compile``) compile before and after; nothing is executed.

    ``fun`` may be a ``hlopass.jit`` function (its settings apply) or a plain
    function (the environment's settings apply).
    """
    function = fun if isinstance(fun, HlopassFunction) else hlopass_jit(fun)
    config = _config or function.config()
    with inspecting():  # measured and reported here; strict mode does not raise
        traced = function.trace_with(config, *args, **kwargs)
        lowered_after = traced.lower()
        lowered_before = jax.jit(function._fun, **function._jit_kwargs).lower(*args, **kwargs)
    memory_before = memory_after = None
    if compile:
        memory_before = measure(lowered_before.compile(), lowered_before, config.memory_limit, f"{function.label} (before)")
        memory_after = measure(lowered_after._lowered.compile(), lowered_after._lowered, config.memory_limit,
                               f"{function.label} (after)")
    return Explanation(label=function.label, config=config, original_jaxpr=traced.original_jaxpr,
                       rewritten_jaxpr=traced.rewritten_jaxpr, report=traced.report,
                       stablehlo_before=lowered_before.as_text(), stablehlo_after=lowered_after.as_text(),
                       memory_before=memory_before, memory_after=memory_after)


def reports(fun, *args, **kwargs) -> list[PipelineReport]:
    """The pipeline report of every ``hlopass_call`` in the program ``jax.make_jaxpr(fun)(*args)``.

    ``fun`` may wrap hlopass functions in JAX transformations: under
    ``jax.grad`` the list holds the forward and the backward program's reports.
    """
    closed = jax.make_jaxpr(fun)(*args, **kwargs)
    return [run_pipeline(e.params["jaxpr"], e.params["config"], e.params["name"], e.params["notes"]).report
            for e in iter_eqns(closed, into_own_programs=True) if e.primitive is hlopass_call_p]
