"""Module attributes a pass replaces while it traces (:class:`Patches`): JAX's ``vjp`` for the
``hvp`` and ``adjoint`` passes.

The replacements are installed when the first thread enters :meth:`Patches.active` and restored
when the last one leaves (reference-counted, so nested and concurrent traces share them). Two
passes patching the same attribute compose: each wraps what it finds installed, and their
contexts are entered and left in stack order by the pipeline.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Sequence


class Patches:
    """``targets()`` names the ``(module, attribute)`` pairs; ``wrap(module, name, current)`` makes
    the replacement of each from the value installed when the patches go in."""

    def __init__(self, targets: Callable[[], Sequence[tuple[Any, str]]],
                 wrap: Callable[[Any, str, Callable], Callable]):
        self._targets, self._wrap = targets, wrap
        self._lock = threading.Lock()
        self._active = 0
        self._saved: list[tuple[Any, str, Any]] = []

    def originals(self) -> dict[str, Callable]:
        """The values the patches replaced, by attribute name (the first of each name)."""
        found: dict[str, Callable] = {}
        for _, name, original in self._saved:
            found.setdefault(name, original)
        return found

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The replacements installed for as long as any thread is inside."""
        with self._lock:
            if self._active == 0:
                for module, name in self._targets():
                    current = getattr(module, name)
                    self._saved.append((module, name, current))
                    setattr(module, name, self._wrap(module, name, current))
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    while self._saved:
                        module, name, original = self._saved.pop()
                        setattr(module, name, original)
