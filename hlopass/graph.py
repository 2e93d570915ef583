"""A dataflow view of one jaxpr level for analyses (networkx); rewriting never goes through it."""

from __future__ import annotations

from typing import Iterable

import networkx as nx
from jax._src import core

from hlopass.jaxpr_utils import aval_nbytes, aval_str
from hlopass.report import source_line


class DataflowGraph:
    """Def-use graph over the equations of one jaxpr level.

    Nodes are equation indices; an edge ``i -> j`` carries the variables that
    equation ``j`` reads from equation ``i``. Node attributes: ``eqn``,
    ``primitive``, ``out_bytes`` (largest output), ``source``.
    """

    def __init__(self, closed: core.ClosedJaxpr | core.Jaxpr):
        self.jaxpr = getattr(closed, "jaxpr", closed)
        self.graph = nx.DiGraph()
        self.producer: dict[core.Var, int] = {}
        self.consumers: dict[core.Var, list[int]] = {}
        for i, eqn in enumerate(self.jaxpr.eqns):
            self.graph.add_node(i, eqn=eqn, primitive=eqn.primitive.name,
                                out_bytes=max((aval_nbytes(v.aval) for v in eqn.outvars), default=0))
            for var in eqn.outvars:
                self.producer[var] = i
            for atom in eqn.invars:
                if isinstance(atom, core.Var):
                    self.consumers.setdefault(atom, []).append(i)
                    src = self.producer.get(atom)
                    if src is not None:
                        self.graph.add_edge(src, i)
                        self.graph.edges[src, i].setdefault("vars", []).append(atom)
        self.outvars = {v for v in self.jaxpr.outvars if isinstance(v, core.Var)}

    def eqn(self, i: int) -> core.JaxprEqn:
        return self.jaxpr.eqns[i]

    def source(self, i: int) -> str:
        return source_line(self.jaxpr.eqns[i])

    def uses(self, var: core.Var) -> list[int]:
        """Indices of equations reading ``var`` (not counting the jaxpr's outputs)."""
        return self.consumers.get(var, [])

    def is_output(self, var) -> bool:
        return var in self.outvars

    def large_equations(self, threshold: int) -> list[int]:
        """Equations with an output larger than ``threshold`` bytes."""
        return [i for i, data in self.graph.nodes(data=True) if data["out_bytes"] > threshold]

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
