"""The adjoint method for linear recurrences: gradients of state space models without every state.

Matches: in a program that is differentiated in reverse mode (``jax.grad``
inside a hlopass function, or ``jax.grad`` of one), a ``lax.scan`` whose carry
is updated linearly in itself: ``h' = a * h + b`` (diagonal, ``a`` real or
complex, as in S4D/S5/Mamba), or ``h' = A h + b`` (dense, ``A`` shared or per
step), where ``a``, ``b``, ``A`` and the readout may depend on the step's
inputs (selective models) and on parameters; the same written as a Python
loop (a chain of at least 8 unrolled steps, rolled back into a scan first:
:mod:`.chains`). Linearity is checked on the
scan body's jaxpr: the carry's tangent map (a JVP of the body) must not read
the carry (:mod:`.recurrence`); a carry that is an elementwise multiple of
itself is diagonal, anything else linear is dense. Also ``lax.associative_scan``
with the combine of ``h_t = a_t h_{t-1} + b_t`` (:mod:`.associative`, checked
numerically), and, around the scans, the *time region* (:mod:`.stack`): the
equations that act on each row of the time axis alone (embedding lookups,
residual ``tanh``, projections, row-wise ``log_softmax``), the other layers'
recurrences of the same length, and sums over time that end it (the loss).

Emits: for a time region, one ``lax.scan`` over chunks of K rows whose body
(under ``jax.checkpoint``) runs the region on the chunk, each recurrence in it
an adjoint scan of the chunk, the carry being the layers' states and the
running sums: JAX backpropagates across layers chunk by chunk and keeps only
the states at chunk boundaries, so memory no longer grows with T times the
width (stacked layers: backpropagation across layers as usual, the adjoint
along time within a layer). K balances the states kept at the boundaries
against a chunk's bytes, measured per step on the jaxpr, at most an eighth of
``config.memory_limit`` for the chunk, a divisor of T where one is near;
``AdjointPass(chunk=K)`` fixes it. With ``AdjointPass(levels=2)`` (by default
where one level would keep more than a quarter of the memory limit) the chunks
run in about sqrt(T/K) groups, each group under ``jax.checkpoint`` too: the
states at group boundaries are kept, one group's chunk states recomputed in the
backward pass. A scan outside any region becomes a
``custom_vjp`` (:mod:`.emit`) whose forward pass keeps only the carry every K
steps and whose backward pass, chunk by chunk, recomputes the chunk's states,
solves the adjoint recursion ``mu_{t-1} = A_t^T mu_t + C_t^T g_t`` backwards
(an associative scan for a diagonal recurrence, sequential for a dense one)
and takes every step's VJP at once (batched over the chunk). With
``AdjointPass(sequence_axis="x")`` (or, under an ``Explicit`` mesh, when the
inputs' types cut the time axis along one mesh axis) a time region whose length
the mesh axis divides runs as a ``shard_map`` (:mod:`.sharded`): each device its T/D rows,
K at a time, the devices one after the other (stacked layers make a device's
incoming states depend on every layer of those before it), one set of states
passed per device boundary each way; a diagonal recurrence outside any region
runs on all devices at once (each device's rows from the states 0 and 1,
then from its incoming state). Gradients equal ``jax.grad`` of the program as written
up to floating-point reordering. The report (:mod:`.rewrite`) names each
recurrence (source line), its form, K, what it was chunked with and the
memory saved. ``AdjointPass(truncate=T)`` (opt-in, never with time regions or
sharding) stops the adjoint after at most T steps back: an approximate
gradient, said in the report; with checks on (``HLOPASS_CHECK_PASSES=1``) the
backward pass also computes the exact gradient and logs by how much the
truncated one differs (``truncation_errors``).

Leaves alone: scans whose carry update is not linear in the carry
(``tanh(W h + x)``, a state feeding a comparison or a branch, a product of
the state with itself), integer or boolean carries (counters), reverse
scans, scans of no steps, scans with side effects, scans inside ``custom_jvp``/``custom_vjp``
bodies (JAX differentiates those by their rules) and programs never
differentiated in reverse mode: each such scan is named in the report with
the reason. Equations that mix rows of the time axis (a shift, a cumulative
sum over time, a transpose of it) end a time region. Other
``lax.associative_scan`` combines are called as written; a Python loop
whose rolled scan is not a linear recurrence is left unrolled, and named. Options on
a program whose gradient holds no scan are a report line; bad option values
a ``hlopass.ConfigError``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hlopass import internals as jx

from hlopass.config import Config
from hlopass.errors import ConfigError
from hlopass.jaxpr_utils import iter_eqns
from hlopass.pass_base import Pass
from hlopass.report import Note, PassReport

from .rewrite import NAME, linear_chains_only, rewrite_scans, truncation_errors
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
    #: Steps per chunk (K); ``None`` balances the states kept at chunk boundaries against a chunk's
    #: per-step bytes (about sqrt(T * carry / step)), fewer under the memory limit.
    chunk: int | None = None
    #: The mesh axis the time axis is sharded over; ``None``: the one the inputs' types cut it along
    #: under an ``Explicit`` mesh, else one device. See :mod:`.sharded`.
    sequence_axis: str | None = None
    #: The mesh holding ``sequence_axis``; ``None``: the one set with ``jax.set_mesh``.
    mesh: Any = None
    #: Levels of checkpointing in a time region: 1 keeps the states at every chunk boundary; 2 groups
    #: the chunks (about sqrt(T/K) groups) and keeps the states at group boundaries, recomputing a
    #: group's chunk states in the backward pass (one more forward pass, far fewer states kept).
    #: ``None``: 2 where one level would keep more than a quarter of the memory limit, else 1.
    levels: int | None = None

    def __post_init__(self):
        _positive_int("truncate", self.truncate)
        _positive_int("chunk", self.chunk)
        if self.levels is not None and (isinstance(self.levels, bool) or self.levels not in (1, 2)):
            raise ConfigError(f"AdjointPass option levels={self.levels!r} is invalid: accepted values are None "
                              f"(chosen from the memory limit), 1 or 2 (levels of checkpointing in a time region)")
        if self.sequence_axis is not None and (not isinstance(self.sequence_axis, str) or not self.sequence_axis):
            raise ConfigError(f"AdjointPass option sequence_axis={self.sequence_axis!r} is invalid: accepted "
                              f"values are None (one device) or the name of a mesh axis ('x')")
        if self.sequence_axis is not None and self.truncate is not None:
            raise ConfigError("AdjointPass options truncate= and sequence_axis= cannot be combined")


def _transposed_scan(eqn) -> bool:
    if eqn.primitive.name != "scan" or not eqn.params.get("reverse"):
        return False
    start = jx.scan_num_consts(eqn.params)
    carry = eqn.invars[start:start + jx.scan_num_carry(eqn.params)]
    dtypes = (getattr(v.aval, "dtype", None) for v in carry)
    return any(d is not None and jnp.issubdtype(d, np.inexact) for d in dtypes)


def _checks_on() -> bool:
    return os.environ.get("HLOPASS_CHECK_PASSES", "") not in ("", "0") or bool(jax.config.jax_enable_checks)


class AdjointPass(Pass):
    """Linear-recurrence scans get adjoint-method gradients (see the module docstring)."""

    name = NAME
    recursive = False
    Options = AdjointOptions
    provides = frozenset({"adjoint_recurrences"})

    def applies(self, closed: jx.ClosedJaxpr, config: Config, facts) -> bool:
        """Never at lowering time: the pass acts while tracing and before linearising."""
        return False

    def run(self, closed: jx.ClosedJaxpr, config: Config) -> tuple[jx.ClosedJaxpr, PassReport]:
        """Nothing at lowering time: the replacements were made while tracing or before linearising,
        and their notes are this pass's report."""
        return closed, PassReport(self.name)

    def _no_recurrence(self, closed_or_none, notes: list[Note]) -> None:
        if self.options != AdjointOptions() and not any(n.pass_name == NAME for n in notes):
            notes.append(Note(NAME, "skip", "<program>",
                              f"no scan in the differentiated program: options {self!r} have no effect",
                              "options"))

    def trace_context(self, config: Config, notes: list[Note]):
        """``jax.grad`` inside the hlopass function. With options given, every gradient is probed for
        linear recurrences while tracing (:meth:`retrace_context`); by default the function is traced
        as written (``lax.associative_scan`` recurrences excepted), and traced again, probed, only if
        the program JAX built holds a scan it differentiated (:meth:`wants_retrace`)."""
        if self.options != AdjointOptions():
            return self.retrace_context(config, notes)
        return intercept_associative(notes)

    def wants_retrace(self, closed: jx.ClosedJaxpr, config: Config) -> bool:
        """Whether ``closed`` (traced with default options) holds a transposed scan: a ``lax.scan``
        whose carry JAX differentiated in reverse mode runs backwards (``reverse=True``) with an
        inexact carry; or, in a program JAX differentiated in reverse mode (it accumulates
        cotangents with ``add_any``), a Python loop's chain of steps linear in its carry
        (:mod:`.chains`) with no chain of the same length that is not (the backward pass of any
        loop is linear in the cotangent it carries; a loop that is linear itself has a linear
        forward chain too). Any other program has no recurrence this pass would replace."""
        if self.options != AdjointOptions():
            return False
        names = set()
        for e in iter_eqns(closed.jaxpr):
            if _transposed_scan(e):
                return True
            names.add(e.primitive.name)
        return "add_any" in names and linear_chains_only(closed)   # add_any: a reverse-mode derivative

    @contextlib.contextmanager
    def retrace_context(self, config: Config, notes: list[Note]):
        """Linear recurrences in gradients taken inside the function get adjoint VJPs while tracing.
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
