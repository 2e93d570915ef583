"""Contexts a pass may enter while ``hlopass.jit`` traces the user's function.

Most passes work on the traced jaxpr alone. A few need to act while the
program is being traced, before JAX's transformations have run (the HVP
rewrite swaps inner gradients that an outer gradient will differentiate for
ones whose VJP is forward-over-reverse). Such a pass registers a factory
``factory(config) -> context manager``; its context is entered around the
user's function only when the pass is enabled, in pipeline order.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

#: pass name -> factory(config) -> context manager entered while tracing
TRACE_HOOKS: dict[str, Callable[..., ContextManager]] = {}


def register_trace_hook(pass_name: str, factory: Callable[..., ContextManager]) -> None:
    """Enter ``factory(config)`` around the user's function while ``pass_name`` is enabled."""
    TRACE_HOOKS[pass_name] = factory


@contextlib.contextmanager
def tracing(config):
    """Enter the trace contexts of the enabled passes."""
    from hlopass.registry import get_pass
    with contextlib.ExitStack() as stack:
        for name in config.passes:
            if name not in TRACE_HOOKS:
                try:
                    get_pass(name)  # importing a pass module registers its hooks
                except Exception:  # noqa: BLE001 - the pipeline reports a pass that cannot load
                    continue
            factory = TRACE_HOOKS.get(name)
            if factory is not None:
                stack.enter_context(factory(config))
        yield
