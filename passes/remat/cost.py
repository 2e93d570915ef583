"""What recomputing an equation costs: a FLOP and byte count per equation, and the machine's
rates for both, measured.

:func:`eqn_counts` counts floating-point operations (``dot_general`` and
convolutions exactly, like XLA's ``cost_analysis``; elementwise ops one per
element, transcendental ones :data:`TRANSCENDENTAL_FLOPS`) and the bytes an
equation reads and writes, entering ``scan`` bodies (times their length),
``cond`` branches (the most expensive one) and call bodies. A ``while`` body
counts once (its trip count is unknown). :func:`rates` times a matrix
product and a memory-bound elementwise op on the default device once per
process; an equation's time is the larger of its FLOPs over the FLOP rate
and its bytes over the byte rate (a roofline). Only ratios between stages
matter to the schedule; the predicted extra time in the report uses the
absolute figure.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

from hlopass import internals as jx

from hlopass.families import ELEMENTWISE, INLINABLE
from hlopass.jaxpr_utils import aval_nbytes, call_body

#: FLOPs counted per element for transcendental elementwise functions (XLA counts them apart).
TRANSCENDENTAL_FLOPS = 8
TRANSCENDENTAL = frozenset("exp exp2 expm1 log log1p tanh logistic sin cos tan asin acos atan atan2 sinh cosh "
                           "asinh acosh atanh erf erfc erf_inv lgamma digamma pow rsqrt sqrt cbrt".split())


@dataclasses.dataclass(frozen=True)
class Counts:
    """Floating-point operations and bytes moved."""

    flops: float = 0.0
    bytes: float = 0.0

    def __add__(self, other: "Counts") -> "Counts":
        return Counts(self.flops + other.flops, self.bytes + other.bytes)

    def scaled(self, factor: float) -> "Counts":
        return Counts(self.flops * factor, self.bytes * factor)


def _elements(aval) -> int:
    shape = getattr(aval, "shape", ())
    return int(math.prod(shape)) if shape is not None else 0


def _dot_flops(eqn) -> float:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    batch = math.prod(lhs[d] for d in lb)
    contract = math.prod(lhs[d] for d in lc)
    lfree = math.prod(s for d, s in enumerate(lhs) if d not in lc and d not in lb)
    rfree = math.prod(s for d, s in enumerate(rhs) if d not in rc and d not in rb)
    return 2.0 * batch * contract * lfree * rfree


def _conv_flops(eqn) -> float:
    rhs = eqn.invars[1].aval.shape
    dn = eqn.params["dimension_numbers"]
    out_feature = dn.rhs_spec[0] if dn is not None else 0
    per_output = math.prod(s for d, s in enumerate(rhs) if d != out_feature)
    return 2.0 * _elements(eqn.outvars[0].aval) * per_output


def _io_bytes(eqn) -> float:
    return float(sum(aval_nbytes(v.aval) for v in eqn.invars if isinstance(v, jx.Var))
                 + sum(aval_nbytes(v.aval) for v in eqn.outvars))


def jaxpr_counts(jaxpr) -> Counts:
    """Sum of :func:`eqn_counts` over a jaxpr's equations."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = Counts()
    for eqn in jaxpr.eqns:
        total = total + eqn_counts(eqn)
    return total


def eqn_counts(eqn) -> Counts:
    """FLOPs and bytes of one equation (sub-jaxprs included, see the module docstring)."""
    name = eqn.primitive.name
    if name == "scan":
        return jaxpr_counts(eqn.params["jaxpr"]).scaled(eqn.params["length"])
    if name == "while":
        return jaxpr_counts(eqn.params["body_jaxpr"]) + jaxpr_counts(eqn.params["cond_jaxpr"])
    if name == "cond":
        branches = [jaxpr_counts(b) for b in eqn.params["branches"]]
        return max(branches, key=lambda c: (c.flops, c.bytes)) if branches else Counts()
    if name in INLINABLE:
        body = call_body(eqn)
        return jaxpr_counts(body) if body is not None else Counts(0.0, _io_bytes(eqn))
    io = _io_bytes(eqn)
    if name == "dot_general":
        return Counts(_dot_flops(eqn), io)
    if name == "conv_general_dilated":
        return Counts(_conv_flops(eqn), io)
    out = sum(_elements(v.aval) for v in eqn.outvars)
    if name in TRANSCENDENTAL:
        return Counts(float(TRANSCENDENTAL_FLOPS * out), io)
    if name in ELEMENTWISE:
        return Counts(float(out), io)
    if name.startswith("reduce_") or name in ("argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin"):
        return Counts(float(sum(_elements(v.aval) for v in eqn.invars)), io)
    return Counts(0.0, io)   # data movement: broadcasts, reshapes, slices, gathers...


@dataclasses.dataclass(frozen=True)
class Rates:
    """Measured throughput of the default device."""

    flops_per_second: float
    bytes_per_second: float

    def seconds(self, counts: Counts) -> float:
        return max(counts.flops / self.flops_per_second, counts.bytes / self.bytes_per_second)


def _best_of(fn, *args, repeats: int = 3) -> float:
    fn(*args).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best


@functools.lru_cache(maxsize=None)
def rates() -> Rates:
    """FLOP and byte rates of the default device, measured once per process (about a second on a
    2-core CPU): a 1024 x 1024 x 1024 float32 product and an elementwise sum of 16M floats."""
    import jax
    import numpy as np
    with jax.ensure_compile_time_eval():   # also when first needed while JAX traces
        n = 1024
        a = jax.device_put(np.ones((n, n), np.float32))
        matmul = jax.jit(lambda a, b: a @ b)
        flops = 2.0 * n ** 3 / _best_of(matmul, a, a)
        m = 1 << 24
        x = jax.device_put(np.ones((m,), np.float32))
        add = jax.jit(lambda x, y: x + y)
        moved = 3.0 * 4 * m / _best_of(add, x, x)
    return Rates(flops_per_second=flops, bytes_per_second=moved)


def eqns_seconds(eqns, machine: Rates | None = None) -> float:
    """Estimated time of running ``eqns`` (each a roofline of its FLOPs and bytes)."""
    machine = machine or rates()
    return sum(machine.seconds(eqn_counts(e)) for e in eqns)
