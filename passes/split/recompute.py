"""Recomputing a large value once per stage of its consumers, so that each stage can be split alone.

A large value read by several equations joins them in one region. That fails when
one reader needs what another computes only after a reduction over the whole
value: the collapsed SGPR bound's ``A = L⁻¹ Kuf`` is reduced to ``A Aᵀ`` and its
gradient then multiplies ``A`` again by a matrix made from that sum; Sinkhorn's
cost matrix is reduced along rows for ``f`` and then read along columns with
``f``. One loop cannot do both ("that would take two passes").

:meth:`Staging.recompute` rewrites the jaxpr so that every *stage* of readers
reads its own copy of the value, computed again from the same small inputs:
a reader's stage is the number of reductions behind the values its chain of
large results meets (see :class:`_Stages`), and the copy is made of the
equations between the value and its small inputs (all with split rules, no
effects). Each copy then belongs to its own region and loop: two passes, each
within the split size. Values that are program outputs are left alone.

A level counts reductions whatever axis they reduce, so two levels may still be one pass (a
softmax split along its rows). The planner therefore tries *coarse* stages first, readers one
level apart sharing a copy and a later stage reading a copy already made, and the stages one by
one only where that leaves a region unsplit.
"""

from __future__ import annotations

import jax.numpy as jnp
from hlopass import internals as jx

from hlopass.families import CUMULATIVE, ELEMENTWISE
from hlopass.graph import DataflowGraph
from hlopass.jaxpr_utils import dce

from .rules import dim_map
from .shares import device_bytes


class Staging:
    """The stages of one jaxpr's large values (over ``large`` bytes; with ``online``, a floating
    ``reduce_max`` starts no stage, see :mod:`.online`), asked about one value after another: the
    planner tries each candidate's copies on the same program, and its dataflow graph and stages are
    built once for all of them."""

    def __init__(self, jaxpr: jx.Jaxpr, large: int, online: bool = False):
        self.jaxpr, self.large = jaxpr, large
        self.graph = DataflowGraph(jaxpr)
        self.stages = _Stages(jaxpr, self.graph, large, online)

    def values(self) -> list[jx.Var]:
        """Large values (not program outputs) read in more than one stage and recomputable from small
        values, in program order."""
        share = device_bytes(self.jaxpr)
        found = []
        for i, eqn in enumerate(self.jaxpr.eqns):
            for var in eqn.outvars:
                if isinstance(var, jx.DropVar) or share(var) <= self.large or self.graph.is_output(var):
                    continue
                if self.stages.later_readers(var) and _cone(self.jaxpr, self.graph, i, self.large) is not None:
                    found.append(var)
        return found

    def recompute(self, closed: jx.ClosedJaxpr, var: jx.Var, origins: dict | None = None,
                  coarse: bool = False) -> jx.ClosedJaxpr:
        """``closed`` (whose jaxpr is this one) where the readers of ``var`` in later stages read a copy
        computed again (one copy per further stage); ``closed`` itself when there is nothing to copy.
        ``origins`` (updated) maps each copied value to the value of the program as written it copies.

        ``coarse``: stages one level apart are one stage (a softmax's rows are reduced and read again
        in one pass when split along the rows), and a stage that a copy of the same value made
        earlier in the program can serve reads that copy instead of a new one (a backward pass
        reading the probabilities both directly and through the product that used them)."""
        assert closed.jaxpr is self.jaxpr
        if var not in self.graph.producer:
            return closed
        groups = self.stages.later_stages(var, coarse)
        cone = _cone(self.jaxpr, self.graph, self.graph.producer[var], self.large) if groups else None
        if cone is None:
            return closed
        jaxpr = self.jaxpr
        if coarse and origins:
            jaxpr, groups = self._read_earlier_copies(var, groups, origins)
            if not groups:
                return dce(jx.ClosedJaxpr(jaxpr, closed.consts))
        return dce(jx.ClosedJaxpr(_with_copies(jaxpr, cone, groups, origins), closed.consts))

    def _read_earlier_copies(self, var, groups: list[list[int]], origins: dict):
        """The jaxpr where each group that a copy of ``var``'s value computed before it can serve reads
        that copy (the latest such), and the groups still to copy."""
        origin = origins.get(var, var)
        twins = sorted((self.graph.producer[w], w) for w, o in origins.items()
                       if o is origin and w is not var and w in self.graph.producer)
        rename_at, left = {}, []
        for group in groups:
            earlier = [w for at, w in twins if at < min(group)]
            if earlier:
                rename_at.update((j, earlier[-1]) for j in group)
            else:
                left.append(group)
        if not rename_at:
            return self.jaxpr, groups
        eqns = [eqn.replace(invars=[rename_at[k] if a is var else a for a in eqn.invars]) if k in rename_at else eqn
                for k, eqn in enumerate(self.jaxpr.eqns)]
        return self.jaxpr.replace(eqns=eqns), left


class _Stages:
    """Stages of a jaxpr's equations.

    A value's *level* counts the reductions of large values behind it: an equation that reads a
    large value and defines only small ones (a reduction) adds one. A reader of a large value works
    at the highest level of the values its chain of large results meets (the equations a region
    grown from it would take in); readers at different levels are different stages.
    """

    def __init__(self, jaxpr: jx.Jaxpr, graph: DataflowGraph, large: int, online: bool = False):
        self.jaxpr, self.graph, self.large = jaxpr, graph, large
        share = device_bytes(jaxpr)
        self.large_values = {v for v in (*jaxpr.constvars, *jaxpr.invars) if share(v) > large}
        self.large_values.update(v for eqn in jaxpr.eqns for v in eqn.outvars
                                 if not isinstance(v, jx.DropVar) and share(v) > large)
        self.level: dict = {}
        for eqn in jaxpr.eqns:
            here = max((self.level.get(a, 0) for a in eqn.invars if isinstance(a, jx.Var)), default=0)
            reduces = any(self._large(a) for a in eqn.invars) and not any(self._large(v) for v in eqn.outvars)
            if online and eqn.primitive.name == "reduce_max" and jnp.issubdtype(eqn.outvars[0].aval.dtype,
                                                                                jnp.floating):
                reduces = False
            for var in eqn.outvars:
                self.level[var] = here + 1 if reduces else here
        # The highest level met by each equation and, transitively, by the readers of its large results
        # (equations are in dependency order, so readers come later: one backward sweep).
        self.meets: list[int] = [0] * len(jaxpr.eqns)
        for i in reversed(range(len(jaxpr.eqns))):
            eqn = jaxpr.eqns[i]
            best = max((self.level.get(a, 0) for a in eqn.invars if isinstance(a, jx.Var)), default=0)
            for var in eqn.outvars:
                if self._large(var):
                    best = max([best] + [self.meets[j] for j in graph.uses(var)])
            self.meets[i] = best

    def _large(self, atom) -> bool:
        return isinstance(atom, jx.Var) and atom in self.large_values

    def later_readers(self, var) -> list[int]:
        """Readers of ``var`` in a later stage than its first."""
        return [j for group in self.later_stages(var) for j in group]

    def later_stages(self, var, coarse: bool = False) -> list[list[int]]:
        """Readers of ``var`` in each stage after its first (in order of stage, each in program order).
        ``coarse``: stages one level apart are one (a reduction that keeps the axis its next reader
        is split along, as a softmax's row sums, needs no second pass; where it does need one, the
        planner's trial fails and the stages are tried one by one)."""
        readers = sorted(set(self.graph.uses(var)))
        if len(readers) < 2:
            return []
        stages: dict[int, list[int]] = {}
        for j in readers:
            stages.setdefault(self.meets[j], []).append(j)
        groups, last = [], None
        for level in sorted(stages):
            if coarse and last is not None and level == last + 1:
                groups[-1] = sorted(groups[-1] + stages[level])
            else:
                groups.append(stages[level])
            last = level
        return groups[1:]


def _cone(jaxpr: jx.Jaxpr, graph: DataflowGraph, i: int, large: int) -> list[int] | None:
    """Equations computing the outputs of equation ``i`` back to small values or to the results of
    cumulative ops (``None`` if one of them cannot be recomputed: no split rule, or effects; or if
    ``i`` is a cumulative op). A cumulative op is computed once and read by every stage: a copy
    carried through a loop rounds its running total otherwise than the whole op, and a softmax
    normalised in one stage and exponentiated in another would no longer sum to one (fresh seed
    r73655148886)."""
    if jaxpr.eqns[i].primitive.name in CUMULATIVE:
        return None
    cone, stack = set(), [i]
    share = device_bytes(jaxpr)
    while stack:
        j = stack.pop()
        if j in cone:
            continue
        eqn = jaxpr.eqns[j]
        if eqn.effects or dim_map(eqn) is None:
            return None
        cone.add(j)
        for atom in eqn.invars:
            producer = graph.producer.get(atom) if isinstance(atom, jx.Var) else None
            if producer is not None and jaxpr.eqns[producer].primitive.name not in CUMULATIVE and (
                    share(atom) > large or _elementwise_of_large(jaxpr.eqns[producer], large, share)):
                stack.append(producer)
    return sorted(cone)


def _elementwise_of_large(eqn, large: int, share) -> bool:
    """A small value computed element by element from a large one (a boolean mask from a large ``iota``):
    copied with its stage, so that no large value stays shared between two stages."""
    return eqn.primitive.name in ELEMENTWISE and any(
        isinstance(a, jx.Var) and share(a) > large for a in eqn.invars)


def _with_copies(jaxpr: jx.Jaxpr, cone: list[int], groups: list[list[int]], origins: dict | None = None) -> jx.Jaxpr:
    """``jaxpr`` where each group of readers reads its own fresh copy of the ``cone`` equations'
    results, placed just before the group's first reader."""
    copies_at: dict[int, list] = {}
    rename_of: dict[int, dict] = {}
    for group in groups:
        rename: dict = {}
        copies = copies_at.setdefault(min(group), [])
        for j in cone:
            eqn = jaxpr.eqns[j]
            outvars = [v if isinstance(v, jx.DropVar) else jx.Var(v.aval) for v in eqn.outvars]
            rename.update((old, new) for old, new in zip(eqn.outvars, outvars) if not isinstance(old, jx.DropVar))
            if origins is not None:
                origins.update((new, origins.get(old, old)) for old, new in zip(eqn.outvars, outvars)
                               if not isinstance(old, jx.DropVar))
            invars = [rename.get(a, a) if isinstance(a, jx.Var) else a for a in eqn.invars]
            copies.append(eqn.replace(invars=invars, outvars=outvars))
        rename_of.update((k, rename) for k in group)
    eqns = []
    for k, eqn in enumerate(jaxpr.eqns):
        eqns.extend(copies_at.get(k, ()))
        rename = rename_of.get(k)
        if rename is not None:
            eqn = eqn.replace(invars=[rename.get(a, a) if isinstance(a, jx.Var) else a for a in eqn.invars])
        eqns.append(eqn)
    return jaxpr.replace(eqns=eqns)
