"""Per-primitive splitting rules: how dimensions correspond through an equation.

A rule labels every dimension of an equation's operands and results, the way
an einsum does: dimensions that carry the same *label* are one iteration
dimension of the equation, so slicing one of them means slicing all the
others at the same offsets. A dimension labelled ``None`` cannot be sliced
(a size-1 broadcast, the sorted axis of ``sort``, a merged ``reshape``
dimension...). A label present in operands but absent from every result is
*reduced*; ``DimMap.reduced`` names the monoid that combines partial results
computed on slices (``add`` for sums and contractions, ``max``, ``argmax``,
``top_k``...).

A scatter's reduced label (its indices run along the split axis) names the
scatter's own monoid; the loop then carries the scatter's result instead of
combining partial results (see :mod:`.emit`).

``chunk_params(eqn, out_shapes)`` gives the parameters an equation needs when
its results have the (smaller) ``out_shapes``: the shape parameters of
``broadcast_in_dim``, ``reshape``, ``iota``, ``slice``, ``gather`` and
``dynamic_slice``. Primitives missing from :data:`AXIS_RULES` stop a split
region (the report names them).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Hashable

import numpy as np
from hlopass import internals as jx

from hlopass.families import ARG_REDUCTIONS, CUMULATIVE, ELEMENTWISE, REDUCTIONS, dot_general_labels

from .kept import Kept

Label = Hashable


@dataclasses.dataclass
class DimMap:
    """Dimension labels of one equation: ``ins[k][d]`` and ``outs[k][d]`` (``None``: not splittable)."""

    ins: list[list[Label | None]]
    outs: list[list[Label | None]]
    reduced: dict[Label, str] = dataclasses.field(default_factory=dict)
    #: labels a cumulative op accumulates along: (monoid, reverse); a loop along one carries the running total
    scanned: dict[Label, tuple[str, bool]] = dataclasses.field(default_factory=dict)

    def out_axis(self, label: Label, k: int = 0) -> int | None:
        """Dimension of result ``k`` carrying ``label`` (``None`` if absent)."""
        return _index(self.outs[k], label)

    def in_axis(self, label: Label, k: int) -> int | None:
        """Dimension of operand ``k`` carrying ``label`` (``None`` if absent)."""
        return _index(self.ins[k], label)

    def axes_of(self, label: Label) -> tuple[tuple, tuple]:
        """``(out_axis(label, k) for every result, in_axis(label, k) for every operand)``, kept per label (a
        region grower asks for every equation it takes in, on every planning)."""
        kept = self.__dict__.setdefault("_axes_of", {})
        found = kept.get(label)
        if found is None:
            found = kept[label] = (tuple(_index(o, label) for o in self.outs), tuple(_index(i, label) for i in self.ins))
        return found


def _index(labels, label):
    if label is None:
        return None
    for d, lab in enumerate(labels):
        if lab == label:
            return d
    return None


def _shape(atom) -> tuple[int, ...]:
    return tuple(getattr(atom.aval, "shape", ()))


#: Primitives that keep every dimension but one (the parameter named here), along which they
#: are not splittable.
ALONG_AXIS = {"sort": "dimension"}


def _elementwise(eqn) -> DimMap:
    out_shape = _shape(eqn.outvars[0])
    rank = len(out_shape)
    ins = []
    for atom in eqn.invars:
        shape = _shape(atom)
        offset = rank - len(shape)
        ins.append([offset + d if shape[d] == out_shape[offset + d] else None for d in range(len(shape))])
    return DimMap(ins, [list(range(rank)) for _ in eqn.outvars])


def _broadcast_in_dim(eqn) -> DimMap:
    out_shape = tuple(eqn.params["shape"])
    operand = _shape(eqn.invars[0])
    dims = eqn.params["broadcast_dimensions"]
    op_labels = [dims[d] if operand[d] == out_shape[dims[d]] else None for d in range(len(operand))]
    return DimMap([op_labels] + [[None] * len(_shape(a)) for a in eqn.invars[1:]], [list(range(len(out_shape)))])


def _iota(eqn) -> DimMap:
    return DimMap([], [list(range(len(eqn.params["shape"])))])


def _transpose(eqn) -> DimMap:
    perm = eqn.params["permutation"]
    labels = [None] * len(perm)
    for out_dim, in_dim in enumerate(perm):
        labels[in_dim] = out_dim
    return DimMap([labels], [list(range(len(perm)))])


def _reduction(eqn) -> DimMap:
    axes = set(eqn.params["axes"])
    rank = len(_shape(eqn.invars[0]))
    in_labels = [("reduced", d) if d in axes else d for d in range(rank)]
    out_labels = [d for d in range(rank) if d not in axes]
    monoid = REDUCTIONS.get(eqn.primitive.name, eqn.primitive.name)  # argmax/argmin name their own monoid
    monoid = _boolean_monoid(monoid, eqn.outvars[0].aval.dtype)
    return DimMap([in_labels], [out_labels], {("reduced", d): monoid for d in axes})


def _boolean_monoid(monoid: str, dtype) -> str:
    """On booleans a sum is an or and a product an and (a ``dot_general`` of bools is an or of ands)."""
    if np.dtype(dtype) == np.bool_:
        return {"add": "or", "mul": "and", "max": "or", "min": "and"}.get(monoid, monoid)
    return monoid


def _dot_general(eqn) -> DimMap:
    lhs, rhs, out = dot_general_labels(eqn.params["dimension_numbers"], len(_shape(eqn.invars[0])),
                                       len(_shape(eqn.invars[1])))
    contracted = {label for label in lhs if label[0] == "contract"}
    monoid = _boolean_monoid("add", eqn.outvars[0].aval.dtype)
    return DimMap([lhs, rhs], [out], {label: monoid for label in contracted})


def _reshape(eqn) -> DimMap:
    if eqn.params.get("dimensions") is not None:
        return DimMap([[None] * len(_shape(eqn.invars[0]))], [[None] * len(eqn.params["new_sizes"])])
    src, dst = _shape(eqn.invars[0]), tuple(eqn.params["new_sizes"])
    src_labels, dst_labels = [None] * len(src), [None] * len(dst)
    src_prefix = _prefix_products(src)
    dst_prefix = _prefix_products(dst)
    for i in range(len(src)):
        for j in range(len(dst)):
            if src[i] == dst[j] and src[i] > 1 and src_prefix[i] == dst_prefix[j]:
                src_labels[i] = dst_labels[j] = j
    return DimMap([src_labels] + [[None] * len(_shape(a)) for a in eqn.invars[1:]], [dst_labels])


def _prefix_products(shape):
    out, acc = [], 1
    for size in shape:
        out.append(acc)
        acc *= size
    return out


def _squeeze(eqn) -> DimMap:
    dims = set(d % len(_shape(eqn.invars[0])) for d in eqn.params["dimensions"])
    labels, j = [], 0
    for d in range(len(_shape(eqn.invars[0]))):
        if d in dims:
            labels.append(None)
        else:
            labels.append(j)
            j += 1
    return DimMap([labels], [list(range(j))])


def _along_axis(eqn) -> DimMap:
    axis = eqn.params[ALONG_AXIS[eqn.primitive.name]]
    rank = len(_shape(eqn.invars[0]))
    labels = [None if d == axis else d for d in range(rank)]
    return DimMap([list(labels) for _ in eqn.invars], [list(labels) for _ in eqn.outvars])


def _cumulative(eqn) -> DimMap:
    # Parallel along every other dimension; along ``axis`` a loop over slices carries the running total
    # (the last element of each slice, the first with ``reverse``) into the next slice.
    rank = len(_shape(eqn.invars[0]))
    labels = list(range(rank))
    return DimMap([list(labels)], [list(labels)],
                  scanned={eqn.params["axis"]: (CUMULATIVE[eqn.primitive.name], bool(eqn.params["reverse"]))})


def _top_k(eqn) -> DimMap:
    rank = len(_shape(eqn.invars[0]))
    axis = eqn.params.get("axis", rank - 1) % rank
    in_labels = [("reduced", d) if d == axis else d for d in range(rank)]
    out_labels = [None if d == axis else d for d in range(rank)]
    return DimMap([in_labels], [list(out_labels), list(out_labels)], {("reduced", axis): "top_k"})


def _concatenate(eqn) -> DimMap:
    axis = eqn.params["dimension"]
    rank = len(_shape(eqn.outvars[0]))
    labels = [None if d == axis else d for d in range(rank)]
    return DimMap([list(labels) for _ in eqn.invars], [labels])


def _pad(eqn) -> DimMap:
    """An unpadded dimension runs through; a dimension padded at its ends only (a slice's cotangent)
    is split in the result alone, each step reading the whole operand (:func:`.emit.pad_window`)."""
    config = eqn.params["padding_config"]
    ins = [d if tuple(cfg) == (0, 0, 0) else None for d, cfg in enumerate(config)]
    outs = [d if cfg[2] == 0 else None for d, cfg in enumerate(config)]
    return DimMap([ins, []], [outs])


def _slice(eqn) -> DimMap:
    shape = _shape(eqn.invars[0])
    starts, limits = eqn.params["start_indices"], eqn.params["limit_indices"]
    strides = eqn.params.get("strides") or (1,) * len(shape)
    labels = [d if (starts[d], limits[d], strides[d]) == (0, shape[d], 1) else None for d in range(len(shape))]
    return DimMap([labels], [labels])


def _rev(eqn) -> DimMap:
    dims = set(eqn.params["dimensions"])
    labels = [None if d in dims else d for d in range(len(_shape(eqn.invars[0])))]
    return DimMap([labels], [labels])


def _triangular_solve(eqn) -> DimMap:
    # op(a) x = b (left side) solves each column of b on its own, x op(a) = b each row: those and the
    # batch dimensions (shared with the factor a) are parallel; whatever lower/transpose_a/unit_diagonal.
    rank = len(_shape(eqn.invars[1]))
    batch = list(range(rank - 2))
    free = rank - 1 if eqn.params["left_side"] else rank - 2
    b_labels = [d if d in batch or d == free else None for d in range(rank)]
    return DimMap([batch + [None, None], b_labels], [list(b_labels)])


def _gather(eqn) -> DimMap:
    # Parallel: the indices' batch dimensions (the axes the indices run over: result batch
    # dimensions, with the operand's batching dimension when there is one), and operand dimensions
    # the indexing does not touch (taken whole, not indexed: result offset dimensions). The indexed
    # dimensions stay whole, so every index mode (clip, fill, promise) means what it meant.
    dn = eqn.params["dimension_numbers"]
    operand, indices = _shape(eqn.invars[0]), _shape(eqn.invars[1])
    out_rank = len(_shape(eqn.outvars[0]))
    op_labels: list = [None] * len(operand)
    idx_labels: list = [None] * len(indices)
    out_labels: list = [None] * out_rank
    batch_out = [d for d in range(out_rank) if d not in dn.offset_dims]
    for k, out_dim in enumerate(batch_out):  # indices dimension k (the index vector is the last)
        label = ("indices", k)
        idx_labels[k] = out_labels[out_dim] = label
        if k in dn.start_indices_batching_dims:
            op_labels[dn.operand_batching_dims[list(dn.start_indices_batching_dims).index(k)]] = label
    windows = [d for d in range(len(operand)) if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    for d, out_dim in zip(windows, dn.offset_dims):
        if eqn.params["slice_sizes"][d] == operand[d] and d not in dn.start_index_map:
            op_labels[d] = out_labels[out_dim] = ("operand", d)
    return DimMap([op_labels, idx_labels], [out_labels])


def _gather_params(params, out_shapes):
    dn = params["dimension_numbers"]
    sizes = list(params["slice_sizes"])
    windows = [d for d in range(len(sizes)) if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    for d, out_dim in zip(windows, dn.offset_dims):
        sizes[d] = out_shapes[0][out_dim]
    return {**params, "slice_sizes": tuple(sizes)}


#: The monoid a scatter applies to the values it writes to one place.
SCATTER_MONOIDS = {"scatter-add": "add", "scatter-mul": "mul", "scatter-min": "min", "scatter-max": "max",
                   "scatter": "scatter"}


def _scatter(eqn) -> DimMap:
    # Parallel: operand dimensions the scatter does not index into, updated whole (shared by the
    # operand, the updates' window dimension and the result), and batching dimensions. The updates'
    # scatter dimensions (the axes the indices run over) are reduced: the loop carries the result
    # and applies the scatter of each slice of indices and updates to it, in order.
    dn = eqn.params["dimension_numbers"]
    operand, indices, updates = (_shape(a) for a in eqn.invars[:3])
    op_labels: list = [None] * len(operand)
    idx_labels: list = [None] * len(indices)
    upd_labels: list = [None] * len(updates)
    reduced = {}
    scatter_dims = [d for d in range(len(updates)) if d not in dn.update_window_dims]
    for k, upd_dim in enumerate(scatter_dims):  # indices dimension k (the index vector is the last)
        if k in dn.scatter_indices_batching_dims:
            label = ("indices", k)
            op_labels[dn.operand_batching_dims[list(dn.scatter_indices_batching_dims).index(k)]] = label
        else:
            label = ("reduced", k)
            reduced[label] = SCATTER_MONOIDS[eqn.primitive.name]
        idx_labels[k] = upd_labels[upd_dim] = label
    windows = [d for d in range(len(operand)) if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
    for d, upd_dim in zip(windows, dn.update_window_dims):
        if updates[upd_dim] == operand[d] and d not in dn.scatter_dims_to_operand_dims:
            op_labels[d] = upd_labels[upd_dim] = ("operand", d)
    return DimMap([op_labels, idx_labels, upd_labels], [list(op_labels)], reduced)


def _dynamic_slice(eqn) -> DimMap:
    # Dimensions taken whole (their start is clamped to 0) are parallel.
    operand = _shape(eqn.invars[0])
    labels = [d if eqn.params["slice_sizes"][d] == operand[d] else None for d in range(len(operand))]
    return DimMap([labels] + [[] for _ in eqn.invars[1:]], [list(labels)])


def _dynamic_update_slice(eqn) -> DimMap:
    # Dimensions the update covers whole (their start is clamped to 0) are parallel.
    operand, update = _shape(eqn.invars[0]), _shape(eqn.invars[1])
    labels = [d if update[d] == operand[d] else None for d in range(len(operand))]
    return DimMap([labels, list(labels)] + [[] for _ in eqn.invars[2:]], [list(labels)])


AXIS_RULES: dict[str, Callable[[jx.JaxprEqn], DimMap]] = {
    **{name: _elementwise for name in ELEMENTWISE},
    **{name: _reduction for name in (*REDUCTIONS, *ARG_REDUCTIONS)},
    **{name: _along_axis for name in ALONG_AXIS},
    **{name: _cumulative for name in CUMULATIVE},
    "broadcast_in_dim": _broadcast_in_dim,
    "iota": _iota,
    "transpose": _transpose,
    "dot_general": _dot_general,
    "reshape": _reshape,
    "squeeze": _squeeze,
    "top_k": _top_k,
    "concatenate": _concatenate,
    "pad": _pad,
    "slice": _slice,
    "rev": _rev,
    "triangular_solve": _triangular_solve,
    "gather": _gather,
    **{name: _scatter for name in SCATTER_MONOIDS},
    "dynamic_slice": _dynamic_slice,
    "dynamic_update_slice": _dynamic_update_slice,
}


def dim_map(eqn: jx.JaxprEqn) -> DimMap | None:
    """The rule's labelling of ``eqn``, or ``None`` when hlopass has no rule for its primitive (read
    only: within a split pass one equation's map is shared by every analysis that asks, see :data:`MAPS`)."""
    return MAPS.get(eqn, _dim_map)


def _dim_map(eqn: jx.JaxprEqn) -> DimMap | None:
    rule = AXIS_RULES.get(eqn.primitive.name)
    return None if rule is None or eqn.effects else rule(eqn)


#: Each equation's map, kept while the split pass runs (``MAPS.active()``, see :mod:`.kept`).
MAPS = Kept()


# -- shape parameters of a slice -------------------------------------------------------------

def _with_shape(key):
    def update(params, out_shapes):
        return {**params, key: tuple(out_shapes[0])}
    return update


def _slice_params(params, out_shapes):
    # Only dimensions the rule labels (whole, stride 1) are sliced; every other dimension keeps its
    # start, limit and stride (a strided dimension's result length is not limit - start).
    starts, limits = params["start_indices"], params["limit_indices"]
    strides = params.get("strides") or (1,) * len(starts)
    new_limits = []
    for start, limit, stride, size in zip(starts, limits, strides, out_shapes[0]):
        whole = -(-(limit - start) // stride)
        new_limits.append(limit if size == whole else start + size)
    return {**params, "limit_indices": tuple(new_limits)}


def _dynamic_slice_params(params, out_shapes):
    return {**params, "slice_sizes": tuple(out_shapes[0])}


CHUNK_PARAMS: dict[str, Callable[[dict, list[tuple[int, ...]]], dict]] = {
    "broadcast_in_dim": _with_shape("shape"),
    "gather": _gather_params,
    "dynamic_slice": _dynamic_slice_params,
    "iota": _with_shape("shape"),
    "reshape": _with_shape("new_sizes"),
    "slice": _slice_params,
}


def chunk_params(eqn: jx.JaxprEqn, out_shapes: list[tuple[int, ...]]) -> dict:
    """``eqn.params`` for results of shapes ``out_shapes`` (operands sliced accordingly)."""
    update = CHUNK_PARAMS.get(eqn.primitive.name)
    return eqn.params if update is None else update(eqn.params, out_shapes)


# -- monoids combining partial results -------------------------------------------------------

def identity(monoid: str, dtype):
    """The identity element of ``monoid`` for ``dtype`` (a scalar array)."""
    return jx.reduction_identity(monoid, dtype)


def combine(monoid: str, acc, part):
    """``acc ⊕ part`` for the elementwise monoids (and ``logaddexp``, a running ``cumlogsumexp``)."""
    from jax import lax
    import jax.numpy as jnp
    ops = {"add": lax.add, "mul": lax.mul, "max": lax.max, "min": lax.min,
           "and": lax.bitwise_and, "or": lax.bitwise_or, "xor": lax.bitwise_xor, "logaddexp": jnp.logaddexp}
    return ops[monoid](acc, part)

