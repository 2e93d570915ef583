"""The adjoint method for linear recurrences: gradients of state space models without every state.

Matches: in a program that is differentiated in reverse mode (``jax.grad``
inside a hlopass function, or ``jax.grad`` of one), a ``lax.scan`` whose carry
is updated linearly in itself: ``h' = a * h + b`` (diagonal, ``a`` real or
complex, as in S4D/S5/Mamba), or ``h' = A h + b`` (dense, ``A`` shared or per
step), where ``a``, ``b``, ``A`` and the readout may depend on the step's
inputs (selective models) and on parameters. Linearity is checked on the
scan body's jaxpr: the carry's tangent map (a JVP of the body) must not read
the carry (:mod:`.recurrence`); a carry that is an elementwise multiple of
itself is diagonal, anything else linear is dense.

Emits: a ``custom_vjp`` function (:mod:`.emit`) whose forward pass runs the
scan and keeps only the carry every K steps (K about sqrt(T), smaller under
``config.memory_limit``; ``AdjointPass(chunk=K)`` fixes it), and whose
backward pass, chunk by chunk, recomputes the chunk's states, solves the
adjoint recursion ``mu_{t-1} = A_t^T mu_t + C_t^T g_t`` backwards (an
associative scan for a diagonal recurrence, sequential for a dense one) and
takes every step's VJP with respect to its inputs and the parameters at once
(batched over the chunk). Gradients equal ``jax.grad`` of the program as
written up to floating-point reordering; across stacked layers JAX
backpropagates as usual. The report (:mod:`.rewrite`) names each recurrence
(source line), its form, K and the memory saved. ``AdjointPass(truncate=T)``
(opt-in) stops the adjoint after at most T steps back: an approximate
gradient, said in the report; with checks on (``HLOPASS_CHECK_PASSES=1``)
the backward pass also computes the exact gradient and logs by how much the
truncated one differs (``truncation_errors``).

Leaves alone: scans whose carry update is not linear in the carry
(``tanh(W h + x)``, a state feeding a comparison or a branch, a product of
the state with itself), integer or boolean carries (counters), reverse
scans, scans with side effects, scans inside ``custom_jvp``/``custom_vjp``
bodies (JAX differentiates those by their rules) and programs never
differentiated in reverse mode: each such scan is named in the report with
the reason. ``lax.associative_scan`` (already a log-depth tree of slices,
adds and multiplies, not a scan) and Python loops (unrolled chains) are not
matched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import jax
from hlopass import internals as jx

from hlopass.config import Config
from hlopass.errors import ConfigError
from hlopass.pass_base import Pass
from hlopass.report import Note, PassReport

from .rewrite import NAME, rewrite_scans, truncation_errors
from .associative import intercept as intercept_associative
from .trace import intercept_gradients

__all__ = ["AdjointPass", "AdjointOptions", "truncation_errors"]


def _positive_int(name: str, value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"AdjointPass option {name}={value!r} is invalid: accepted values are None "
                          f"(the default) or a positive integer number of steps (1, 2, ...)")


@dataclasses.dataclass(frozen=True)
class AdjointOptions:
    """Options of the adjoint pass (``AdjointPass(truncate=64)``)."""

    #: Stop the adjoint recursion after at most this many steps back (approximate gradient); ``None``
    #: for the exact gradient.
    truncate: int | None = None
    #: Steps per chunk (K); ``None`` chooses about sqrt(T), fewer under the memory limit.
    chunk: int | None = None

    def __post_init__(self):
        _positive_int("truncate", self.truncate)
        _positive_int("chunk", self.chunk)


def _checks_on() -> bool:
    return os.environ.get("HLOPASS_CHECK_PASSES", "") not in ("", "0") or bool(jax.config.jax_enable_checks)


class AdjointPass(Pass):
    """Linear-recurrence scans get adjoint-method gradients (see the module docstring)."""

    name = NAME
    recursive = False
    Options = AdjointOptions
    provides = frozenset({"adjoint_recurrences"})

    def run(self, closed: jx.ClosedJaxpr, config: Config) -> tuple[jx.ClosedJaxpr, PassReport]:
        """Nothing at lowering time: the replacements were made while tracing or before linearising,
        and their notes are this pass's report."""
        return closed, PassReport(self.name)

    def _no_recurrence(self, closed_or_none, notes: list[Note]) -> None:
        if self.options != AdjointOptions() and not any(n.pass_name == NAME for n in notes):
            notes.append(Note(NAME, "skip", "<program>",
                              f"no scan in the differentiated program: options {self!r} have no effect",
                              "options"))

    @contextlib.contextmanager
    def trace_context(self, config: Config, notes: list[Note]):
        """``jax.grad`` inside the hlopass function: linear recurrences get adjoint VJPs while tracing.
        Options given for a function whose gradients hold no scan are a report line."""
        with intercept_gradients(notes, config.memory_limit, self.options, _checks_on()) as differentiated, \
                intercept_associative(notes):
            yield
        if differentiated:
            self._no_recurrence(None, notes)

    def before_linearize(self, closed: jx.ClosedJaxpr, config: Config, notes: list[Note]) -> jx.ClosedJaxpr:
        """``jax.grad`` of a hlopass function: replace its linear recurrences before JAX linearises it."""
        found: list[Note] = []
        new = rewrite_scans(closed, config.memory_limit, self.options, found, _checks_on())
        self._no_recurrence(closed, found)
        notes.extend(found)
        return new
