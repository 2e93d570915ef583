"""The pass contract: ``run(jaxpr, config) -> (jaxpr, report)``, options, and the extension points.

A pass is a small class with a ``name``, a docstring saying what it matches,
what it emits and what it leaves alone, and either :meth:`Pass.run_level`
(rewrite one jaxpr level; :meth:`Pass.run` applies it to every sub-jaxpr,
innermost first) or its own :meth:`Pass.run`. Tuning constants are fields of
the pass's ``Options`` dataclass (``SplitPass(max_rounds=4)``), so a
configured pass is a value: it can stand in a pipeline (``passes=[...]``)
and be part of a cache key.

Two extension points let a pass act outside the pipeline, as torch.fx's
``PassBase`` and xDSL's ``ModulePass`` hooks do; the pipeline calls them on
the pass instances it holds, only for enabled passes, in pipeline order:

* :meth:`Pass.trace_context`: a context entered while ``hlopass.jit`` traces
  the user's function (before JAX's transformations have run);
* :meth:`Pass.wants_retrace` and :meth:`Pass.retrace_context`: a pass whose
  trace-time work costs a trace of its own may do it only where the traced
  program shows it can matter: asked after the first trace, it has the
  function traced once more under its ``retrace_context``;
* :meth:`Pass.before_linearize`: a rewrite of a jaxpr that JAX is about to
  linearise (``jax.grad`` of a hlopass function).

What a pass finds there reaches its report as :class:`~hlopass.report.Note` s.

Before running a pass the pipeline asks :meth:`Pass.applies` whether it could change the program,
given :class:`ProgramFacts` (sizes read from the avals, computed once for all passes). A pass that
cannot is not run; when none can, the program goes to XLA as written at the cost of one walk over
its avals (no inlining, no analysis, no re-trace).

A pass may declare capabilities in ``provides`` (``{"reorder_products"}``);
an earlier pass asks :meth:`Pass.later_provides` whether a pass after it in
the pipeline will do something, instead of testing pass names.

A pass package imports its machinery where it runs it, not when the package is imported (the
pipeline imports every enabled pass to key, trace and gate a program; a program read from the
persistent cache, or one no pass applies to, never runs most of them). The names the package
offers from its modules are served on first use by :func:`exported_lazily`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Callable, ClassVar, ContextManager, Iterable

from hlopass import internals as jx

from hlopass.config import Config
from hlopass.interpreter import rewrite_nested
from hlopass.jaxpr_utils import largest_value_bytes
from hlopass.memory import upper_bound
from hlopass.report import Note, PassReport


class ProgramFacts:
    """What the passes' :meth:`Pass.applies` read about a program: sizes from its avals, each computed
    on first use and shared by every pass of one pipeline run.

    - ``largest_bytes``: the largest value anywhere in the program (inputs, constants, results of
      every equation, and the same inside loop, branch and call bodies), whole (one device holds
      at most that of it);
    - ``bound_bytes``: :func:`~hlopass.memory.upper_bound` of the program's own values (what the
      passes measure against the memory limit).
    """

    def __init__(self, closed: jx.ClosedJaxpr):
        self.closed = closed

    @functools.cached_property
    def largest_bytes(self) -> int:
        return largest_value_bytes(self.closed)

    @functools.cached_property
    def bound_bytes(self) -> int:
        return upper_bound(self.closed, own_values_only=True)

    def above(self, threshold: int | None) -> bool:
        """Whether some value is larger than ``threshold`` (``None``: the threshold is off, never)."""
        return threshold is not None and self.largest_bytes > threshold

    def over(self, limit: int | None) -> bool:
        """Whether the crude bound exceeds ``limit`` (``None``: no limit, never)."""
        return limit is not None and self.bound_bytes > limit


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """Options of a pass that has none."""


class Pass:
    """Base class for passes (see the module docstring)."""

    name: ClassVar[str] = ""
    recursive: ClassVar[bool] = True
    Options: ClassVar[type] = NoOptions
    #: Capabilities this pass offers to the passes before it (see :meth:`later_provides`).
    provides: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, options: Any = None, **fields):
        if options is not None and fields:
            raise TypeError(f"{type(self).__name__}: give options or fields, not both")
        if options is not None and not isinstance(options, self.Options):
            raise TypeError(f"{type(self).__name__}: options must be a {self.Options.__name__}, got {options!r}")
        try:
            self.options = options if options is not None else self.Options(**fields)
        except TypeError as err:
            names = ", ".join(f.name for f in dataclasses.fields(self.Options)) or "none"
            raise TypeError(f"{type(self).__name__}: {err}; its options are: {names}") from None
        self._later: dict[str, str] = {}

    # -- identity: a configured pass is a value ------------------------------------------------
    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.options == self.options

    def __hash__(self) -> int:
        return hash((type(self), self.options))

    def __repr__(self) -> str:
        changed = {f.name: getattr(self.options, f.name) for f in dataclasses.fields(self.options)
                   if getattr(self.options, f.name) != f.default}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in changed.items())})"

    # -- position in the pipeline --------------------------------------------------------------
    def placed_before(self, later: Iterable["Pass"]) -> "Pass":
        """Tell the pass which passes run after it (the pipeline does this)."""
        self._later = {}
        for other in later:
            for capability in other.provides:
                self._later.setdefault(capability, other.name)
        return self

    def later_provides(self, capability: str) -> str | None:
        """The name of the first pass later in the pipeline that declares ``capability`` in its
        ``provides``, or ``None``."""
        return self._later.get(capability)

    # -- the pipeline step -----------------------------------------------------------------------
    def applies(self, closed: jx.ClosedJaxpr, config: Config, facts: ProgramFacts) -> bool:
        """Whether :meth:`run` could change ``closed``; ``False`` lets the pipeline skip the pass.

        Asked before every run, so it must be cheap: read ``facts`` (sizes from the avals) and
        ``config``, not analyse. It may say ``True`` when unsure, never ``False`` for a program the
        pass would rewrite. The default is ``True``: a pass that does not say is always run.
        """
        return True

    def run(self, closed: jx.ClosedJaxpr, config: Config) -> tuple[jx.ClosedJaxpr, PassReport]:
        """Rewrite ``closed``; return the new jaxpr (the same object when nothing changed) and the report."""
        report = PassReport(self.name)
        if self.recursive:
            new = rewrite_nested(closed, lambda level: self.run_level(level, config, report))
        else:
            new = self.run_level(closed, config, report)
        return new, report

    def run_level(self, closed: jx.ClosedJaxpr, config: Config, report: PassReport) -> jx.ClosedJaxpr:
        """Rewrite one jaxpr level (its sub-jaxprs are already done)."""
        raise NotImplementedError

    # -- extension points ------------------------------------------------------------------------
    def trace_context(self, config: Config, notes: list[Note]) -> ContextManager | None:
        """A context entered while ``hlopass.jit`` traces the user's function, or ``None``.

        Findings appended to ``notes`` reach this pass's report for the traced program.
        """
        return None

    def wants_retrace(self, closed: jx.ClosedJaxpr, config: Config) -> bool:
        """Whether the function, traced to ``closed`` under every :meth:`trace_context`, must be traced
        again with this pass's :meth:`retrace_context` in place of its ``trace_context``."""
        return False

    def retrace_context(self, config: Config, notes: list[Note]) -> ContextManager | None:
        """The context this pass enters, instead of :meth:`trace_context`, when the function is traced
        again because :meth:`wants_retrace` said so."""
        return None

    def before_linearize(self, closed: jx.ClosedJaxpr, config: Config,
                         notes: list[Note]) -> jx.ClosedJaxpr:
        """Rewrite a jaxpr JAX is about to linearise (``jax.grad`` of a hlopass function).

        Returns ``closed`` itself when there is nothing to do; findings go to ``notes``.
        """
        return closed


def exported_lazily(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """A pass package's module ``__getattr__``: each name of ``where`` imported from its submodule
    (``{"split_level": ".driver"}``) when first asked for, then kept in the package."""
    module = importlib.import_module(package)

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name], package), name)
        setattr(module, name, value)
        return value
    return __getattr__
