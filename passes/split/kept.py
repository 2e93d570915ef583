"""Answers about jaxpr objects kept for the length of a split pass (:class:`Kept`).

The planner asks the same questions about the same values and equations in every round and for
every candidate (a value's bytes, an equation's dimension map); jaxpr objects are compared by
identity, so an answer is kept under the object's ``id`` together with the object itself (its id
cannot be reused while it is kept), and everything is let go when the pass ends.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable


class Kept:
    """``kept.get(obj, compute)``: ``compute(obj)``, computed once per object while :meth:`active`."""

    def __init__(self):
        self._local = threading.local()

    def get(self, obj, compute: Callable[[Any], Any]):
        answers = getattr(self._local, "answers", None)
        if answers is None:
            return compute(obj)
        hit = answers.get(id(obj))
        if hit is not None and hit[0] is obj:
            return hit[1]
        answer = compute(obj)
        answers[id(obj)] = (obj, answer)
        return answer

    @contextlib.contextmanager
    def active(self):
        """Keep answers (in this thread) until leaving; nested uses share the outer one's."""
        outer = getattr(self._local, "answers", None)
        self._local.answers = {} if outer is None else outer
        try:
            yield
        finally:
            self._local.answers = outer
