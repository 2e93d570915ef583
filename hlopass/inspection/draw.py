"""Pictures for the dump: the graph before and after the passes, and a memory timeline.

``draw_explanation(explanation, folder, "svg" | "png")`` writes

* ``graph_before.FMT`` and ``graph_after.FMT`` (graphviz): one node per
  equation, rewritten regions filled orange, tensors at or above the size
  threshold drawn as thick red edges labelled with their size (smaller ones
  from a sixteenth of it labelled with their size too), loops and
  other sub-jaxprs (``while``, ``scan``, ``cond``) as clusters, long chains
  of elementwise operations collapsed into one node, and small equations
  hidden when the graph is large (the size filter);
* ``memory.FMT`` (matplotlib): bytes live along the program before and after
  (:mod:`hlopass.inspection.liveness`), with XLA's own figures marked.

Both are optional (the ``plot`` extra installs them). The graph is laid out
by a Graphviz renderer: the system's ``dot`` program when there is one,
otherwise ``graphviz-pure`` (a statically linked port of ``dot`` on PyPI, in
the ``plot`` extra), found next to the running Python or on ``PATH``. A
missing tool produces a :class:`MissingToolWarning` naming what to install,
and the other picture is still drawn; the graph's DOT source is written
whenever the ``graphviz`` package is present, even without a renderer.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import warnings
from typing import Iterable

from hlopass import internals as jx

from hlopass.families import CONTROL_FLOW, ELEMENTWISE, INLINABLE, LOOPS
from hlopass.inspection.liveness import timeline
from hlopass.jaxpr_utils import aval_nbytes, aval_str, subjaxprs
from hlopass.report import source_line
from hlopass.sizes import format_size

#: Primitives drawn as a cluster holding their sub-jaxprs.
CLUSTER_PRIMITIVES = CONTROL_FLOW | INLINABLE | {"hlopass_call"}
LOOP_PRIMITIVES = LOOPS

#: Chains of at least this many elementwise equations are drawn as one node.
COLLAPSE_MIN = 3
#: Above this many nodes, the size filter hides the smallest equations.
MAX_NODES = 80
#: Sub-jaxprs are drawn this deep; deeper ones appear as their cluster's node only.
MAX_DEPTH = 3
#: Equations with outputs this small (scalar index arithmetic of loops) are hidden by default.
SCALAR_BYTES = 64

#: Graphviz renderers, in order of preference: the system's program, then the PyPI port.
RENDERERS = ("dot", "graphviz-pure")

REWRITTEN_FILL = "#ffb347"
LOOP_FILL = "#e8f0ff"
LARGE_EDGE = "#c0392b"


class MissingToolWarning(UserWarning):
    """A picture could not be drawn because an optional tool is not installed."""


@dataclasses.dataclass
class Node:
    """One box in the picture: an equation, a collapsed chain, an input or an output."""

    key: str
    label: str
    nbytes: int = 0
    highlighted: bool = False
    kind: str = "eqn"  # eqn | chain | cluster | input | output
    sub: list["Level"] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Level:
    """The drawable view of one jaxpr level: nodes and the edges between them."""

    title: str
    nodes: dict[str, Node]
    edges: dict[tuple[str, str], tuple[str, int]]  # (src, dst) -> (type text, bytes)


# -- building the view ---------------------------------------------------------------------

def _chains(jaxpr: jx.Jaxpr) -> dict[int, int]:
    """Map each equation index to the first equation of the elementwise chain it belongs to."""
    uses: dict[jx.Var, int] = {}
    for eqn in jaxpr.eqns:
        for atom in eqn.invars:
            if isinstance(atom, jx.Var):
                uses[atom] = uses.get(atom, 0) + 1
    outputs = {v for v in jaxpr.outvars if isinstance(v, jx.Var)}
    producer = {v: i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
    head = {i: i for i in range(len(jaxpr.eqns))}
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name not in ELEMENTWISE:
            continue
        parents = [producer[a] for a in eqn.invars if isinstance(a, jx.Var) and a in producer
                   and jaxpr.eqns[producer[a]].primitive.name in ELEMENTWISE]
        if len(parents) != 1:
            continue
        parent = parents[0]
        parent_outs = jaxpr.eqns[parent].outvars
        if all(uses.get(v, 0) == 1 and v not in outputs for v in parent_outs):
            head[i] = head[parent]
    return head


def build_level(jaxpr, title: str, rewritten_at: set[str], depth: int = 0, prefix: str = "n",
                inside_rewrite: bool = False) -> Level:
    """The drawable view of ``jaxpr``: chains collapsed, sub-jaxprs as nested levels.

    Equations at a source line in ``rewritten_at`` are highlighted, and so is
    everything inside a loop emitted there (``inside_rewrite``).
    """
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    nodes: dict[str, Node] = {}
    edges: dict[tuple[str, str], tuple[str, int]] = {}
    owner: dict[jx.Var, str] = {}
    for k, var in enumerate((*jaxpr.constvars, *jaxpr.invars)):
        key = f"{prefix}_in{k}"
        kind = "const" if k < len(jaxpr.constvars) else "input"
        nodes[key] = Node(key, f"{kind} {aval_str(var.aval)}", aval_nbytes(var.aval), kind="input")
        owner[var] = key
    head = _chains(jaxpr)
    members: dict[int, list[int]] = {}
    for i, h in head.items():
        members.setdefault(h, []).append(i)
    for i, eqn in enumerate(jaxpr.eqns):
        chain = members[head[i]] if len(members[head[i]]) >= COLLAPSE_MIN else [i]
        key = f"{prefix}_e{chain[0]}"
        location = source_line(eqn)
        out_bytes = max((aval_nbytes(v.aval) for v in eqn.outvars), default=0)
        if key not in nodes:
            nodes[key] = _equation_node(key, eqn, location, chain, depth, rewritten_at, inside_rewrite)
        node = nodes[key]
        node.nbytes = max(node.nbytes, out_bytes)
        node.highlighted |= inside_rewrite or location in rewritten_at
        if len(chain) >= COLLAPSE_MIN and i == chain[-1]:
            names = [jaxpr.eqns[j].primitive.name for j in chain]
            outs = ", ".join(aval_str(v.aval) for v in eqn.outvars)
            node.label = f"{len(chain)} elementwise ops\n{_abbreviate(names)}\n-> {outs}\n{location}"
        for atom in eqn.invars:
            src = owner.get(atom) if isinstance(atom, jx.Var) else None
            if src is not None and src != key:
                edges[(src, key)] = (aval_str(atom.aval), aval_nbytes(atom.aval))
        for var in eqn.outvars:
            owner[var] = key
    out_key = f"{prefix}_out"
    nodes[out_key] = Node(out_key, "outputs", kind="output")
    for atom in jaxpr.outvars:
        src = owner.get(atom) if isinstance(atom, jx.Var) else None
        if src is not None:
            edges[(src, out_key)] = (aval_str(atom.aval), aval_nbytes(atom.aval))
    return Level(title, nodes, edges)


def _equation_node(key, eqn, location, chain, depth, rewritten_at, inside_rewrite) -> Node:
    outs = ", ".join(aval_str(v.aval) for v in eqn.outvars)
    name = eqn.primitive.name
    if len(chain) >= COLLAPSE_MIN:
        return Node(key, name, kind="chain")
    subs = list(subjaxprs(eqn))
    if subs and name in CLUSTER_PRIMITIVES:
        title = f"{'loop: ' if name in LOOP_PRIMITIVES else ''}{name}{_loop_extent(eqn)}\n-> {outs}\n{location}"
        node = Node(key, title, kind="cluster")
        if depth < MAX_DEPTH:
            new_loop = inside_rewrite or location in rewritten_at
            node.sub = [build_level(sub, f"{name} body {k}" if len(subs) > 1 else f"{name} body",
                                    rewritten_at, depth + 1, f"{key}_{k}", new_loop) for k, sub in enumerate(subs)]
        return node
    return Node(key, f"{name}\n-> {outs}\n{location}")


def _loop_extent(eqn) -> str:
    length = eqn.params.get("length")
    return f" ({length} iterations)" if length is not None else ""


def _abbreviate(names: list[str], keep: int = 6) -> str:
    if len(names) <= keep:
        return " > ".join(names)
    return " > ".join(names[:keep // 2] + ["..."] + names[-keep // 2:])


def auto_min_bytes(level: Level, max_nodes: int = MAX_NODES) -> int:
    """The size filter: the smallest power-of-ten byte size (at least :data:`SCALAR_BYTES`, which
    hides scalar loop bookkeeping) that leaves at most ``max_nodes`` visible nodes."""
    sizes = [n.nbytes for n in _all_nodes(level) if n.kind in ("eqn", "chain")]
    total = sum(1 for _ in _all_nodes(level))
    threshold = SCALAR_BYTES
    while total - sum(1 for s in sizes if s < threshold) > max_nodes and threshold < 10**13:
        threshold = 1000 if threshold < 1000 else threshold * 10
    return threshold


def _all_nodes(level: Level) -> Iterable[Node]:
    for node in level.nodes.values():
        yield node
        for sub in node.sub:
            yield from _all_nodes(sub)


def filter_small(level: Level, min_bytes: int) -> Level:
    """Hide equations whose outputs are all under ``min_bytes``, keeping reachability through them."""
    import networkx as nx
    def keep(node: Node) -> bool:
        return (node.kind not in ("eqn", "chain") or node.nbytes >= min_bytes
                or (node.highlighted and node.nbytes > SCALAR_BYTES))

    graph = nx.DiGraph()
    graph.add_nodes_from(level.nodes)
    for (src, dst), data in level.edges.items():
        graph.add_edge(src, dst, data=data)
    for key, node in level.nodes.items():
        if keep(node):
            continue
        preds, succs = list(graph.predecessors(key)), list(graph.successors(key))
        for p in preds:
            for s in succs:
                if not graph.has_edge(p, s):
                    graph.add_edge(p, s, data=graph.edges[key, s]["data"], hidden=True)
        graph.remove_node(key)
    nodes = {}
    for key in graph.nodes:
        node = dataclasses.replace(level.nodes[key])
        node.sub = [filter_small(sub, min_bytes) for sub in node.sub]
        nodes[key] = node
    edges = {(s, d): graph.edges[s, d]["data"] for s, d in graph.edges}
    hidden = len(level.nodes) - len(nodes)
    title = level.title + (f"  ({hidden} equations under {format_size(min_bytes)} hidden)" if hidden else "")
    return Level(title, nodes, edges)


# -- graphviz ------------------------------------------------------------------------------

def to_graphviz(level: Level, large_bytes: int | None):
    """A ``graphviz.Digraph`` of ``level`` (raises ``ImportError`` without the package)."""
    import graphviz
    graph = graphviz.Digraph(graph_attr={"rankdir": "TB", "fontname": "Helvetica", "label": level.title,
                                         "labelloc": "t", "fontsize": "16"},
                             node_attr={"shape": "box", "style": "rounded,filled", "fillcolor": "white",
                                        "fontname": "Helvetica", "fontsize": "10"},
                             edge_attr={"fontname": "Helvetica", "fontsize": "9", "color": "#555555"})
    _add_level(graph, level, large_bytes)
    return graph


def _add_level(graph, level: Level, large_bytes: int | None) -> None:
    for key, node in level.nodes.items():
        attrs = {"label": node.label}
        if node.kind in ("input", "output"):
            attrs.update(shape="ellipse", fillcolor="#eeeeee")
        if node.highlighted:
            attrs.update(fillcolor=REWRITTEN_FILL, penwidth="2")
        if node.kind == "cluster":
            with graph.subgraph(name=f"cluster_{key}") as cluster:
                cluster.attr(label=node.label.split("\n")[0], style="rounded,filled", fillcolor=LOOP_FILL,
                             color=REWRITTEN_FILL if node.highlighted else "#3366cc",
                             penwidth="3" if node.highlighted else "1", fontsize="11")
                cluster.node(key, **{**attrs, "shape": "box3d"})
                for k, sub in enumerate(node.sub):
                    with cluster.subgraph(name=f"cluster_{key}_{k}") as inner:
                        inner.attr(label=sub.title, style="dashed", color="#3366cc", fillcolor="white")
                        _add_level(inner, sub, large_bytes)
                        first_input = f"{key}_{k}_in0"
                        if first_input in sub.nodes:
                            inner.edge(key, first_input, style="dotted", arrowhead="none")
            continue
        graph.node(key, **attrs)
    for (src, dst), (type_text, nbytes) in level.edges.items():
        large = large_bytes is not None and nbytes >= large_bytes
        sized = large_bytes is not None and nbytes >= large_bytes // 16
        if large:
            graph.edge(src, dst, label=f"{type_text}\n{format_size(nbytes)}", color=LARGE_EDGE, penwidth="3",
                       fontcolor=LARGE_EDGE)
        else:
            graph.edge(src, dst, label=f"{type_text}\n{format_size(nbytes)}" if sized else type_text)


def find_renderer() -> str | None:
    """The path of a Graphviz renderer: ``dot`` on ``PATH``, else ``graphviz-pure`` next to the
    running Python (a virtual environment's ``bin/``) or on ``PATH``; ``None`` when there is neither."""
    for program in RENDERERS:
        for folder in (None, os.path.dirname(sys.executable)):
            found = shutil.which(program, path=folder)
            if found:
                return found
    return None


def render(source: str, fmt: str, renderer: str) -> bytes:
    """Lay out the DOT ``source`` with ``renderer`` (a ``dot``-compatible program) as ``fmt`` bytes."""
    result = subprocess.run([renderer, "-Kdot", f"-T{fmt}"], input=source.encode(), capture_output=True)
    if result.returncode != 0:
        raise RuntimeError(f"{renderer} -T{fmt} failed (exit {result.returncode}): "
                           f"{result.stderr.decode(errors='replace').strip()}")
    return result.stdout


def draw_graph(closed, path_stem: str, fmt: str, title: str, rewritten_at: set[str],
               large_bytes: int | None = None, min_bytes: int | None = None) -> list[str]:
    """Draw ``closed`` to ``path_stem.dot`` and ``path_stem.FMT``; returns the files written.

    ``min_bytes`` hides smaller equations (``None``: chosen so the graph stays readable).
    Raises ``ImportError`` without the ``graphviz`` package; warns (and writes only the
    ``.dot`` source) when no renderer is found (:func:`find_renderer`).
    """
    level = build_level(closed, title, rewritten_at)
    threshold = auto_min_bytes(level) if min_bytes is None else min_bytes
    if threshold:
        level = filter_small(level, threshold)
    graph = to_graphviz(level, large_bytes)
    written = [f"{path_stem}.dot"]
    with open(written[0], "w") as handle:
        handle.write(graph.source)
    renderer = find_renderer()
    if renderer is None:
        warnings.warn(f"hlopass: the graph picture needs a Graphviz renderer: the 'dot' program (e.g. apt-get "
                      f"install graphviz) or graphviz-pure (pip install graphviz-pure, or pip install "
                      f"hlopass[plot]); wrote only its source {written[0]}", MissingToolWarning, stacklevel=2)
        return written
    data = render(graph.source, fmt, renderer)
    with open(f"{path_stem}.{fmt}", "wb") as handle:
        handle.write(data)
    return written + [f"{path_stem}.{fmt}"]


# -- memory timeline -----------------------------------------------------------------------

def draw_memory_timeline(before, after, path: str, xla_before=None, xla_after=None, title: str = "") -> str:
    """Plot bytes live along the program before and after (fraction of the program on x).

    ``xla_before``/``xla_after`` are :class:`~hlopass.memory.MemoryCheck` s; their
    footprint (temp + arguments + outputs) is drawn as a dashed line.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 4.5))
    peaks = []
    for name, line, check, color in (("before", before, xla_before, "#c0392b"),
                                     ("after", after, xla_after, "#2471a3")):
        values = [p.live_bytes for p in line.points] or [line.argument_bytes]
        edges = [k / len(values) for k in range(len(values) + 1)]
        xs = [(k + 0.5) / len(values) for k in range(len(values))]
        axes.stairs(values, edges, baseline=None, color=color, linewidth=1.8,
                    label=f"{name}: live bytes, {len(line.points)} equations (peak {format_size(max(values))})")
        peaks.append(max(values))
        peak = line.peak_point
        if peak is not None:
            axes.annotate(f"{peak.primitive} at {peak.location}", xy=(xs[peak.index], peak.live_bytes),
                          xytext=(0, 6), textcoords="offset points", fontsize=7, color=color, ha="center")
        if check is not None:
            axes.axhline(check.footprint, color=color, linestyle="--", linewidth=1,
                         label=f"{name}: XLA temp+arguments+outputs {format_size(check.footprint)} "
                               f"(temp {format_size(check.temp_bytes)})")
            peaks.append(check.footprint)
    positive = [p for p in peaks if p > 0]
    if positive and max(positive) > 20 * min(positive):
        axes.set_yscale("log")
    axes.set_xlabel("position in the program (fraction of its equations, program order)")
    axes.set_ylabel("bytes live")
    axes.set_title(title or "memory along the program")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="best")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


# -- the dump --------------------------------------------------------------------------------

def rewritten_locations(report) -> set[str]:
    """Source lines at which the passes rewrote something (what the pictures highlight)."""
    return {r.location for r in report.rewrites if r.location and not r.location.startswith("<")}


def draw_explanation(explanation, folder: str, fmt: str = "svg", min_bytes: int | None = None) -> list[str]:
    """Draw the graph before and after and the memory timeline of ``explanation`` into ``folder``.

    ``fmt`` is ``"svg"`` or ``"png"``. Returns the files written. A missing
    optional tool (``graphviz``, ``matplotlib``) gives a :class:`MissingToolWarning`
    and the remaining pictures are still drawn.
    """
    if fmt not in ("svg", "png"):
        raise ValueError(f"picture format {fmt!r} is not one of 'svg', 'png'")
    os.makedirs(folder, exist_ok=True)
    written: list[str] = []
    at = rewritten_locations(explanation.report)
    threshold = getattr(explanation.config, "threshold", None)
    large = threshold if threshold else 2**20
    try:
        for name, closed in (("before", explanation.original_jaxpr), ("after", explanation.rewritten_jaxpr)):
            title = f"{explanation.label}: {name} the passes"
            written += draw_graph(closed, os.path.join(folder, f"graph_{name}"), fmt, title, at, large, min_bytes)
    except ImportError:
        warnings.warn("hlopass: graph pictures need the Python package 'graphviz' (pip install graphviz, or "
                      "pip install hlopass[plot])", MissingToolWarning, stacklevel=2)
    try:
        written.append(draw_memory_timeline(
            timeline(explanation.original_jaxpr), timeline(explanation.rewritten_jaxpr),
            os.path.join(folder, f"memory.{fmt}"), explanation.memory_before, explanation.memory_after,
            title=f"{explanation.label}: bytes live before and after the passes"))
    except ImportError:
        warnings.warn("hlopass: the memory timeline needs matplotlib (pip install matplotlib, or pip install "
                      "hlopass[plot])", MissingToolWarning, stacklevel=2)
    return written
