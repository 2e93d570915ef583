"""Analysis: what a program keeps from its forward pass for its backward pass, and the chain of
stages a recomputation schedule is chosen over.

Two kinds of program reach it:

* a differentiated program (``jax.grad`` inside the hlopass function): the
  equations JAX's transposition emitted carry ``transpose(...)`` in their
  name stack (the backward pass); a *residual* is a value an equation
  outside it defines and a backward equation reads. :func:`analyse` finds
  the forward equations the residuals depend on, the stacked residuals a
  forward ``scan`` hands to its transposed ``scan`` (:class:`ScanPair`), and
  cuts the forward equations into stages;
* a program JAX is about to differentiate (``jax.grad`` of a hlopass
  function): :func:`primal_chain` cuts all its equations into stages and
  estimates each stage's residuals by linearising it.

A *cut* at a boundary of the forward order is the set of values defined
before it and read by forward equations after it: what a recomputation of
the stages after it must start from. Boundaries with small cuts are kept,
up to ``max_stages`` stages (boundaries whose cut is large against the
smallest cut nearby are dropped first, then those between the cheapest
neighbouring stages).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Sequence

import numpy as np
from hlopass import internals as jx

from hlopass.families import ELEMENTWISE
from hlopass.jaxpr_utils import aval_nbytes, is_backward
from hlopass.report import source_line

from .cost import TRANSCENDENTAL, Rates, eqn_counts, jaxpr_counts
from .schedule import Chain


def backward_pass(eqns) -> list[bool]:
    """Which of ``eqns`` are the backward pass: those JAX's transposition emitted, less a gradient
    taken inside the forward pass. Such a gradient's equations are named ``transpose(...)`` too, but
    forward equations read them and feed the backward pass (their own results are residuals): they,
    and every equation they depend on, are forward computation. What reads the gradients and feeds
    no backward equation (an optimizer's update) changes nothing."""
    backward = [is_backward(e) for e in eqns]
    defined_backward = {v for e, b in zip(eqns, backward) if b for v in e.outvars}
    read_by_backward: set = set()
    forward_readers = []            # forward equations that read a backward value and feed the backward pass
    for i in range(len(eqns) - 1, -1, -1):
        eqn = eqns[i]
        if backward[i] or any(v in read_by_backward for v in eqn.outvars):
            read_by_backward.update(_vars(eqn.invars))
            if not backward[i] and any(v in defined_backward for v in _vars(eqn.invars)):
                forward_readers.append(i)
    needed = {v for i in forward_readers for v in _vars(eqns[i].invars)}
    for i in range(max(forward_readers, default=-1), -1, -1):
        if any(v in needed for v in eqns[i].outvars):
            backward[i] = False
            needed.update(_vars(eqns[i].invars))
    return backward


def keeps_residuals(closed) -> bool:
    """Whether some backward equation reads a value an equation outside the backward pass defines."""
    eqns = closed.jaxpr.eqns
    backward = backward_pass(eqns)
    if not any(backward):
        return False
    forward_values = {v for e, b in zip(eqns, backward) if not b for v in e.outvars}
    return any(isinstance(a, jx.Var) and a in forward_values for e, b in zip(eqns, backward) if b
               for a in e.invars)


def _vars(atoms) -> list:
    return [a for a in atoms if isinstance(a, jx.Var)]


def _bytes(vs) -> int:
    return sum(aval_nbytes(v.aval) for v in vs)


@dataclasses.dataclass
class ScanPair:
    """A forward ``scan`` whose stacked outputs (``residual_ys``: positions among its ys) only its
    transposed ``scan`` reads, as ``xs`` (``backward_xs``: for each such output, its positions
    among the backward scan's ``xs``)."""

    forward: int
    backward: int
    residual_ys: tuple[int, ...]
    backward_xs: dict[int, tuple[int, ...]]

    def forward_eqn(self, jaxpr):
        return jaxpr.eqns[self.forward]

    def length(self, jaxpr) -> int:
        return jaxpr.eqns[self.forward].params["length"]

    def chain(self, jaxpr, machine: Rates, group: int = 1) -> Chain:
        """The scan's steps as a uniform chain (``group`` steps per stage)."""
        eqn = jaxpr.eqns[self.forward]
        n, ncon, ncar = eqn.params["length"], jx.scan_num_consts(eqn.params), jx.scan_num_carry(eqn.params)
        ys = eqn.outvars[ncar:]
        step_res = sum(aval_nbytes(ys[k].aval) for k in self.residual_ys) // max(n, 1)
        carry = _bytes(_vars(eqn.invars[ncon:ncon + ncar])) or _bytes(eqn.outvars[:ncar])
        step_time = machine.seconds(jaxpr_counts(eqn.params["jaxpr"]))
        stages = -(-n // group)
        sizes = [min(group, n - s * group) for s in range(stages)]
        # a kept run of steps hands its last carry to the blocks after it as the scan's own carry
        # (not kept per step): no extra bytes per stored stage
        return Chain(time=tuple(step_time * g for g in sizes), residual=tuple(step_res * g for g in sizes),
                     extra=(0,) * stages, cut=(carry,) * (stages + 1))

    def store_all_bytes(self, jaxpr) -> int:
        eqn = jaxpr.eqns[self.forward]
        ys = eqn.outvars[jx.scan_num_carry(eqn.params):]
        return sum(aval_nbytes(ys[k].aval) for k in self.residual_ys)


@dataclasses.dataclass
class FlatChain:
    """Forward equations cut into stages: ``stages[l]`` (equation indices, program order) runs from
    boundary ``l`` to ``l + 1``; ``cuts[b]`` the values a recomputation starts from at boundary
    ``b``; ``residuals[l]`` the residuals stage ``l`` defines; ``chain`` their costs."""

    stages: list[list[int]]
    cuts: list[list[jx.Var]]
    residuals: list[list[jx.Var]]
    chain: Chain
    owner: dict                    # residual var -> stage
    derived: dict = dataclasses.field(default_factory=dict)   # residual var -> equation index (see derived_residuals)

    def store_all_bytes(self) -> int:
        return sum(self.chain.residual)


@dataclasses.dataclass
class Analysis:
    """What :func:`analyse` found in a differentiated program."""

    closed: jx.ClosedJaxpr
    backward: list[bool]
    residuals: set                 # flat residuals (scan pairs' stacked ones excluded)
    pairs: list[ScanPair]
    flat: FlatChain | None
    pinned: int                    # bytes of residuals kept alive anyway (outputs, later uses)

    @property
    def store_all_bytes(self) -> int:
        total = self.flat.store_all_bytes() if self.flat else 0
        return total + sum(p.store_all_bytes(self.closed.jaxpr) for p in self.pairs)


def analyse(closed: jx.ClosedJaxpr, machine: Rates, *, max_stages: int = 64) -> Analysis | None:
    """The residuals, scan pairs and forward chain of a differentiated program, or ``None`` when
    it has no backward pass (no equation from JAX's transposition)."""
    jaxpr = closed.jaxpr
    eqns = jaxpr.eqns
    backward = backward_pass(eqns)
    if not any(backward):
        return None
    producer: dict = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.outvars:
            producer[v] = i
    readers: dict = {}
    for i, eqn in enumerate(eqns):
        for pos, v in enumerate(eqn.invars):
            if isinstance(v, jx.Var):
                readers.setdefault(v, []).append((i, pos))
    first_backward = backward.index(True)
    outputs = {v for v in jaxpr.outvars if isinstance(v, jx.Var)}

    candidates = {v for i, eqn in enumerate(eqns) if backward[i] for v in _vars(eqn.invars)
                  if v in producer and not backward[producer[v]]}
    pinned = {v for v in candidates if v in outputs or any(
        not backward[i] and i > first_backward for i, _ in readers.get(v, ()))}
    pairs = _scan_pairs(eqns, backward, producer, readers, candidates - pinned)
    paired = {eqns[p.forward].outvars[jx.scan_num_carry(eqns[p.forward].params) + k]
              for p in pairs for k in p.residual_ys}
    residuals = candidates - pinned - paired

    flat = _flat_chain(eqns, backward, producer, residuals, machine, max_stages,
                       unrecomputable={p.forward for p in pairs}) if residuals else None
    return Analysis(closed=closed, backward=backward, residuals=residuals, pairs=pairs, flat=flat,
                    pinned=_bytes(pinned))


def _scan_pairs(eqns, backward, producer, readers, residuals) -> list[ScanPair]:
    pairs = []
    for b, eqn in enumerate(eqns):
        if not backward[b] or eqn.primitive.name != "scan":
            continue
        ncon, ncar = jx.scan_num_consts(eqn.params), jx.scan_num_carry(eqn.params)
        found: dict[int, dict[int, list[int]]] = {}
        for pos, v in enumerate(eqn.invars[ncon + ncar:]):
            if not isinstance(v, jx.Var) or v not in residuals:
                continue
            f = producer[v]
            fwd = eqns[f]
            if (fwd.primitive.name != "scan" or fwd.params["length"] != eqn.params["length"]
                    or fwd.params["reverse"] == eqn.params["reverse"]):
                continue
            if any(i != b or p < ncon + ncar for i, p in readers[v]):
                continue   # read elsewhere too (or as a constant): dropping it would free nothing
            fncar = jx.scan_num_carry(fwd.params)
            y = fwd.outvars.index(v) - fncar
            if y < 0:
                continue
            found.setdefault(f, {}).setdefault(y, []).append(pos)
        for f, ys in found.items():
            pairs.append(ScanPair(forward=f, backward=b, residual_ys=tuple(sorted(ys)),
                                  backward_xs={y: tuple(p) for y, p in ys.items()}))
    taken: set = set()
    unique = []
    for p in pairs:   # one backward scan per forward scan
        if p.forward not in taken:
            taken.add(p.forward)
            unique.append(p)
    return unique


def _flat_chain(eqns, backward, producer, residuals, machine, max_stages, unrecomputable) -> FlatChain | None:
    needed = set(residuals)
    forward: list[int] = []
    for i in range(len(eqns) - 1, -1, -1):
        if backward[i]:
            continue
        eqn = eqns[i]
        if any(v in needed for v in eqn.outvars):
            forward.append(i)
            needed.update(v for v in _vars(eqn.invars) if v in producer)
    forward.reverse()
    if not forward:
        return None
    recomputable = [not eqns[i].effects and i not in unrecomputable for i in forward]
    return build_chain([eqns[i] for i in forward], forward, residuals, machine, max_stages, recomputable)


def build_chain(eqns: Sequence, indices: Sequence[int], residuals, machine: Rates, max_stages: int,
                recomputable: Sequence[bool] | None = None, residual_bytes: dict | None = None) -> FlatChain:
    """Cut the equations ``eqns`` (in order; ``indices`` name them) into at most ``max_stages``
    stages at small cuts. ``residuals``: the values the backward pass reads (``residual_bytes``
    overrides their sizes: stage -> bytes, for estimates)."""
    n = len(eqns)
    position = {}
    for q, eqn in enumerate(eqns):
        for v in eqn.outvars:
            position[v] = q
    last_read = {}
    for q, eqn in enumerate(eqns):
        for v in _vars(eqn.invars):
            if v in position:
                last_read[v] = q
    # cut bytes at every boundary b (before eqns[b])
    delta = np.zeros(n + 2)
    delta_other = np.zeros(n + 2)        # the part that is not a residual (kept only for recomputing)
    for v, q in position.items():
        if v in last_read and last_read[v] > q:
            delta[q + 1] += aval_nbytes(v.aval)
            delta[last_read[v] + 1] -= aval_nbytes(v.aval)
            if v not in residuals:
                delta_other[q + 1] += aval_nbytes(v.aval)
                delta_other[last_read[v] + 1] -= aval_nbytes(v.aval)
    cut_bytes = np.cumsum(delta)[:n + 1]
    other_bytes = np.cumsum(delta_other)[:n + 1]
    seconds = [machine.seconds(eqn_counts(e)) for e in eqns]
    boundaries = _select_boundaries(cut_bytes, seconds, max_stages, other_bytes)
    stages_q = [list(range(a, b)) for a, b in zip(boundaries[:-1], boundaries[1:])]
    cuts = [[v for v, q in position.items() if q < b and last_read.get(v, -1) >= b] for b in boundaries]
    for c in cuts:
        c.sort(key=lambda v: position[v])
    owner = {v: l for l, qs in enumerate(stages_q) for q in qs for v in eqns[q].outvars if v in residuals}
    stage_res = [[v for q in qs for v in eqns[q].outvars if v in residuals] for qs in stages_q]
    res_set = set(residuals)
    derived = derived_residuals(eqns, res_set)
    if residual_bytes is not None:
        res_b = [int(residual_bytes.get(l, 0)) for l in range(len(stages_q))]
    else:
        res_b = [_bytes([v for v in r if v not in derived]) for r in stage_res]
    extra = [_bytes([v for v in cuts[l + 1] if v not in res_set]) for l in range(len(stages_q))]
    rec = recomputable if recomputable is not None else [not e.effects for e in eqns]
    chain = Chain(time=tuple(sum(seconds[q] for q in qs) for qs in stages_q), residual=tuple(res_b),
                  extra=tuple(extra), cut=tuple(_bytes(c) for c in cuts),
                  recomputable=tuple(all(rec[q] for q in qs) for qs in stages_q))
    return FlatChain(stages=[[indices[q] for q in qs] for qs in stages_q], cuts=cuts, residuals=stage_res,
                     chain=chain, owner=owner, derived={v: indices[q] for v, q in derived.items()})


def is_cheap(name: str) -> bool:
    """Elementwise primitives XLA duplicates into their consumers' fusions rather than keeping
    their results (not transcendental ones: XLA does not duplicate expensive ops)."""
    return name in ELEMENTWISE and name not in TRANSCENDENTAL


def _cheap(eqn) -> bool:
    return is_cheap(eqn.primitive.name) and not eqn.effects


def derived_residuals(eqns: Sequence, residuals: set) -> dict:
    """Residuals computed by one cheap elementwise equation from other residuals, program inputs
    and literals (``1 - tanh(x)`` next to ``tanh(x)``): XLA fuses them into the backward pass
    instead of keeping them, so they cost no memory, and a recomputation need not return them.
    Maps each to the position of its equation in ``eqns``."""
    position = {v: q for q, e in enumerate(eqns) for v in e.outvars}
    out = {}
    for q, eqn in enumerate(eqns):
        if len(eqn.outvars) != 1 or eqn.outvars[0] not in residuals or not _cheap(eqn):
            continue
        if all(not isinstance(a, jx.Var) or a not in position or a in residuals for a in eqn.invars):
            out[eqn.outvars[0]] = q
    return {v: q for v, q in out.items() if not any(a in out for a in eqns[q].invars if isinstance(a, jx.Var))}


def _select_boundaries(cut_bytes, seconds, max_stages: int, other_bytes=None) -> list[int]:
    """Boundaries ``0 = b_0 < ... < b_S = n``: interior ones dropped, those whose cut is largest
    against the smallest cut nearby first, then those whose cut holds most bytes that are not
    residuals (``other_bytes``: kept only to recompute from), then those between the cheapest
    neighbouring stages, until at most ``max_stages`` stages remain."""
    other = np.zeros(len(cut_bytes)) if other_bytes is None else np.asarray(other_bytes, dtype=np.float64)
    n = len(seconds)
    if n <= 1:
        return [0, n]
    left = list(range(-1, n))          # left[b]: previous kept boundary of b (b = 1..n-1)
    right = list(range(1, n + 2))
    stage_time = [0.0] * (n + 1)       # stage_time[b]: time of the stage starting at boundary b
    for b in range(n):
        stage_time[b] = seconds[b]
    alive = [True] * (n + 1)
    version = [0] * (n + 1)
    heap = []

    # a cut is judged against the smallest cut near it: the heaviest activations of an early,
    # wide layer are still that region's best places to cut
    window = max(2, n // max(max_stages, 1))
    padded = np.pad(np.asarray(cut_bytes, dtype=np.float64), window, mode="edge")
    local = np.min(np.lib.stride_tricks.sliding_window_view(padded, 2 * window + 1), axis=1)
    ratio = np.round(np.asarray(cut_bytes) / np.maximum(local, 1.0), 2)

    def push(b):
        version[b] += 1
        combined = stage_time[left[b]] + stage_time[b]
        heapq.heappush(heap, (-float(ratio[b]), -float(other[b]), combined, b, version[b]))

    for b in range(1, n):
        push(b)
    stages = n
    while stages > max_stages and heap:
        *_, b, ver = heapq.heappop(heap)
        if not alive[b] or ver != version[b]:
            continue
        alive[b] = False
        lb, rb = left[b], right[b]
        stage_time[lb] += stage_time[b]
        right[lb], left[rb] = rb, lb
        stages -= 1
        for nb in (lb, rb):
            if 0 < nb < n and alive[nb]:
                push(nb)
    return [b for b in range(n + 1) if b in (0, n) or alive[b]]


def stage_lines(eqns) -> list[str]:
    """Distinct source lines of ``eqns``, in order."""
    seen: list[str] = []
    for eqn in eqns:
        line = source_line(eqn)
        if line != "<unknown>" and line not in seen:
            seen.append(line)
    return seen


def group_size(n: int, max_stages: int) -> int:
    """Steps per stage so that a chain of ``n`` steps has at most ``max_stages`` stages."""
    return max(1, math.ceil(n / max_stages))
