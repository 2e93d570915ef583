"""What the passes did: rewrites and skips, each tied to the user's source line."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from hlopass import internals as jx


def source_line(eqn) -> str:
    """``file.py:LINE (function)`` of the user code that produced ``eqn``, or ``<unknown>``."""
    frame = jx.user_frame(eqn.source_info.traceback)
    if frame is None:
        return "<unknown>"
    return f"{os.path.basename(frame.file_name)}:{frame.start_line} ({frame.function_name})"


@dataclasses.dataclass
class Rewrite:
    """One change a pass made: ``summary`` for people, ``details`` for programs."""

    pass_name: str
    kind: str
    location: str
    summary: str
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        return f"[{self.pass_name}] {self.location}: {self.summary}"


@dataclasses.dataclass
class Skip:
    """Something a pass looked at and left alone, with the reason (unknown primitive, unsafe op...)."""

    pass_name: str
    location: str
    primitive: str
    reason: str

    def __str__(self) -> str:
        return f"[{self.pass_name}] {self.location}: left {self.primitive} alone: {self.reason}"


@dataclasses.dataclass(frozen=True)
class Note:
    """A finding a pass made outside the pipeline (while the user's function was traced, or before
    JAX linearised it), carried with the program to the pass's report.

    ``kind`` is a rewrite kind, or ``"skip"`` for something left alone (``primitive`` names it);
    ``details`` are ``(key, value)`` pairs for programs (a tuple, so that notes stay hashable).
    """

    pass_name: str
    kind: str
    location: str
    summary: str
    primitive: str = ""
    details: tuple = ()


@dataclasses.dataclass
class PassReport:
    """Everything one pass did to one jaxpr."""

    name: str
    rewrites: list[Rewrite] = dataclasses.field(default_factory=list)
    skipped: list[Skip] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    #: ``False`` when the pipeline did not run the pass: it said it could not change the program
    #: (:meth:`~hlopass.pass_base.Pass.applies`), or the pipeline's result came from the
    #: persistent cache (:mod:`hlopass.program_cache`); notes made while tracing are still here
    ran: bool = True

    def rewrite(self, kind: str, eqn_or_location, summary: str, **details) -> Rewrite:
        """Record a rewrite anchored at an equation (or a location string)."""
        location = eqn_or_location if isinstance(eqn_or_location, str) else source_line(eqn_or_location)
        entry = Rewrite(self.name, kind, location, summary, details)
        self.rewrites.append(entry)
        return entry

    def add_note(self, note: Note) -> None:
        """Record a :class:`Note` as a rewrite or a skip."""
        if note.kind == "skip":
            self.skipped.append(Skip(self.name, note.location, note.primitive, note.summary))
        else:
            self.rewrites.append(Rewrite(self.name, note.kind, note.location, note.summary, dict(note.details)))

    def skip(self, eqn_or_location, primitive: str, reason: str) -> Skip:
        """Record something left alone and why."""
        location = eqn_or_location if isinstance(eqn_or_location, str) else source_line(eqn_or_location)
        entry = Skip(self.name, location, primitive, reason)
        self.skipped.append(entry)
        return entry


@dataclasses.dataclass
class Comparison:
    """The passes changed a program but could not bound it (values above the threshold remain):
    XLA's figures for the rewritten and the original program, and which one was kept.

    ``blocked`` lists the values above the threshold left in the rewritten program, ``reasons`` what
    the passes said (their skips) at those source lines.
    """

    kept: str
    rewritten_bytes: int
    original_bytes: int
    rewritten_compile_s: float | None = None
    original_compile_s: float | None = None
    blocked: list[str] = dataclasses.field(default_factory=list)
    reasons: list[str] = dataclasses.field(default_factory=list)

    def line(self) -> str:
        """One line: the footprints and compile times of both programs."""
        from hlopass.sizes import format_size

        def seconds(s):
            return "?" if s is None else f"{s:.2f} s"
        return (f"XLA footprint rewritten {format_size(self.rewritten_bytes)}, original "
                f"{format_size(self.original_bytes)}; compile rewritten {seconds(self.rewritten_compile_s)}, "
                f"original {seconds(self.original_compile_s)}")

    def __str__(self) -> str:
        lines = [f"  not bounded by the passes: kept the {self.kept} program ({self.line()})"]
        if self.blocked:
            lines.append("  values above the threshold left after the passes:")
            lines.extend(f"    {b}" for b in self.blocked)
            lines.append("  what the passes said at those lines:" if self.reasons else
                         "  no pass reported on those lines")
            lines.extend(f"    {r}" for r in self.reasons)
        return "\n".join(lines)


@dataclasses.dataclass
class PipelineReport:
    """The reports of every pass run on one jaxpr, in order."""

    label: str
    config_line: str
    passes: list[PassReport] = dataclasses.field(default_factory=list)
    equations_before: int = 0
    equations_after: int = 0
    largest_before: list[tuple[str, int, str]] = dataclasses.field(default_factory=list)
    largest_after: list[tuple[str, int, str]] = dataclasses.field(default_factory=list)
    #: set once XLA's figures decided between the rewritten and the original program
    comparison: Comparison | None = None
    #: the passes did not run in this process: an earlier one's decision and report were read from
    #: the persistent cache (:mod:`hlopass.program_cache`)
    from_cache: bool = False

    @property
    def rewrites(self) -> list[Rewrite]:
        return [r for p in self.passes for r in p.rewrites]

    @property
    def skipped(self) -> list[Skip]:
        return [s for p in self.passes for s in p.skipped]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view."""
        return {
            "label": self.label,
            "config": self.config_line,
            "equations_before": self.equations_before,
            "equations_after": self.equations_after,
            "passes": [dataclasses.asdict(p) for p in self.passes],
            "largest_before": self.largest_before,
            "largest_after": self.largest_after,
            "comparison": dataclasses.asdict(self.comparison) if self.comparison else None,
            "from_cache": self.from_cache,
        }

    def __str__(self) -> str:
        from hlopass.sizes import format_size
        lines = [f"hlopass report for {self.label}", f"  {self.config_line}",
                 f"  equations: {self.equations_before} -> {self.equations_after}"]
        if self.from_cache:
            lines.append("  (the passes' decision and this report come from the persistent cache)")
        for p in self.passes:
            ran = f"{p.seconds * 1e3:.1f} ms" if p.ran else "not run (nothing for it to do)"
            lines.append(f"  pass {p.name}: {len(p.rewrites)} rewrite(s), {len(p.skipped)} skipped, {ran}")
            lines.extend(f"    - {r.location}: {r.summary}" for r in p.rewrites)
            lines.extend(f"    ~ {s.location}: left {s.primitive} alone: {s.reason}" for s in p.skipped)
        for title, rows in (("largest tensors before", self.largest_before), ("largest tensors after", self.largest_after)):
            if rows:
                lines.append(f"  {title}:")
                lines.extend(f"    {format_size(n):>10}  {ty}  {loc}" for ty, n, loc in rows)
        if self.comparison is not None:
            lines.append(str(self.comparison))
        return "\n".join(lines)
