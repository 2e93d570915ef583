"""A dataflow view of one jaxpr level for analyses (networkx); rewriting never goes through it."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import networkx as nx
from hlopass import internals as jx

from hlopass.jaxpr_utils import aval_nbytes, aval_str
from hlopass.report import source_line


class DataflowGraph:
    """Def-use view of the equations of one jaxpr level.

    ``producer`` and ``consumers`` map variables to equation indices; ``graph``
    is the networkx graph over equation indices (an edge ``i -> j`` when
    equation ``j`` reads a result of ``i``), built on first use: most analyses
    need only the two maps.
    """

    def __init__(self, closed: jx.ClosedJaxpr | jx.Jaxpr):
        self.jaxpr = getattr(closed, "jaxpr", closed)
        self.producer: dict[jx.Var, int] = {}
        self.consumers: dict[jx.Var, list[int]] = {}
        for i, eqn in enumerate(self.jaxpr.eqns):
            for atom in eqn.invars:
                if isinstance(atom, jx.Var):
                    self.consumers.setdefault(atom, []).append(i)
            for var in eqn.outvars:
                self.producer[var] = i
        self.outvars = {v for v in self.jaxpr.outvars if isinstance(v, jx.Var)}
        self._derived: dict = {}

    def derived(self, key, compute):
        """A fact about this graph that a pass computes once, ``compute(self)``, and reads often: kept
        with the graph under ``key`` (a name the pass owns), so it lives exactly as long as the graph."""
        if key not in self._derived:
            self._derived[key] = compute(self)
        return self._derived[key]

    @functools.cached_property
    def graph(self) -> nx.DiGraph:
        graph = nx.DiGraph()
        graph.add_nodes_from(range(len(self.jaxpr.eqns)))
        graph.add_edges_from((self.producer[var], j) for var, readers in self.consumers.items()
                             if var in self.producer for j in readers)
        return graph

    @functools.cached_property
    def successor_lists(self) -> list[list[int]]:
        """``successor_lists[i]``: the equations reading a result of equation ``i`` (no networkx)."""
        succ: list[set[int]] = [set() for _ in self.jaxpr.eqns]
        for var, readers in self.consumers.items():
            if var in self.producer:
                succ[self.producer[var]].update(readers)
        return [sorted(s) for s in succ]

    @functools.cached_property
    def predecessor_lists(self) -> list[list[int]]:
        """``predecessor_lists[j]``: the equations whose results equation ``j`` reads."""
        pred: list[list[int]] = [[] for _ in self.jaxpr.eqns]
        for i, readers in enumerate(self.successor_lists):
            for j in readers:
                pred[j].append(i)
        return pred

    #: Up to this many equations :meth:`between` reads a transitive closure kept as bit sets (two
    #: bits per pair of equations: 2 MB at 4,096); beyond, it searches.
    CLOSURE_LIMIT = 4096

    @functools.cached_property
    def _closure(self) -> tuple[list[int], list[int]]:
        """``(descendants, ancestors)``: for each equation, the set of the others as a bit mask."""
        n = len(self.jaxpr.eqns)
        bit = [1 << i for i in range(n)]
        descendants, ancestors = [0] * n, [0] * n
        for i in range(n - 1, -1, -1):
            mask = 0
            for j in self.successor_lists[i]:
                mask |= descendants[j] | bit[j]
            descendants[i] = mask
        for j in range(n):
            mask = 0
            for i in self.predecessor_lists[j]:
                mask |= ancestors[i] | bit[i]
            ancestors[j] = mask
        return descendants, ancestors

    def growing(self) -> "GrowingRegion":
        """A :class:`GrowingRegion` over this graph: :meth:`between` of a region that only grows,
        each call paying for the equations added since the last."""
        return GrowingRegion(self)

    def between(self, region: Iterable[int]) -> list[int]:
        """The equations outside ``region`` on a path that leaves it and re-enters it, in order:
        the descendants of the region that are also its ancestors.

        On programs up to :attr:`CLOSURE_LIMIT` equations that is two unions of bit masks. Beyond,
        two searches that stop at the region's span, since a jaxpr's equations are in dependency
        order and such an equation lies within it.
        """
        region = region if isinstance(region, (set, frozenset)) else set(region)
        if not region:
            return []
        if len(self.jaxpr.eqns) <= self.CLOSURE_LIMIT:
            descendants, ancestors = self._closure
            down = up = inside = 0
            for i in region:
                down |= descendants[i]
                up |= ancestors[i]
                inside |= 1 << i
            return list(_Bits(down & up & ~inside))
        lo, hi = min(region), max(region)
        succ, pred = self.successor_lists, self.predecessor_lists
        out = {j for i in region for j in succ[i] if j < hi and j not in region}
        stack = list(out)
        while stack:
            for j in succ[stack.pop()]:
                if j < hi and j not in out and j not in region:
                    out.add(j)
                    stack.append(j)
        if not out:
            return []
        back: set[int] = set()
        stack = [i for i in region]
        while stack:
            for j in pred[stack.pop()]:
                if j > lo and j not in back:
                    back.add(j)
                    stack.append(j)
        return sorted(out & back)

    def eqn(self, i: int) -> jx.JaxprEqn:
        return self.jaxpr.eqns[i]

    def source(self, i: int) -> str:
        return source_line(self.jaxpr.eqns[i])

    def uses(self, var: jx.Var) -> list[int]:
        """Indices of equations reading ``var`` (not counting the jaxpr's outputs)."""
        return self.consumers.get(var, [])

    def is_output(self, var) -> bool:
        return var in self.outvars

    def large_equations(self, threshold: int) -> list[int]:
        """Equations with an output larger than ``threshold`` bytes."""
        return [i for i, eqn in enumerate(self.jaxpr.eqns)
                if max((aval_nbytes(v.aval) for v in eqn.outvars), default=0) > threshold]

    def ancestors(self, i: int) -> set[int]:
        return nx.ancestors(self.graph, i)

    def descendants(self, i: int) -> set[int]:
        return nx.descendants(self.graph, i)

    def is_convex(self, region: Iterable[int]) -> bool:
        """True when no path leaves ``region`` and re-enters it."""
        region = set(region)
        outside_desc = set()
        for i in region:
            for succ in self.graph.successors(i):
                if succ not in region:
                    outside_desc.add(succ)
                    outside_desc |= nx.descendants(self.graph, succ)
        return not (outside_desc & region)

    def describe(self, i: int) -> str:
        eqn = self.jaxpr.eqns[i]
        outs = ", ".join(aval_str(v.aval) for v in eqn.outvars)
        return f"{eqn.primitive.name} -> {outs} at {self.source(i)}"


class GrowingRegion:
    """:meth:`DataflowGraph.between` for a region that gains equations between calls (a region
    grower's loop), told each equation as it is added (:meth:`add`): the masks of the region's
    descendants and ancestors are kept, not rebuilt each call."""

    def __init__(self, graph: DataflowGraph):
        self.graph = graph
        self.closure = graph._closure if len(graph.jaxpr.eqns) <= graph.CLOSURE_LIMIT else None
        self.count = 0
        self.down = self.up = self.inside = 0

    def add(self, i: int) -> None:
        """Equation ``i`` joined the region."""
        if self.closure is None or self.inside >> i & 1:
            return
        descendants, ancestors = self.closure
        self.down |= descendants[i]
        self.up |= ancestors[i]
        self.inside |= 1 << i
        self.count += 1

    def between(self, region: set[int]) -> Sequence[int]:
        """``graph.between(region)``, ``region`` being the equations added so far (listed only when
        more than the first is read: a grower mostly wants the first)."""
        if self.closure is None or len(region) != self.count:  # not told of every equation: search
            return self.graph.between(region)
        return _Bits(self.down & self.up & ~self.inside)


class _Bits(Sequence):
    """The set bits of a mask, in increasing order, as a sequence."""

    def __init__(self, mask: int):
        self.mask = mask
        self._listed: list[int] | None = None

    def __bool__(self) -> bool:
        return bool(self.mask)

    def __getitem__(self, k):
        if k == 0 and self.mask:
            return (self.mask & -self.mask).bit_length() - 1
        return self._list()[k]

    def __len__(self) -> int:
        return self.mask.bit_count()

    def __contains__(self, i) -> bool:
        return isinstance(i, int) and i >= 0 and bool(self.mask >> i & 1)

    def __iter__(self):
        return iter(self._list())

    def _list(self) -> list[int]:
        if self._listed is None:
            found, mask = [], self.mask
            while mask:
                low = mask & -mask
                found.append(low.bit_length() - 1)
                mask ^= low
            self._listed = found
        return self._listed
