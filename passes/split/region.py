"""Finding split regions: the equations between small inputs and size-reducing operations.

A *region* is a set of equations of one jaxpr level that can be recomputed on
slices of one iteration dimension (a *split axis*). It is grown from a seed,
a size-reducing equation (``dot_general``, ``reduce_*``, ``argmax``/``argmin``,
``top_k``...) whose operand is larger than the threshold:

* backwards, through the producers of every operand larger than the split
  size, following the split axis with the per-primitive rules of
  :mod:`.rules`; a small operand (or a parameter) becomes a
  region *input*, sliced along its axis or passed whole when it does not
  carry it;
* forwards, through every consumer of a large region value (a large value
  that escapes the loop would be materialised anyway), which merges several
  reducers reading one large intermediate into one region;
* and through the equations on any path that leaves the region and comes
  back (the region must be convex).

Every region value carries the split axis, except the results of equations
that reduce it (the loop combines their partial results with a monoid);
those may only leave the region, unless they are a running maximum read back
through a *shift program* (small equations computed from it again in every
step, :mod:`.online`). A cumulative op along the axis keeps it (the loop
carries its running total). An equation without a rule, or one that
cannot be sliced along the axis, makes the attempt :class:`Infeasible` and
names the equation.
"""

from __future__ import annotations

import collections
import dataclasses

from hlopass import internals as jx

from hlopass.graph import DataflowGraph, GrowingRegion
from hlopass.jaxpr_utils import aval_nbytes
from hlopass.families import ARG_REDUCTIONS, CUMULATIVE, ELEMENTWISE, LAYOUT, REDUCTIONS

from .online import RUNNING, NotOnline, analyse, final_equations, running_reducers, shift_equations
from .rules import SCATTER_MONOIDS, DimMap, dim_map
from .shares import device_bytes

#: Primitives a region may start from.
SEED_PRIMITIVES = frozenset({"dot_general", "top_k", "triangular_solve", "gather", "slice", "dynamic_slice",
                             *SCATTER_MONOIDS, *REDUCTIONS, *ARG_REDUCTIONS, *CUMULATIVE})


#: The longest final program (small values computed after the loop from its sums, :mod:`.online`) a region
#: may have. Regions that split have 1 or 2 (softmax's ``1 / s``); one with hundreds spans the program
#: between two layers' softmaxes and fails the online analysis after taking them all in: on the
#: Transformer blocks under their memory limit, 330 of the search's 760 growths took in 103 to 525 so.
MAX_FINAL_EQUATIONS = 64

#: Producers whose result XLA computes inside its consumer's loop (no buffer), and such consumers.
FUSIBLE_PRODUCERS = ELEMENTWISE | LAYOUT | {"iota"}
FUSING_CONSUMERS = ELEMENTWISE | set(REDUCTIONS) | ARG_REDUCTIONS | {"broadcast_in_dim"}


class Infeasible(Exception):
    """A region cannot be split along an axis; ``eqn_index`` is the equation that prevents it."""

    def __init__(self, eqn_index: int, reason: str):
        super().__init__(reason)
        self.eqn_index = eqn_index
        self.reason = reason


@dataclasses.dataclass
class SplitRegion:
    """Equations to recompute per slice, and how the split axis runs through them."""

    seed: int
    eqns: set[int]
    size: int                                        # length of the split axis
    label: dict[int, object]                         # equation -> its label of the split axis
    var_axis: dict[jx.Var, int | None]             # region value -> its split dimension (None: reduced)
    operand_axis: dict[tuple[int, int], int | None]  # (equation, operand position) -> dimension
    reducing: dict[int, str]                         # equation -> monoid, where the axis is reduced
    scans: dict[int, tuple[str, bool]] = dataclasses.field(default_factory=dict)  # cumulative op -> (monoid, reverse)
    shift: set[int] = dataclasses.field(default_factory=set)  # shift program of a running maximum
    final: set[int] = dataclasses.field(default_factory=set)  # final program: after the loop, from its sums
    online: object = None                            # its :class:`.online.OnlineInfo`

    def ordered(self) -> list[int]:
        return sorted(self.eqns)

    def inputs(self, jaxpr: jx.Jaxpr) -> list[tuple[jx.Var, int | None]]:
        """Distinct ``(value, axis)`` pairs read from outside the region, in first-use order."""
        seen: dict[tuple, None] = {}
        for i in self.ordered():
            for pos, atom in enumerate(jaxpr.eqns[i].invars):
                if isinstance(atom, jx.Var) and atom not in self.var_axis:
                    seen.setdefault((atom, self.operand_axis[(i, pos)]), None)
        return list(seen)

    def outputs(self, jaxpr: jx.Jaxpr, graph: DataflowGraph) -> list[jx.Var]:
        """SplitRegion values read after the region (by other equations or as program outputs)."""
        outs = []
        for i in self.ordered():
            for var in jaxpr.eqns[i].outvars:
                if isinstance(var, jx.DropVar):
                    continue
                if graph.is_output(var) or any(j not in self.eqns for j in graph.uses(var)):
                    outs.append(var)
        return outs

    def per_unit_bytes(self, jaxpr: jx.Jaxpr, unrolled: dict | None = None) -> int:
        """Bytes per unit of the split axis of the largest sliced value of one iteration, on one device;
        a value in ``unrolled`` (value -> length) is built that many slices at a time (see ``unroll.py``)."""
        share = device_bytes(jaxpr)
        unrolled = unrolled or {}
        best = 0
        for var, axis in self.var_axis.items():
            if axis is not None:
                best = max(best, -(-share(var) // (self.size * unrolled.get(var, 1))))
        for var, axis in self.inputs(jaxpr):
            if axis is not None:
                best = max(best, -(-share(var) // self.size))
        return best

    def peak_per_unit_bytes(self, jaxpr: jx.Jaxpr, graph: DataflowGraph, fuses=None) -> int:
        """Bytes per unit of the split axis live at once in one iteration, in program order, on one device.

        A value that XLA fuses into its only consumer (an elementwise result read by one
        elementwise op, reduction or broadcast) is not counted; sliced inputs are live throughout.
        With ``fuses`` (``produces(eqn)``, ``consumes(eqn)``: an accelerator's rules), a result is not
        counted when its producer fuses into its only reader, or when all its readers are elementwise
        (one loop fusion). A value read by several reductions is stored: measured so on an H100 in a
        kernel mat-vec's gradient.
        """
        share = device_bytes(jaxpr)
        unit = lambda var: -(-share(var) // self.size)  # noqa: E731
        inputs = sum(unit(var) for var, axis in self.inputs(jaxpr) if axis is not None)
        last_use: dict[jx.Var, int] = {}
        for i in self.ordered():
            for var in jaxpr.eqns[i].outvars:
                if self.var_axis.get(var) is None or self._fused(jaxpr, graph, i, var, fuses):
                    continue
                uses = [j for j in graph.uses(var) if j in self.eqns]
                last_use[var] = len(jaxpr.eqns) if graph.is_output(var) or len(uses) < len(graph.uses(var)) \
                    else max(uses, default=i)
        live, peak = {}, 0
        for i in self.ordered():
            for var in jaxpr.eqns[i].outvars:
                if var in last_use:
                    live[var] = unit(var)
            peak = max(peak, sum(live.values()))
            for var in [v for v, last in last_use.items() if last == i]:
                live.pop(var, None)
        return inputs + peak

    def _fused(self, jaxpr, graph, i: int, var, fuses=None) -> bool:
        if graph.is_output(var):
            return False
        if fuses is not None:
            uses = graph.uses(var)
            if not fuses.produces(jaxpr.eqns[i]) or not uses or any(j not in self.eqns for j in uses):
                return False
            if len(uses) == 1:
                return fuses.consumes(jaxpr.eqns[uses[0]])
            readers = [jaxpr.eqns[j] for j in uses]
            return all(e.primitive.name in ELEMENTWISE for e in readers) \
                or fuses.consume_together(readers)  # one loop fusion; products bound as one
        if jaxpr.eqns[i].primitive.name not in FUSIBLE_PRODUCERS:
            return False
        uses = graph.uses(var)
        return len(uses) == 1 and uses[0] in self.eqns and jaxpr.eqns[uses[0]].primitive.name in FUSING_CONSUMERS

    def largest_bytes(self, jaxpr: jx.Jaxpr | None = None) -> int:
        """The largest value the region computes (the tensor the split avoids); with ``jaxpr``, one device's share."""
        share = device_bytes(jaxpr) if jaxpr is not None else (lambda v: aval_nbytes(v.aval))
        return max((share(v) for v in self.var_axis), default=0)

    def min_chunk(self, jaxpr: jx.Jaxpr) -> int:
        """Smallest chunk the reductions allow (``top_k`` needs at least ``k`` per slice)."""
        need = 1
        for i, monoid in self.reducing.items():
            if monoid == "top_k":
                need = max(need, jaxpr.eqns[i].params["k"])
        return need


def seeds(jaxpr: jx.Jaxpr, threshold: int, graph: DataflowGraph | None = None) -> list[int]:
    """Reducing equations with an operand above ``threshold`` bytes and results at most that
    (or at most half the operand: with a tiny threshold, ``top_k`` of many rows still reduces);
    sizes are one device's shares (:mod:`.shares`). ``graph``: ``jaxpr``'s, where one is at hand."""
    found = []
    producers = _ProducerEqns(graph) if graph is not None else {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    share = device_bytes(jaxpr)
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name not in SEED_PRIMITIVES:
            continue
        largest = max(_effective_nbytes(share, producers, a) for a in eqn.invars)
        if largest <= threshold:
            continue
        out = max(share(v) for v in eqn.outvars)
        if eqn.primitive.name in CUMULATIVE or out <= threshold or 2 * out <= largest:
            found.append(i)
    return found


class _ProducerEqns:
    """``producers.get(var)``: the equation defining ``var`` (``None`` for an input), from a graph."""

    def __init__(self, graph: DataflowGraph):
        self.graph = graph

    def get(self, var):
        i = self.graph.producer.get(var)
        return None if i is None else self.graph.jaxpr.eqns[i]


def _effective_nbytes(share, producers, atom) -> int:
    """Bytes (``share``: one device's) of ``atom``, or of its producer's largest operand when that is
    larger (``any(x > 0)`` reduces a small boolean made from a large ``x``)."""
    if not isinstance(atom, jx.Var):
        return 0
    size = share(atom)
    producer = producers.get(atom)
    if producer is not None and producer.primitive.name in ELEMENTWISE:
        size = max([size] + [share(a) for a in producer.invars if isinstance(a, jx.Var)])
    return size


def seed_labels(jaxpr: jx.Jaxpr, seed: int, threshold: int, graph: DataflowGraph | None = None) -> list[object]:
    """Candidate split labels of ``seed``: the splittable dimensions of its large operands."""
    eqn = jaxpr.eqns[seed]
    dm = dim_map(eqn)
    if dm is None:
        return []
    labels = []
    producers = _ProducerEqns(graph or DataflowGraph(jaxpr))
    share = device_bytes(jaxpr)
    for atom, ins in zip(eqn.invars, dm.ins):
        if _effective_nbytes(share, producers, atom) > threshold:
            for d, label in enumerate(ins):
                if label is not None and atom.aval.shape[d] > 1 and label not in labels:
                    labels.append(label)
    return labels


def _answers(graph: DataflowGraph, split_size: int) -> tuple[dict, dict]:
    """Each equation's dimension map and, per split size, which values are large: kept with the graph
    (one jaxpr), shared by every region grown on it (a planning round grows several per seed)."""
    maps, large = graph.derived("split.answers", lambda g: ({}, {}))
    return maps, large.setdefault(split_size, {})


class _Grower:
    def __init__(self, jaxpr: jx.Jaxpr, graph: DataflowGraph, split_size: int, whole: frozenset[int] = frozenset()):
        self.jaxpr = jaxpr
        self.eqns = jaxpr.eqns   # a property of Jaxpr: read once
        self.graph = graph
        self.split_size = split_size
        self.whole = whole   # equations computed once outside the region, read as its inputs
        self.share = device_bytes(jaxpr)
        self.maps, self._large = _answers(graph, split_size)
        self._growing: GrowingRegion | None = None   # the region being grown (told each equation added)
        self._running = False   # whether the region reduces with a running monoid (a shift program may follow)

    def dim_map(self, i: int) -> DimMap:
        if i not in self.maps:
            self.maps[i] = dim_map(self.eqns[i])
        dm = self.maps[i]
        if dm is None:
            raise Infeasible(i, f"no split rule for {self.eqns[i].primitive.name}")
        return dm

    def large(self, var) -> bool:
        found = self._large.get(var)
        if found is None:
            found = self._large[var] = self.share(var) > self.split_size
        return found

    def grow(self, seed: int, label) -> SplitRegion:
        region = SplitRegion(seed, set(), 0, {}, {}, {}, {})
        self._growing = self.graph.growing()
        queue = collections.deque([(seed, label)])
        for _ in range(len(self.eqns) + 1):
            while queue:
                self._add(region, *queue.popleft(), queue)
            between = self._between(region)
            if not between:
                break
            shift = shift_equations(self.jaxpr, self.graph, region, between) if self._running else []
            if shift:  # small values computed from a running maximum: evaluated again in each step
                for i in shift:
                    self._add_shift(region, i)
                continue
            final = final_equations(self.jaxpr, self.graph, region, between, MAX_FINAL_EQUATIONS) \
                if region.shift else []
            if len(final) > MAX_FINAL_EQUATIONS:
                raise Infeasible(final[0], f"more than {MAX_FINAL_EQUATIONS} equations to compute after the loop "
                                           f"from its sums: the region spans the program")
            if final:  # small values computed from the sums (softmax's 1 / s): once, after the loop
                for i in final:
                    self._add_shift(region, i)
                    region.shift.discard(i)
                    region.final.add(i)
                continue
            queue.append((between[0], self._label_from_operands(region, between[0])))
        self._check(region)
        if region.shift:
            try:
                region.online = analyse(self.jaxpr, region)
            except NotOnline as err:
                raise Infeasible(err.eqn_index, err.reason) from None
        if region.scans:
            self._check_scans(region)
        return region

    def _check_scans(self, region: SplitRegion) -> None:
        """Cumulative ops along the split axis: one direction, nothing a loop in order cannot carry."""
        first = min(region.scans)
        if len({reverse for _, reverse in region.scans.values()}) > 1:
            raise Infeasible(first, "cumulative ops along the split axis in both directions")
        if region.shift or any(m in ("top_k", "argmax", "argmin", *SCATTER_MONOIDS.values())
                               for m in region.reducing.values()):
            raise Infeasible(first, "a cumulative op along the split axis beside a running maximum, top-k, "
                                    "arg-reduction or scatter")

    def _add_shift(self, region: SplitRegion, i: int) -> None:
        region.eqns.add(i)
        self._growing.add(i)
        region.shift.add(i)
        region.label[i] = None

    def _add_shift_axes(self, region: SplitRegion) -> None:
        for i in region.shift | region.final:
            eqn = self.eqns[i]
            for var in eqn.outvars:
                region.var_axis[var] = None
            for pos in range(len(eqn.invars)):
                region.operand_axis[(i, pos)] = None

    def _add(self, region: SplitRegion, i: int, label, queue) -> None:
        # The planner's innermost step (33,555 calls planning the Transformer blocks under their memory
        # limit): dictionaries and rules are read through locals, and the axes of a label come kept.
        taken = region.eqns
        if i in taken:
            if region.label[i] != label:
                raise Infeasible(i, "reached along two different axes")
            return
        eqn, whole = self.eqns[i], self.whole
        if i in whole:
            raise Infeasible(i, f"{eqn.primitive.name} is read outside the region too and lies on a path "
                                f"through it (it is computed once, whole)")
        dm = self.dim_map(i)
        if label is None:
            raise Infeasible(i, f"{eqn.primitive.name} cannot be sliced along the split axis")
        taken.add(i)
        self._growing.add(i)
        region.label[i] = label
        if label in dm.reduced:
            region.reducing[i] = dm.reduced[label]
            self._running = self._running or region.reducing[i] in RUNNING
        if label in dm.scanned:
            region.scans[i] = dm.scanned[label]
        out_axes, in_axes = dm.axes_of(label)
        uses, var_axis, operand_axis = self.graph.consumers, region.var_axis, region.operand_axis
        for k, var in enumerate(eqn.outvars):
            axis = out_axes[k]
            if axis is None:
                if i not in region.reducing:
                    raise Infeasible(i, f"{eqn.primitive.name} drops the split axis")
            else:
                self._set_size(region, i, var, axis)
            var_axis[var] = axis
            if isinstance(var, jx.DropVar):
                continue
            readers = uses.get(var, ())
            for j in readers:  # readers already in the region (grown backwards to here)
                if j in taken and j not in region.shift:
                    for pos, atom in enumerate(self.eqns[j].invars):
                        if atom is var:
                            self._check_read(j, axis, operand_axis[(j, pos)])
            if axis is None:
                continue
            if self.large(var):  # a large value (a result of the program too) is written slice by slice
                for j in readers:
                    if j not in taken and j not in whole:
                        queue.append((j, self._label_of_use(j, var, axis)))
        producers, labelled = self.graph.producer, len(in_axes)
        for pos, atom in enumerate(eqn.invars):
            axis = in_axes[pos] if pos < labelled else None
            operand_axis[(i, pos)] = axis
            if not isinstance(atom, jx.Var):
                continue
            if atom in var_axis:
                self._check_read(i, var_axis[atom], axis)
            if axis is None:
                continue
            self._set_size(region, i, atom, axis)
            producer = producers.get(atom)
            if producer is not None and producer not in taken and producer not in whole \
                    and (self.large(atom) or self._reads_large(producer)):
                k = self.eqns[producer].outvars.index(atom)
                queue.append((producer, self.dim_map(producer).outs[k][axis]))

    @staticmethod
    def _check_read(i: int, have, want, grown: bool = False) -> None:
        """Equation ``i`` reads a region value whose split axis is ``have`` along ``want``: raised as soon
        as both are known, while the region grows (one grown to its end only to fail was most of a
        planning's time), and again by :meth:`_check` once it is ``grown``. A reduced value read without
        the axis fails only then: it may turn out to be an online value."""
        if have is None and (want is not None or grown):
            raise Infeasible(i, "needs a value reduced over the split axis (that would take two passes)")
        if have is not None and have != want:
            raise Infeasible(i, "reads a region value along another axis")

    def _reads_large(self, i: int) -> bool:
        """Whether equation ``i`` reads a large value (then its small result is still worth recomputing)."""
        return any(isinstance(a, jx.Var) and self.large(a) for a in self.eqns[i].invars)

    def _label_of_use(self, j: int, var, axis: int):
        dm = self.dim_map(j)
        labels = {dm.ins[pos][axis] for pos, atom in enumerate(self.eqns[j].invars) if atom is var}
        if len(labels) != 1:
            raise Infeasible(j, "reads a value along two different axes")
        return labels.pop()

    def _label_from_operands(self, region: SplitRegion, j: int):
        for pos, atom in enumerate(self.eqns[j].invars):
            if isinstance(atom, jx.Var) and region.var_axis.get(atom) is not None:
                return self._label_of_use(j, atom, region.var_axis[atom])
        raise Infeasible(j, "needs a value reduced over the split axis (that would take two passes)")

    @staticmethod
    def _set_size(region: SplitRegion, i: int, var, axis) -> None:
        if axis is None:
            return
        size = var.aval.shape[axis]
        if region.size == 0:
            region.size = size
        elif region.size != size:
            raise Infeasible(i, "split axis changes length")

    def _between(self, region: SplitRegion) -> list[int]:
        """Equations outside ``region`` on a path that leaves it and re-enters."""
        return self._growing.between(region.eqns)

    def _check(self, region: SplitRegion) -> None:
        self._add_shift_axes(region)
        online = {v for i in region.shift | region.final for v in self.eqns[i].outvars}
        if region.shift:
            online |= {v for i in running_reducers(self.jaxpr, region) for v in self.eqns[i].outvars}
        for i in region.ordered():
            if i in region.final:
                continue  # reads the loop's results, after it
            for pos, atom in enumerate(self.eqns[i].invars):
                if isinstance(atom, jx.Var) and atom in region.var_axis:
                    have, want = region.var_axis[atom], region.operand_axis[(i, pos)]
                    if atom in online and want is None:
                        continue
                    self._check_read(i, have, want, grown=True)


def grow_region(jaxpr: jx.Jaxpr, graph: DataflowGraph, seed: int, label, split_size: int,
                whole: frozenset[int] = frozenset()) -> SplitRegion:
    """The region grown from ``seed`` along ``label``; raises :class:`Infeasible`.

    A cumulative op whose result is also read outside the region is computed once, whole, and read
    by the region as an input: recomputed in the loop, its running total would round otherwise than
    the whole op that the outside readers see, and a softmax normalised by one and exponentiated
    from the other is no longer normalised (fresh seed r73655148886). Equations in ``whole`` are
    computed once outside the region too.
    """
    while True:
        region = _Grower(jaxpr, graph, split_size, whole).grow(seed, label)
        shared = {i for i in region.scans if i != seed and any(
            j not in region.eqns for var in jaxpr.eqns[i].outvars for j in graph.uses(var))}
        if not shared:
            return region
        whole |= shared
