"""Progress of the passes: which pass runs, on which region, for how long.

The pipeline opens a :class:`Work` per program it runs the passes on (:func:`program`) and names
each pass as it starts (:meth:`Work.start_pass`); the engine names the region a pass works on
(:func:`at`: a sub-program entered, the regions a rewrite replaces). Nothing is said while the
passes are quick. Once one pass has run for :data:`AFTER_S` seconds, a background thread logs a
line at INFO through the ``hlopass`` logger naming the program, the pass and the region, again
every :data:`EVERY_S` seconds while it goes on; a program whose passes took longer than
:data:`AFTER_S` in all ends with a line giving each pass's time. :data:`listeners` are told of
every step in the tracing thread (``hlopass-dump`` draws its progress bar from them).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from typing import Callable, Iterator, Sequence, Union

logger = logging.getLogger("hlopass")

#: Seconds a pass runs before its progress is logged ("more than a few seconds").
AFTER_S = 3.0
#: Seconds between two progress lines about the same pass.
EVERY_S = 10.0

#: What a region is: its description, or a function that makes it (called only when shown).
Region = Union[str, Callable[[], str]]

#: Called as ``listener(work, event)`` with event ``"program"``, ``"pass"``, ``"region"`` or ``"done"``,
#: in the thread running the passes. A listener that raises is dropped from the call (logged at debug).
listeners: list[Callable[["Work", str], None]] = []


class Work:
    """The passes running on one program: its label, the passes, the one running and where."""

    def __init__(self, label: str, passes: Sequence[str]):
        self.label = label
        self.passes = tuple(passes)
        self.started = time.perf_counter()
        self.index = -1  # of the pass running
        self.pass_started = self.started
        self.seconds: dict[str, float] = {}
        self.logged_at: float | None = None
        self._regions: list[Region] = []

    @property
    def current_pass(self) -> str | None:
        return self.passes[self.index] if 0 <= self.index < len(self.passes) else None

    def region(self) -> str:
        """Where the running pass is, innermost region first named (``"the whole program"`` when unknown)."""
        for region in reversed(list(self._regions)):  # a copy: the watcher reads while passes run
            try:
                return region() if callable(region) else region
            except Exception:  # noqa: BLE001 - a description must never break anything
                continue
        return "the whole program"

    def start_pass(self, index: int) -> None:
        """Pass ``index`` of :attr:`passes` starts (the previous one, if any, is done)."""
        now = time.perf_counter()
        self._end_pass(now)
        self.index, self.pass_started, self.logged_at = index, now, None
        self._regions.clear()
        _notify(self, "pass")

    def _end_pass(self, now: float) -> None:
        name = self.current_pass
        if name is not None:
            self.seconds[name] = self.seconds.get(name, 0.0) + now - self.pass_started
            self.index = -1

    def line(self, now: float | None = None) -> str:
        """One line: the program, the pass running (k of n), for how long, where."""
        now = time.perf_counter() if now is None else now
        return (f"hlopass: {self.label}: pass {self.current_pass} ({self.index + 1} of {len(self.passes)}) "
                f"running for {now - self.pass_started:.0f} s, at {self.region()}")


_current: contextvars.ContextVar = contextvars.ContextVar("hlopass_progress", default=None)
_active: set[Work] = set()
_lock = threading.Lock()
_watcher: threading.Thread | None = None


@contextlib.contextmanager
def program(label: str, passes: Sequence[str]) -> Iterator[Work]:
    """The passes run on one program (the pipeline enters this around them)."""
    global _watcher
    work = Work(label, passes)
    token = _current.set(work)
    with _lock:
        _active.add(work)
        if _watcher is None or not _watcher.is_alive():
            _watcher = threading.Thread(target=_watch, name="hlopass-progress", daemon=True)
            _watcher.start()
    _notify(work, "program")
    try:
        yield work
    finally:
        now = time.perf_counter()
        work._end_pass(now)
        with _lock:
            _active.discard(work)
        _current.reset(token)
        total = now - work.started
        if total > AFTER_S:
            parts = ", ".join(f"{name} {s:.1f} s" for name, s in sorted(work.seconds.items(), key=lambda kv: -kv[1]))
            logger.info("hlopass: %s: the passes took %.1f s (%s)", work.label, total, parts)
        _notify(work, "done")


@contextlib.contextmanager
def at(region: Region) -> Iterator[None]:
    """The running pass works on ``region`` while inside (nested regions stack)."""
    work = _current.get()
    if work is None or work.index < 0:
        yield
        return
    work._regions.append(region)
    _notify(work, "region")
    try:
        yield
    finally:
        if work._regions and work._regions[-1] is region:
            work._regions.pop()


def _notify(work: Work, event: str) -> None:
    for listener in list(listeners):
        try:
            listener(work, event)
        except Exception as err:  # noqa: BLE001 - a progress display must never break the passes
            logger.debug("hlopass: progress listener %r failed: %s", listener, err)


def _watch() -> None:
    """Log a line for every pass running longer than :data:`AFTER_S` (every :data:`EVERY_S`)."""
    global _watcher
    while True:
        time.sleep(max(0.01, min(0.5, AFTER_S / 4)))
        now = time.perf_counter()
        with _lock:
            works = list(_active)
            if not works:
                _watcher = None
                return
        for work in works:
            if work.index < 0 or now - work.pass_started < AFTER_S:
                continue
            if work.logged_at is None or now - work.logged_at >= EVERY_S:
                work.logged_at = now
                logger.info("%s", work.line(now))
