"""The pass contract: ``run(jaxpr, config) -> (jaxpr, report)``."""

from __future__ import annotations

from typing import ClassVar

from jax._src import core

from hlopass.config import Config
from hlopass.interpreter import rewrite_nested
from hlopass.report import PassReport


class Pass:
    """Base class for passes.

    Subclasses set ``name`` and implement :meth:`run_level`, which rewrites one
    jaxpr level (returning the same object when it changes nothing).
    :meth:`run` applies it to every sub-jaxpr (scan/while/cond bodies, custom
    derivative and checkpoint bodies) innermost first, then to the top level.
    Passes with a global view (``recursive = False``) override :meth:`run`.
    """

    name: ClassVar[str] = ""
    recursive: ClassVar[bool] = True

    def run(self, closed: core.ClosedJaxpr, config: Config) -> tuple[core.ClosedJaxpr, PassReport]:
        report = PassReport(self.name)
        if self.recursive:
            new = rewrite_nested(closed, lambda level: self.run_level(level, config, report))
        else:
            new = self.run_level(closed, config, report)
        return new, report

    def run_level(self, closed: core.ClosedJaxpr, config: Config, report: PassReport) -> core.ClosedJaxpr:
        raise NotImplementedError
