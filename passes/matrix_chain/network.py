"""Contraction networks: chains of ``dot_general`` s as einsum-like descriptions.

A :class:`Network` is a list of operands, each with one index label per axis,
an output label tuple and the size of every label: ``A @ B @ v`` is
``ij,jk,k->i``. A sum over an axis is a contraction with a ones vector, so
``sum(A @ B, axis=1)`` is ``ij,jk,k->i`` with a ones operand for ``k``.

- :func:`extract_networks` finds, in one jaxpr level, maximal trees of
  ``dot_general``, ``transpose``, ``reduce_sum``, widening
  ``convert_element_type``, products with scalars (a scalar is an operand
  without labels) and size-1-axis reshapes whose intermediate results
  are used once (an intermediate used anywhere else is a boundary: it becomes
  an operand, unless :func:`shared_worth_inlining` finds recomputing it in each
  reader cheaper).
- :func:`optimal_path` asks opt_einsum's dynamic programming optimiser for the
  order with the fewest multiply-adds, optionally with every intermediate
  under a memory limit.
- :func:`path_cost` counts the multiply-adds and the largest intermediate of
  any order; :func:`contract` emits an order with ``lax.dot_general``.
- :func:`contract_optimally` does all of it for an einsum string, for passes
  that build a network from a pattern of their own.

Multiply-adds of one pairwise step are the product of the sizes of every
label of the two operands (opt_einsum's ``dp`` "flops" measure), so the cost
of ``(n x m) @ (m x p)`` is ``n*m*p``; ``FLOPs = 2 * multiply-adds``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
from typing import Any, Sequence

import networkx as nx
import numpy as np
import opt_einsum
from hlopass import internals as jx

from hlopass.einsum_order import cheapest_order
from hlopass.families import CHAIN, dot_general_operand_labels
from hlopass.jaxpr_utils import aval_nbytes, aval_str

from .options import ChainOptions

Label = str
Path = list[tuple[int, ...]]

#: Equations a chain may pass through (its interior nodes, the family :data:`hlopass.families.CHAIN`);
#: ``mul`` only by a scalar (a product with an operand that has no axes), those of
#: ``UNIT_AXIS_PRIMITIVES`` only when they add or drop axes of size 1 (``A[None] @ B``, a squeezed
#: batch of one).
LINK_PRIMITIVES = CHAIN
UNIT_AXIS_PRIMITIVES = ("squeeze", "broadcast_in_dim", "reshape")


DEFAULTS = ChainOptions()


@dataclasses.dataclass
class Operand:
    """One operand of a network: a jaxpr atom (``None`` for a ones vector) and its labels."""

    atom: Any
    labels: tuple[Label, ...]
    dtype: np.dtype

    @property
    def is_ones(self) -> bool:
        return self.atom is None


@dataclasses.dataclass
class Network:
    """An einsum-like contraction: ``operands`` contracted to ``output``.

    Built by :func:`extract_networks` (then ``eqns``/``root`` name the jaxpr
    equations it replaces and ``original_*`` describe the order as written)
    or by :func:`network_from_subscripts`.
    """

    operands: list[Operand]
    output: tuple[Label, ...]
    sizes: dict[Label, int]
    dtype: np.dtype
    precision: Any = None
    eqns: list[int] = dataclasses.field(default_factory=list)
    root: int | None = None
    original_multiply_adds: int = 0
    original_peak_bytes: int = 0
    original_expression: str = ""
    shared_eqns: list[int] = dataclasses.field(default_factory=list)
    #: why this chain cannot be reordered, if it cannot
    unsupported: str | None = None

    @property
    def atoms(self) -> list[Any]:
        """The jaxpr atoms read, one per non-ones operand, in order."""
        return [op.atom for op in self.operands if not op.is_ones]

    @property
    def subscripts(self) -> str:
        """The einsum string, e.g. ``ab,bc,c->a``."""
        return ",".join("".join(op.labels) for op in self.operands) + "->" + "".join(self.output)

    def size(self, labels) -> int:
        return math.prod(self.sizes[label] for label in labels)

    def describe_operand(self, k: int) -> str:
        op = self.operands[k]
        if op.is_ones:
            return f"ones[{self.sizes[op.labels[0]]}]"
        return aval_str(op.atom.aval)


# -- extraction from jaxprs ------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def promote(a, b) -> np.dtype:
    """The type ``jnp.matmul`` computes two dtypes in (JAX's standard promotion lattice), whatever
    ``jax_numpy_dtype_promotion`` says: the chain's casts are explicit in the jaxpr already."""
    import jax

    with jax.numpy_dtype_promotion("standard"):
        return np.dtype(jax.numpy.promote_types(a, b))


def is_link(eqn: jx.JaxprEqn) -> bool:
    """Whether ``eqn`` may sit inside a chain: a floating (or complex) contraction, transpose,
    sum, or a conversion that loses nothing."""
    name = eqn.primitive.name
    if name not in LINK_PRIMITIVES or len(eqn.outvars) != 1:
        return False
    out_dtype = getattr(eqn.outvars[0].aval, "dtype", None)
    if out_dtype is None or not _inexact(out_dtype):
        return False
    if eqn.params.get("out_sharding") is not None or eqn.params.get("sharding") is not None:
        return False
    if name == "convert_element_type":
        in_dtype = eqn.invars[0].aval.dtype
        return _inexact(in_dtype) and promote(in_dtype, out_dtype) == out_dtype
    if name == "dot_general":
        return all(_inexact(a.aval.dtype) for a in eqn.invars)
    if name in UNIT_AXIS_PRIMITIVES:
        return _unit_axis_map(eqn) is not None
    if name == "mul":
        shapes = [getattr(a.aval, "shape", None) for a in eqn.invars]
        return (all(_inexact(a.aval.dtype) for a in eqn.invars)
                and () in shapes and eqn.outvars[0].aval.shape in shapes)
    return True


@functools.lru_cache(maxsize=None)
def _inexact(dtype) -> bool:
    import jax.numpy as jnp

    return bool(jnp.issubdtype(dtype, jnp.inexact))


def _unit_axis_map(eqn) -> list[int | None] | None:
    """For an equation that only adds or drops axes of size 1: for each output axis, the
    operand axis it comes from (``None`` for a new axis of size 1); otherwise ``None``."""
    in_shape, out_shape = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    if eqn.primitive.name == "broadcast_in_dim":
        dims = eqn.params["broadcast_dimensions"]
        if any(in_shape[a] != out_shape[d] for a, d in enumerate(dims)) or math.prod(out_shape) != math.prod(in_shape):
            return None
        source = {d: a for a, d in enumerate(dims)}
        return [source.get(d) for d in range(len(out_shape))]
    if eqn.primitive.name == "reshape" and eqn.params.get("dimensions") is not None:
        return None
    in_axes = [a for a, d in enumerate(in_shape) if d != 1]
    out_axes = [a for a, d in enumerate(out_shape) if d != 1]
    if [in_shape[a] for a in in_axes] != [out_shape[a] for a in out_axes]:
        return None
    source = dict(zip(out_axes, in_axes))
    return [source.get(d) for d in range(len(out_shape))]


def extract_networks(graph, inline: frozenset = frozenset(), within: Sequence[int] | None = None) -> list[Network]:
    """Every maximal chain in a :class:`~hlopass.graph.DataflowGraph` with at least one ``dot_general``
    (only those among the equations ``within``, in order, when given: a union of :func:`link_components`,
    where a chain and every chain it shares a result with lie).

    An equation's result joins its consumer's chain only when it is read
    exactly once, by a link, and is not an output of the jaxpr; otherwise it
    is an operand (a boundary), so rewriting a chain never duplicates work or
    changes what other users see. Variables in ``inline`` (see
    :func:`shared_worth_inlining`) join every chain that reads them instead:
    each recomputes them in its own order, and their equations are listed in
    ``Network.shared_eqns`` (the original multiply-adds count them once).
    """
    jaxpr = graph.jaxpr
    link = links(graph)
    order = range(len(jaxpr.eqns)) if within is None else within
    absorbed = {}
    for i in order:
        eqn = jaxpr.eqns[i]
        if not link[i]:
            continue
        for atom in eqn.invars:
            if isinstance(atom, jx.Var) and (_joins_consumer(graph, atom, i, link) or atom in inline):
                absorbed[atom] = graph.producer[atom]
    # A chain without a product is no network; unless it recomputes a shared result (whose
    # multiply-adds the first chain built counts), building it only to find that is wasted.
    # Producers come before their readers, so one sweep in order fills both.
    has_dot, shares = [False] * len(jaxpr.eqns), [False] * len(jaxpr.eqns)
    for i in order:
        eqn = jaxpr.eqns[i]
        if link[i]:
            reads = [a for a in eqn.invars if isinstance(a, jx.Var) and a in absorbed]
            has_dot[i] = eqn.primitive.name == "dot_general" or any(has_dot[absorbed[a]] for a in reads)
            shares[i] = any(a in inline or shares[absorbed[a]] for a in reads)
    networks, charged = [], set()
    for i in order:
        eqn = jaxpr.eqns[i]
        if link[i] and eqn.outvars[0] not in absorbed and (has_dot[i] or shares[i]):
            try:
                network = _NetworkBuilder(jaxpr, absorbed, inline, charged).build(i)
            except Exception as err:  # noqa: BLE001 - one unreadable chain must not cost the others
                network = Network(operands=[], output=(), sizes={}, dtype=np.dtype(np.float32), root=i,
                                  original_expression=eqn.primitive.name,
                                  unsupported=f"could not be read ({type(err).__name__}: {err})")
            if network is not None:
                networks.append(network)
    return networks


def links(graph) -> list[bool]:
    """:func:`is_link` of each of the graph's equations (computed once per graph: the inlining
    search extracts the chains once per candidate)."""
    return graph.derived("matrix_chain.links", lambda g: [is_link(eqn) for eqn in g.jaxpr.eqns])


def link_components(graph) -> dict[int, tuple[int, ...]]:
    """``link -> the links connected to it by reads`` (in order), computed once per graph. A chain,
    the shared results it may recompute and the other chains that read them lie in one component,
    so recomputing a result inside its readers changes the chains of its component alone."""
    def compute(g) -> dict[int, tuple[int, ...]]:
        link = links(g)
        reads = g.graph.subgraph(i for i in range(len(g.jaxpr.eqns)) if link[i])
        return {i: group for members in nx.weakly_connected_components(reads)
                for group in [tuple(sorted(members))] for i in group}
    return graph.derived("matrix_chain.components", compute)


def shareable(graph) -> list:
    """Results of links used more than once, only by links, and not returned: the boundaries
    that could instead be recomputed inside each chain that reads them."""
    link = links(graph)
    found = []
    for var, i in graph.producer.items():
        uses = graph.uses(var)
        if len(uses) > 1 and link[i] and not graph.is_output(var) and all(link[j] for j in uses):
            found.append(var)
    return found


def shared_worth_inlining(graph, cost=None, max_candidates: int = 32,
                          options: ChainOptions = DEFAULTS, min_gain: float = 1.0) -> frozenset:
    """The shared results to recompute in each chain that reads them, chosen greedily: one is
    taken when the optimal multiply-adds (``cost(network)``, by default :func:`optimal_path`'s)
    of the chains that change drop by at least the factor ``min_gain`` (and strictly) against
    keeping it a boundary computed once."""
    cost = cost or functools.partial(_optimal_multiply_adds, options=options)
    inline: frozenset = frozenset()
    candidates = shareable(graph)[:max_candidates]
    if not candidates:
        return inline
    current = _costs_by_root(extract_networks(graph, inline), cost)
    for var in candidates:
        component = link_components(graph)[graph.producer[var]]
        trial = _costs_by_root(extract_networks(graph, inline | {var}, within=component), cost)
        members = set(component)
        mine = {root: c for root, c in current.items() if root in members}
        changed = {root for root in mine.keys() | trial.keys() if mine.get(root) != trial.get(root)}
        before = sum(mine[root][1] for root in changed if root in mine)
        after = sum(trial[root][1] for root in changed if root in trial)
        if after < before and after * min_gain <= before:
            inline = inline | {var}
            current = {root: c for root, c in current.items() if root not in members} | trial
    return inline


def _costs_by_root(networks, cost) -> dict:
    """``root -> (the chain's einsum, its cost)``: which chains an inlining changes, and by how much."""
    return {network.root: (network.subscripts, cost(network)) for network in networks}


def _optimal_multiply_adds(network: Network, options: ChainOptions = DEFAULTS) -> float:
    if len(network.operands) > options.max_operands or network.unsupported:
        # left as written: a shared product it reads would be computed anyway
        return math.inf if network.shared_eqns else network.original_multiply_adds
    return _cached_optimal_multiply_adds(network.subscripts, tuple(sorted(network.sizes.items())),
                                         options.max_exponential_search)


@functools.lru_cache(maxsize=4096)
def _cached_optimal_multiply_adds(subscripts: str, sizes: tuple, search_limit: int) -> int:
    inputs, output = subscripts.split("->")
    size = dict(sizes)
    network = Network([Operand(None, tuple(labels), np.dtype("float32")) for labels in inputs.split(",")],
                      tuple(output), size, np.dtype("float32"))
    return path_cost(network, optimal_path(network, search_limit=search_limit)).multiply_adds


def _joins_consumer(graph, atom, consumer: int, link: list[bool]) -> bool:
    if not isinstance(atom, jx.Var) or atom not in graph.producer:
        return False
    return link[graph.producer[atom]] and graph.uses(atom) == [consumer] and not graph.is_output(atom)


class _NetworkBuilder:
    """Walks one chain from its root, giving every axis a label (top-down).

    ``charged`` (shared by the builders of one extraction) holds the equations
    whose multiply-adds some chain already counted: a shared result
    recomputed in several chains was computed once as written.
    """

    def __init__(self, jaxpr: jx.Jaxpr, absorbed: dict, inline=frozenset(), charged: set | None = None):
        self.jaxpr = jaxpr
        self.absorbed = absorbed
        self.inline = inline
        self.charged = set() if charged is None else charged
        self.labels = (opt_einsum.get_symbol(k) for k in itertools.count())
        self.operands: list[Operand] = []
        self.sizes: dict[Label, int] = {}
        self.eqns: list[int] = []
        self.shared_eqns: list[int] = []
        self.shared_depth = 0
        self.multiply_adds = 0
        self.peak_bytes = 0
        self.precisions: set = set()
        self.dots = 0

    def charge(self, index: int, multiply_adds: int) -> None:
        if index not in self.charged:
            self.charged.add(index)
            self.multiply_adds += multiply_adds

    def fresh(self, n: int) -> list[Label]:
        return [next(self.labels) for _ in range(n)]

    def build(self, root: int) -> Network | None:
        out = self.jaxpr.eqns[root].outvars[0]
        output = tuple(self.fresh(len(out.aval.shape)))
        self.sizes.update(zip(output, out.aval.shape))
        expression = self.visit_eqn(root, output)
        if self.dots == 0:
            return None
        unsupported = None
        if len(self.precisions) > 1:
            unsupported = f"its products ask for different precisions {sorted(map(str, self.precisions))}"
        return Network(
            operands=self.operands, output=output, sizes=self.sizes, dtype=np.dtype(out.aval.dtype),
            precision=next(iter(self.precisions)), eqns=sorted(self.eqns), root=root,
            original_multiply_adds=self.multiply_adds, original_peak_bytes=self.peak_bytes,
            original_expression=expression, shared_eqns=sorted(set(self.shared_eqns)), unsupported=unsupported)

    def visit(self, atom, labels: Sequence[Label]) -> str:
        """Describe ``atom`` (with ``labels`` on its axes); returns the expression as written."""
        if isinstance(atom, jx.Var) and atom in self.absorbed:
            self.peak_bytes = max(self.peak_bytes, aval_nbytes(atom.aval))
            shared = atom in self.inline
            self.shared_depth += shared
            expression = self.visit_eqn(self.absorbed[atom], labels)
            self.shared_depth -= shared
            return expression
        self.operands.append(Operand(atom, tuple(labels), np.dtype(atom.aval.dtype)))
        return aval_str(atom.aval)

    def visit_eqn(self, index: int, labels: Sequence[Label]) -> str:
        eqn = self.jaxpr.eqns[index]
        (self.shared_eqns if self.shared_depth else self.eqns).append(index)
        name = eqn.primitive.name
        if name == "dot_general":
            return self.visit_dot(index, eqn, labels)
        if name == "transpose":
            perm = eqn.params["permutation"]
            operand_labels = [None] * len(perm)
            for out_axis, in_axis in enumerate(perm):
                operand_labels[in_axis] = labels[out_axis]
            return self.visit(eqn.invars[0], operand_labels) + ".T"
        if name == "reduce_sum":
            return self.visit_sum(index, eqn, labels)
        if name in UNIT_AXIS_PRIMITIVES:
            return self.visit_unit_axes(eqn, labels)
        if name == "mul":
            return self.visit_scaling(index, eqn, labels)
        return self.visit(eqn.invars[0], labels)  # a widening convert_element_type

    def visit_scaling(self, index: int, eqn, labels: Sequence[Label]) -> str:
        """A product with a scalar: the scalar is an operand without labels."""
        scalar, tensor = sorted(eqn.invars, key=lambda a: a.aval.shape != ())
        if tensor.aval.shape == ():
            scalar, tensor = eqn.invars
        self.charge(index, math.prod(eqn.outvars[0].aval.shape))
        return f"{self.visit(scalar, ())} * {self.visit(tensor, labels)}"

    def visit_unit_axes(self, eqn, labels: Sequence[Label]) -> str:
        """New axes of size 1 keep their labels only in the output; dropped ones get fresh
        labels that appear nowhere else (so the emitter squeezes them)."""
        operand = eqn.invars[0]
        operand_labels = self.fresh(len(operand.aval.shape))
        for out_axis, in_axis in enumerate(_unit_axis_map(eqn)):
            if in_axis is not None:
                operand_labels[in_axis] = labels[out_axis]
        self.sizes.update((label, 1) for label in operand_labels if label not in self.sizes)
        return self.visit(operand, operand_labels)

    def visit_dot(self, index: int, eqn, labels: Sequence[Label]) -> str:
        lhs, rhs = eqn.invars

        def fresh(size: int) -> Label:
            [label] = self.fresh(1)
            self.sizes[label] = size
            return label

        lhs_labels, rhs_labels, _ = dot_general_operand_labels(
            eqn.params["dimension_numbers"], lhs.aval.shape, rhs.aval.shape, labels, fresh)
        self.charge(index, math.prod(self.sizes[label] for label in set(lhs_labels) | set(rhs_labels)))
        self.precisions.add(eqn.params.get("precision"))
        self.dots += 1
        return f"({self.visit(lhs, lhs_labels)} @ {self.visit(rhs, rhs_labels)})"

    def visit_sum(self, index: int, eqn, labels: Sequence[Label]) -> str:
        operand = eqn.invars[0]
        axes = sorted(eqn.params["axes"])
        summed = self.fresh(len(axes))
        kept = iter(labels)
        by_axis = dict(zip(axes, summed))
        operand_labels = [by_axis[d] if d in by_axis else next(kept) for d in range(len(operand.aval.shape))]
        self.sizes.update(zip(summed, (operand.aval.shape[a] for a in axes)))
        self.charge(index, math.prod(operand.aval.shape))
        dtype = np.dtype(operand.aval.dtype)
        self.operands.extend(Operand(None, (label,), dtype) for label in summed)
        return f"sum({self.visit(operand, operand_labels)}, axes={tuple(axes)})"


# -- choosing and costing orders -------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PathCost:
    """Multiply-adds of an order and its largest intermediate (the final result excluded)."""

    multiply_adds: int
    peak_elements: int


def path_cost(network: Network, path: Path) -> PathCost:
    """Cost of contracting ``network`` in the order ``path`` (opt_einsum's linear path format),
    counted on exactly the steps :func:`contract` emits."""
    counter = _CostCounter(network)
    _execute(network, path, lambda k: (None, network.operands[k].labels), counter.sum_out, counter.dot)
    return PathCost(counter.multiply_adds, max(counter.produced[:-1], default=0))


class _CostCounter:
    """A symbolic executor for :func:`_execute`: counts instead of computing."""

    def __init__(self, network: Network):
        self.network = network
        self.multiply_adds = 0
        self.produced: list[int] = []

    def sum_out(self, tensor, keep):
        _, labels = tensor
        kept = tuple(label for label in labels if label in keep)
        if kept == labels:
            return tensor
        if self.network.size(labels) != self.network.size(kept):  # not just dropping axes of size 1
            self.multiply_adds += self.network.size(labels)
            self.produced.append(self.network.size(kept))
        return None, kept

    def dot(self, x, y, keep):
        x, y = self.sum_out(x, keep | set(y[1])), self.sum_out(y, keep | set(x[1]))
        touched = set(x[1]) | set(y[1])
        self.multiply_adds += self.network.size(touched)
        labels = _dot_labels(x[1], y[1], keep)
        self.produced.append(self.network.size(labels))
        return None, labels


def _dot_labels(xl, yl, keep) -> tuple[Label, ...]:
    """Labels of a pairwise step's result, in ``dot_general``'s order: batch, lhs free, rhs free."""
    shared = [label for label in xl if label in yl]
    batch = tuple(label for label in shared if label in keep)
    return batch + tuple(label for label in xl if label not in yl) + tuple(label for label in yl if label not in xl)


def _execute(network: Network, path: Path, leaf, sum_out, dot):
    """Run ``path``: ``leaf(k)`` gives operand k as (payload, labels); ``dot(x, y, keep)`` contracts
    two, keeping the labels in ``keep``; ``sum_out(x, keep)`` sums the other labels away."""
    tensors = [leaf(k) for k in range(len(network.operands))]
    for step in path:
        picked = [tensors[k] for k in step]
        tensors = [t for k, t in enumerate(tensors) if k not in step]
        keep = set(network.output).union(*(labels for _, labels in tensors))
        current = picked[0]
        for j, other in enumerate(picked[1:]):
            current = dot(current, other, keep.union(*(labels for _, labels in picked[j + 2:])))
        if len(picked) == 1:
            current = sum_out(current, keep)
        tensors.append(current)
    return sum_out(tensors[0], set(network.output))


def optimal_path(network: Network, memory_limit: int | None = None,
                 search_limit: int = DEFAULTS.max_exponential_search) -> Path:
    """The order with the fewest multiply-adds (opt_einsum ``dp``), every intermediate within
    ``memory_limit`` elements if given; raises ``RuntimeError`` when no order fits.

    Labels carried by every operand and by the output (pure batch dimensions)
    scale every step alike; they are left out of the search, which keeps it a
    chain search instead of one over all subsets. Networks whose search would
    be exponential and that have more than ``search_limit`` operands
    get opt_einsum's greedy order instead (not always optimal).
    """
    inputs = [set(op.labels) for op in network.operands]
    if len(inputs) == 1:
        return [(0,)]
    output = set(network.output).intersection(set().union(*inputs))
    batch = output.intersection(*inputs)
    sizes = {label: size for label, size in network.sizes.items() if label not in batch}
    if memory_limit is not None:
        memory_limit = max(memory_limit // max(network.size(batch), 1), network.size(output - batch))
    inputs, output = [i - batch for i in inputs], output - batch
    small = len(inputs) <= search_limit
    # dp joins only operands that share a summed label; pieces joined by kept
    # labels alone (or by nothing, after a squeeze) need its outer-product search.
    connected = _connected(inputs, output)
    if not small and (not connected or _has_hyperedges(inputs, output)):
        path = opt_einsum.paths.greedy(inputs, output, sizes, memory_limit)
        return [tuple(step) for step in path]
    search_outer = not connected
    if search_outer:
        inputs = _tie_scalars(inputs, output, sizes)
    path = cheapest_order(inputs, output, sizes, memory_limit, search_outer=search_outer)
    if path is None:
        raise RuntimeError("no contraction order keeps the intermediates within the memory limit")
    return path


def fitting_path(network: Network, memory_limit: int,
                 search_limit: int = DEFAULTS.max_exponential_search) -> Path | None:
    """The order with the fewest multiply-adds whose intermediates (not the final result) all stay
    within ``memory_limit`` elements, by an exact search over bracketings; ``None`` if none fits or
    the network has more than ``search_limit`` operands.

    opt_einsum's ``memory_limit`` also bounds the final result, so when the result alone is
    larger than the limit it cannot say which orders keep the *intermediates* small; this
    search can. Candidates are costed with :func:`path_cost`, exactly as emitted.
    """
    n = len(network.operands)
    if n > search_limit or n < 2:
        return None
    labels = [frozenset(op.labels) for op in network.operands]
    output = frozenset(network.output)

    def result_labels(subset: frozenset) -> frozenset:
        inside = frozenset().union(*(labels[i] for i in subset))
        outside = frozenset().union(output, *(labels[i] for i in range(n) if i not in subset))
        return inside & outside

    @functools.lru_cache(maxsize=None)
    def best(subset: frozenset):
        if len(subset) == 1:
            return 0, next(iter(subset))
        if len(subset) < n and network.size(result_labels(subset)) > memory_limit:
            return None
        first, rest = min(subset), sorted(subset - {min(subset)})
        found = None
        for size in range(len(rest)):
            for others in itertools.combinations(rest, size):
                left = frozenset((first, *others))
                right = subset - left
                a, b = best(left), best(right)
                if a is None or b is None:
                    continue
                cost = a[0] + b[0] + network.size(result_labels(left) | result_labels(right))
                if found is None or cost < found[0]:
                    found = (cost, (a[1], b[1]))
        return found

    found = best(frozenset(range(n)))
    if found is None:
        return None
    path = _tree_to_path(found[1], n)
    return path if path_cost(network, path).peak_elements <= memory_limit else None


def _tree_to_path(tree, n: int) -> Path:
    """A bracketing (nested pairs of operand indices) as opt_einsum's linear path."""
    current = list(range(n))
    path: list[tuple[int, int]] = []
    fresh = itertools.count(n)

    def visit(node) -> int:
        if isinstance(node, int):
            return node
        a, b = visit(node[0]), visit(node[1])
        positions = tuple(sorted((current.index(a), current.index(b))))
        path.append(positions)
        for position in reversed(positions):
            current.pop(position)
        current.append(next(fresh))
        return current[-1]

    visit(tree)
    return path


def _has_hyperedges(inputs: list[set], output: set) -> bool:
    counts = collections.Counter(label for labels in inputs for label in labels)
    return any(count + (label in output) > 2 for label, count in counts.items())


def _connected(inputs: list[set], output: set) -> bool:
    """Whether the operands form one piece through labels that get summed."""
    piece = list(range(len(inputs)))  # union-find: every pass calls this once per chain

    def root(k: int) -> int:
        while piece[k] != k:
            piece[k] = piece[piece[k]]
            k = piece[k]
        return k

    first_holder: dict = {}
    for k, labels in enumerate(inputs):
        for label in labels - output:
            if label in first_holder:
                piece[root(k)] = root(first_holder[label])
            else:
                first_holder[label] = k
    return len({root(k) for k in range(len(inputs))}) <= 1


def _tie_scalars(inputs: list[set], output: set, sizes: dict) -> list[set]:
    """Give operands that reduce to scalars a shared label of size 1.

    opt_einsum's ``dp`` sets such operands aside and multiplies them in at the
    very end, at the cost of the whole result; tied to another operand they
    take part in the search and get multiplied in where it is cheapest.
    """
    counts = collections.Counter(label for labels in inputs for label in labels)
    scalars = [k for k, labels in enumerate(inputs) if all(counts[l] == 1 and l not in output for l in labels)]
    others = [k for k in range(len(inputs)) if k not in scalars]
    partner = (others or scalars)[0]
    inputs = [set(labels) for labels in inputs]
    for k in scalars:
        if k != partner:
            tie = ("scalar", k)
            sizes[tie] = 1
            inputs[k].add(tie)
            inputs[partner].add(tie)
    return inputs


def describe_path(network: Network, path: Path) -> str:
    """The order as a parenthesised expression of operand types."""
    exprs = [network.describe_operand(k) for k in range(len(network.operands))]
    for step in path:
        picked = [exprs[k] for k in step]
        exprs = [e for k, e in enumerate(exprs) if k not in step]
        exprs.append(picked[0] if len(picked) == 1 else "(" + " @ ".join(picked) + ")")
    return exprs[-1]


# -- emitting an order -----------------------------------------------------------------------

def contract(network: Network, path: Path, values: Sequence[Any]):
    """Evaluate ``network`` in the order ``path`` with ``lax.dot_general`` (traceable).

    ``values`` are the non-ones operands' values in order. Operands of
    different dtypes are contracted as ``jnp.matmul`` would (the promoted
    type), accumulating in at least the network's result type, which is also
    the type of the result.
    """
    import jax.numpy as jnp
    from jax import lax

    given = iter(values)
    leaves = []
    for op in network.operands:
        value = jnp.ones((network.sizes[op.labels[0]],), op.dtype) if op.is_ones else next(given)
        leaves.append((value, op.labels))

    def sum_out(tensor, keep):
        value, labels = tensor
        axes = tuple(a for a, label in enumerate(labels) if label not in keep)
        if not axes:
            return tensor
        reduce = lax.squeeze if all(value.shape[a] == 1 for a in axes) else lax.reduce_sum
        return reduce(value, axes), tuple(label for label in labels if label in keep)

    def dot(x, y, keep):
        (xv, xl), (yv, yl) = sum_out(x, keep | set(y[1])), sum_out(y, keep | set(x[1]))
        labels = _dot_labels(xl, yl, keep)
        batch = [label for label in labels if label in xl and label in yl]
        contracted = [label for label in xl if label in yl and label not in keep]
        dims = (([xl.index(c) for c in contracted], [yl.index(c) for c in contracted]),
                ([xl.index(b) for b in batch], [yl.index(b) for b in batch]))
        common = promote(xv.dtype, yv.dtype)  # explicit casts: no implicit promotion (strict mode)
        xv, yv = (v if v.dtype == common else lax.convert_element_type(v, common) for v in (xv, yv))
        dtype = promote(common, network.dtype)
        return lax.dot_general(xv, yv, dims, precision=network.precision, preferred_element_type=dtype), labels

    value, labels = _execute(network, path, leaves.__getitem__, sum_out, dot)
    present = [label for label in network.output if label in labels]
    value = lax.transpose(value, tuple(labels.index(label) for label in present))
    new_axes = tuple(a for a, label in enumerate(network.output) if label not in labels)
    if new_axes:  # axes of size 1 that no operand has
        value = lax.expand_dims(value, new_axes)
    return lax.convert_element_type(value, network.dtype) if value.dtype != network.dtype else value


# -- einsum-string front end -----------------------------------------------------------------

def network_from_subscripts(subscripts: str, *shapes_and_dtypes) -> Network:
    """A network from an einsum string and ``(shape, dtype)`` pairs (operand atoms left ``None``)."""
    import jax.numpy as jnp

    inputs, output = subscripts.replace(" ", "").split("->")
    operands, sizes = [], {}
    for labels, (shape, dtype) in zip(inputs.split(","), shapes_and_dtypes):
        operands.append(Operand(None, tuple(labels), np.dtype(dtype)))
        sizes.update(zip(labels, shape))
    dtype = functools.reduce(promote, (d for _, d in shapes_and_dtypes))
    return Network(operands=operands, output=tuple(output), sizes=sizes, dtype=dtype)


def contract_optimally(subscripts: str, *arrays, memory_limit: int | None = None):
    """``jnp.einsum(subscripts, *arrays)`` in the order with the fewest multiply-adds
    (every intermediate within ``memory_limit`` elements when possible)."""
    network = network_from_subscripts(subscripts, *((a.shape, a.dtype) for a in arrays))
    for op in network.operands:
        op.atom = object()  # mark as given: every operand is a value here
    try:
        path = optimal_path(network, memory_limit)
    except RuntimeError:
        path = optimal_path(network)
    return contract(network, path, arrays)
