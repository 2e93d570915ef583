"""Checking a compiled program against the memory limit: XLA's figures for a program compiled on its own
(:func:`footprint`), a crude bound that can spare that compile (:func:`upper_bound`), and the checks a
pass leaves to a caller that compiles the whole program anyway (:func:`deferring_checks`)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import logging
from typing import Any, Callable, Sequence

import jax
from hlopass import internals as jx

from hlopass.errors import MemoryLimitError
from hlopass.jaxpr_utils import aval_nbytes, iter_eqns
from hlopass.sharding import mesh_of
from hlopass.sizes import format_size
from hlopass.stablehlo import TensorInfo, largest_tensors

logger = logging.getLogger("hlopass")


@dataclasses.dataclass
class MemoryCheck:
    """XLA's memory figures for one compiled program, against the limit."""

    label: str
    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    generated_code_bytes: int
    limit: int | None
    largest: list[TensorInfo] = dataclasses.field(default_factory=list)

    @property
    def footprint(self) -> int:
        """Temporaries plus arguments and outputs, less aliased (donated) buffers."""
        return self.temp_bytes + self.argument_bytes + self.output_bytes - self.alias_bytes

    @property
    def over_limit(self) -> bool:
        return self.limit is not None and self.footprint > self.limit

    def summary(self) -> str:
        return (f"{self.label}: footprint {format_size(self.footprint)} (temp {format_size(self.temp_bytes)}, "
                f"arguments {format_size(self.argument_bytes)}, outputs {format_size(self.output_bytes)}, "
                f"aliased {format_size(self.alias_bytes)}); limit {format_size(self.limit)}")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["footprint"] = self.footprint
        d["largest"] = [dataclasses.asdict(t) for t in self.largest]
        return d


def measure(compiled, lowered=None, limit: int | None = None, label: str = "function",
            list_largest: str = "always") -> MemoryCheck:
    """Read ``compiled.memory_analysis()``; list the largest tensors of ``lowered`` if given
    (``list_largest="over_limit"``: only when the program is over the limit, for the warning)."""
    analysis = compiled.memory_analysis()
    get = lambda name: int(getattr(analysis, name, 0) or 0)  # noqa: E731
    check = MemoryCheck(label=label, temp_bytes=get("temp_size_in_bytes"),
                        argument_bytes=get("argument_size_in_bytes"), output_bytes=get("output_size_in_bytes"),
                        alias_bytes=get("alias_size_in_bytes"),
                        generated_code_bytes=get("generated_code_size_in_bytes"), limit=limit)
    if lowered is not None and (list_largest == "always" or check.over_limit):
        check.largest = _largest(lowered, label)
    return check


def _largest(lowered, label: str) -> list[TensorInfo]:
    try:
        return largest_tensors(lowered.compiler_ir("stablehlo"))
    except Exception as err:  # noqa: BLE001 - the listing is a diagnostic only
        logger.debug("hlopass: could not walk StableHLO of %s: %s", label, err)
        return []


def enforce(check: MemoryCheck, strict: bool) -> None:
    """Warn (or, if ``strict``, raise ``MemoryLimitError``) when ``check`` is over its limit."""
    if not check.over_limit:
        return
    lines = [f"hlopass: {check.summary()} is over the memory limit."]
    if check.largest:
        lines.append("Largest tensors still present:")
        lines.extend(f"  {t}" for t in check.largest)
    lines.append("Lower HLOPASS_TENSOR_SIZE_THRESHOLD / HLOPASS_TENSOR_SPLIT_SIZE, or see hlopass-dump for what was rewritten.")
    message = "\n".join(lines)
    if strict:
        raise MemoryLimitError(message, check)
    logger.warning(message)


def footprint(closed: jx.ClosedJaxpr, shardings: Sequence[Any] | None = None, *, typed: bool = True,
              limit: int | None = None, label: str = "function") -> MemoryCheck:
    """Compile ``closed`` on its own and read XLA's memory figures (``.footprint``: temporaries plus
    arguments and outputs, less aliases).

    With ``shardings`` (one entry per input, ``None`` where unknown) the inputs are placed with them
    and the figures are one device's (the figure the memory limit bounds); the program is lowered
    under their mesh when it has explicit axes. An input without a sharding is lowered at its own
    type (an explicit sharding in it, its weak type), or with ``typed=False`` at its shape and dtype
    alone, as the passes measure (while a pass runs, an explicit type's mesh may be in no context).
    With a ``limit`` the check is made against it and, when over, lists the largest tensors (for the
    warning).
    """
    given = shardings if shardings is not None and len(shardings) == len(closed.in_avals) else None
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) if hasattr(a, "shape") and (s is not None or not typed)
            else a for a, s in zip(closed.in_avals, given or (None,) * len(closed.in_avals))]
    with mesh_of(shardings):  # explicit types need their mesh
        lowered = jax.jit(jx.jaxpr_as_fun(closed)).lower(*args)
    key = (jax.default_backend(), hashlib.sha256(lowered.as_text().encode()).digest())
    figures = _measured.pop(key, None) or measure(lowered.compile())
    _measured[key] = figures
    while len(_measured) > _MEASURED_KEPT:
        _measured.pop(next(iter(_measured)))
    check = dataclasses.replace(figures, label=label, limit=limit)
    if check.over_limit:
        check.largest = _largest(lowered, label)
    return check


#: XLA's figures for the last programs :func:`footprint` compiled, by their StableHLO text: the split
#: pass measures the program it emits, and the final check measures the same program again.
_measured: dict = {}
_MEASURED_KEPT = 16


#: The passes that took a program as fitting, leaving the check to the caller's compile, while
#: :func:`deferring_checks` is on; ``None`` while off.
_deferred: contextvars.ContextVar = contextvars.ContextVar("hlopass_deferred_checks", default=None)


@contextlib.contextmanager
def deferring_checks(enabled: bool):
    """Run the passes for a caller that compiles the whole program and measures it anyway
    (``hlopass.jit``'s checked call, ``Lowered.compile``): a pass that would compile its program
    only to confirm that it fits the limit takes it as fitting (:func:`defer_check`), and the caller
    runs the passes again, checking, when its measurement is over. Yields the passes that did
    (``None`` when not ``enabled``: nested lowerings check for themselves)."""
    token = _deferred.set([] if enabled else None)
    try:
        yield _deferred.get()
    finally:
        _deferred.reset(token)


def defer_check(pass_name: str) -> bool:
    """Whether ``pass_name`` may take the program it made as fitting the limit without compiling it
    (then it is recorded as having done so): only under :func:`deferring_checks`."""
    taken = _deferred.get()
    if taken is None:
        return False
    taken.append(pass_name)
    return True


def checks_deferred() -> tuple[str, ...]:
    """The passes that took their program as fitting so far in this run of the passes."""
    return tuple(_deferred.get() or ())


def upper_bound(closed, share: Callable[[Any], int] | None = None, *, own_values_only: bool = False) -> int:
    """A crude upper bound on the bytes a compiled ``closed`` can hold at once: its inputs and every
    value it defines, each counted once (a loop body's values once, as XLA reuses their buffers).

    ``share(var)``: the bytes one device holds of a value of the top level (its inputs and the values
    its own equations define; default: all of it), for a bound on one device. Its constants and the
    values of nested ``hlopass_call`` programs, compiled with it, count too, unless
    ``own_values_only`` (the passes bound only the inputs and values of the program they rewrite).
    """
    jaxpr = getattr(closed, "jaxpr", closed)
    whole = lambda v: aval_nbytes(v.aval)  # noqa: E731
    share = share or whole
    total = sum(share(v) for v in jaxpr.invars)
    if not own_values_only:
        total += sum(whole(v) for v in jaxpr.constvars)
    top = {id(eqn) for eqn in jaxpr.eqns} if share is not whole else set()
    for eqn in iter_eqns(jaxpr, into_own_programs=not own_values_only):
        count = share if id(eqn) in top else whole
        total += sum(count(v) for v in eqn.outvars)
    return total
