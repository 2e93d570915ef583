"""Emitting a split region as a loop over slices (traced with ordinary ``jax.lax`` code).

:class:`LoopPlan` turns a :class:`~.region.SplitRegion` into the
``build`` function of an interpreter :class:`~hlopass.interpreter.Replacement`:
a ``fori_loop`` over ``size // chunk`` slices of the split axis. When the chunk
does not divide the axis (never padding, so nothing fake can win a max, a min or
a top-k), the loop runs one more whole step moved back to end at the axis's end
(:attr:`LoopPlan.overlap_tail`; its rows shared with the step before count once
in each reduction, as the monoid's identity in every other step), or, where a
step depends on the ones before (:func:`can_overlap`), one remainder step of
``size % chunk`` after it, which XLA compiles as a second copy. Each step
slices the region's inputs with ``dynamic_slice``, re-binds the region's
equations on the slices, and

* writes a result that keeps the axis into its buffer (``dynamic_update_slice``);
* combines a result that reduces the axis with its monoid: ``add``/``mul``/
  ``max``/``min``/``and``/``or``/``xor`` elementwise, ``argmax``/``argmin``
  as (value, index) pairs keeping the first index on ties (NaN wins, as in
  ``jnp.argmax``), ``top_k`` as a running top-k merged with the slice's
  top-k (the first slice initialises it, so no sentinel can win);
  a step's ``top_k`` over a long row selects in two levels (:mod:`.select`);
* scatters the slice's indices and updates into a scatter's running result
  (initialised with the scatter's operand), in order, when the indices run
  along the split axis.

Floating ``max``/``min`` reductions propagate NaN and ``top_k`` ranks every NaN
first, whatever kernel XLA picks for one slice (see the README's NaN rule);
a 16-bit contraction over the split axis keeps float32 partial products.

``step_function`` is the work of one step as a standalone function; when one
step is still too large, the pass splits that program again along a second
axis (nested loops).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Callable

import jax.numpy as jnp
from jax import lax
from hlopass import internals as jx

from hlopass.interpreter import bind_equation
from hlopass.families import ELEMENTWISE_MONOIDS
from hlopass.jaxpr_utils import trace_flat
from hlopass.sharding import conform, distributed_type

from .region import SplitRegion
from .online import FINAL, Scales, clamp, rescale
from .rules import SCATTER_MONOIDS, chunk_params, combine, identity
from .select import grouped_top_k


@dataclasses.dataclass
class LoopPlan:
    """How to loop over one region: inputs, outputs, chunk size."""

    jaxpr: jx.Jaxpr
    region: SplitRegion
    inputs: list[tuple[jx.Var, int | None]]   # (value, split dimension) read by the region
    outputs: list[jx.Var]                      # region values read after the loop
    chunk: int
    #: optional rewrite of one step's program (nested splitting); gets the traced ClosedJaxpr
    refine_step: Callable[[jx.ClosedJaxpr], jx.ClosedJaxpr] | None = None
    #: the pass's choice that produced this plan (for its report)
    candidate: object = None
    #: steps written out one after the other instead of a loop (short axes, see ``unroll.py``)
    unroll: bool = False
    #: a step's ``top_k`` over a long row selects in two levels (``select.py``)
    grouped_top_k: bool = True
    #: a step's product with a thin operand is bound as a multiply and a sum (accelerators, where
    #: XLA fuses it with the computation of the other operand)
    fuse_thin_dots: bool = False
    #: steps per iteration of the emitted loop (``fori_loop``'s ``unroll``): fewer iterations, each
    #: of which costs an accelerator a round trip to the host
    steps_per_iteration: int = 1
    #: a 16-bit product accumulated in float32 is bound on operands converted to float32 (the same
    #: products and sums): XLA:CPU cannot run a 16-bit dot into float32 for some operand layouts
    #: ("Unsupported element type for DotThunk::Execute", fresh seed s937818910445)
    upcast_16_bit_dots: bool = False
    #: when the chunk does not divide the axis, the last step is a whole chunk ending at the axis's end
    #: (overlapping the step before it) instead of a short step XLA compiles a second time; see
    #: :attr:`overlaps` and :func:`can_overlap`
    overlap_tail: bool = False

    @functools.cached_property
    def carried(self) -> list:
        """Values carried by the loop: the outputs, then a ``top_k``'s other result when only one is
        used (the merge needs values and indices)."""
        hidden = []
        for i, monoid in self.region.reducing.items():
            if monoid == "top_k":
                hidden += [v for v in self.jaxpr.eqns[i].outvars if v not in self.outputs and v not in hidden]
        if self.online is None:
            return list(self.outputs) + hidden
        after = {v for i in self.region.shift | self.region.final for v in self.jaxpr.eqns[i].outvars}
        after |= {v for v, k in self.online.kinds.items() if k == FINAL}
        maxima = [self.jaxpr.eqns[i].outvars[0] for i in self.online.maxima]
        read_after = [v for i in sorted(self.region.reducing) for v in self.jaxpr.eqns[i].outvars
                      if any(v in self.jaxpr.eqns[j].invars for j in self.region.final)]
        visible = [v for v in self.outputs if v not in after]
        return visible + [v for v in dict.fromkeys(maxima + read_after) if v not in visible] + hidden

    @property
    def online(self):
        """The running maxima and shift program of an online region (``None`` otherwise)."""
        return self.region.online

    @functools.cached_property
    def scales(self):
        return Scales(self.jaxpr, self.region, self.online)

    @functools.cached_property
    def scatters(self) -> list[tuple[int, jx.Var]]:
        """Scatters whose indices run along the split axis: ``(equation, result)``. The loop carries
        their result and scatters each slice into it (the operand is the initial value)."""
        return [(i, self.jaxpr.eqns[i].outvars[0]) for i in sorted(self.region.reducing)
                if self.jaxpr.eqns[i].primitive.name in SCATTER_MONOIDS]

    @property
    def input_vars(self) -> list[jx.Var]:
        return list(dict.fromkeys(var for var, _ in self.inputs))

    @property
    def iterations(self) -> int:
        return -(-self.region.size // self.chunk)

    @property
    def overlaps(self) -> bool:
        """Whether the loop ends with an overlapping step: asked for, and a chunk that leaves a remainder
        after at least one whole step."""
        return self.overlap_tail and self.region.size > self.chunk and self.region.size % self.chunk != 0

    def output_axis(self, var) -> int | None:
        return self.region.var_axis[var]

    def monoid_of(self, var) -> str:
        return self.region.reducing[self.producer(var)]

    def producer(self, var) -> int:
        """The region equation that defines ``var`` (its index in ``jaxpr``)."""
        for i in self.region.eqns:
            if var in self.jaxpr.eqns[i].outvars:
                return i
        raise KeyError(var)

    # -- one step ------------------------------------------------------------------------------
    def step_values(self, start, size: int, values: dict, scattered: dict | None = None,
                    running: dict | None = None, carries: dict | None = None) -> list:
        """Partial results of one slice ``[start, start + size)``: one per output, plus an
        argmax/argmin's value for each such output (appended in output order). ``scattered`` holds
        the running result of each of :attr:`scatters` (by equation), scattered into here."""
        sliced = {}
        scattered = scattered or {}

        def operand(i, pos, atom):
            if not isinstance(atom, jx.Var):
                return atom.val
            if atom in env:
                return env[atom]
            axis = self.region.operand_axis[(i, pos)]
            key = (atom, axis)
            if key not in sliced:
                value = values[atom]
                sliced[key] = value if axis is None else lax.dynamic_slice_in_dim(
                    value, start, size, axis, allow_negative_indices=False)   # start is never negative
            return sliced[key]

        env: dict = {}
        extras: dict = {}
        merged: dict = {}   # results of products bound together with an earlier sibling
        new_carries: dict = {}
        entries: dict = {}  # online: the shift program's values, clamped, as the region reads them
        kinds = self.online.kinds if self.online is not None else {}
        for i in self.region.ordered():
            eqn = self.jaxpr.eqns[i]
            if i in self.region.final or kinds.get(eqn.outvars[0]) == FINAL:
                continue  # known after the loop
            if self.online is not None and i in self.online.deferred:  # a factor applied after the loop
                scaled = next(a for a in eqn.invars if kinds.get(a) not in (FINAL, None) or a in env)
                env[eqn.outvars[0]] = env[scaled].astype(eqn.outvars[0].aval.dtype)
                continue
            if i in self.region.shift:
                invals = [env[a] if isinstance(a, jx.Var) and a in env else operand(i, pos, a)
                          for pos, a in enumerate(eqn.invars)]
                env.update(zip(eqn.outvars, bind_equation(eqn, invals)))
                continue
            invals = [operand(i, pos, atom) for pos, atom in enumerate(eqn.invars)]
            if self.online is not None:
                for pos, atom in enumerate(eqn.invars):
                    if isinstance(atom, jx.Var) and atom in self.online.entries:
                        if atom not in entries:
                            entries[atom] = clamp(env[atom])
                        invals[pos] = entries[atom]
            if i in merged:   # bound with a sibling product of the same operand (below)
                env.update(zip(eqn.outvars, [merged.pop(i)]))
                continue
            if i in self.sibling_thin_dots:
                parts = self._sibling_operands(i, env, operand)
                if parts is not None:
                    results = _merged_thin_dots(*parts)
                    env.update(zip(eqn.outvars, [results[0]]))
                    merged.update(zip(self.sibling_thin_dots[i][1:], results[1:]))
                    continue
            if i in scattered:
                invals[0] = scattered[i]
            if i in self.region.scans and carries[i].dtype != eqn.outvars[0].aval.dtype:
                # a 16-bit cumulative sum or product runs in float32 within the slice too
                invals = [invals[0].astype(carries[i].dtype), *invals[1:]]
            if self.overlaps and i in self.region.reducing:
                invals = self._without_shared_rows(i, eqn, invals, start)
            outs, extra = self._bind(i, eqn, invals, start, size)
            if running is not None and eqn.outvars[0] in running:  # the running maximum (NaN first), its flags
                outs = [combine(self.region.reducing[i], running[eqn.outvars[0]], outs[0])]
            if i in self.region.scans:  # a cumulative op along the axis: the running total before this slice
                monoid, reverse = self.region.scans[i]
                axis = self.region.var_axis[eqn.outvars[0]]
                carry = carries[i]   # float32 for a 16-bit sum or product
                total = combine(monoid, carry, outs[0].astype(carry.dtype))
                new_carries[i] = lax.slice_in_dim(total, 0 if reverse else size - 1, 1 if reverse else size, axis=axis)
                outs = [total.astype(eqn.outvars[0].aval.dtype)]
            env.update(zip(eqn.outvars, outs))
            if extra is not None:
                extras[eqn.outvars[0]] = extra
        results = [env[v] for v in self.carried]
        results += [extras[v] for v in self.carried if v in extras]
        if self.online is not None:
            whole = {var: values[var] for var, axis in self.inputs if axis is None}
            results += self.scales(entries, whole)
        results += [new_carries[i] for i in sorted(self.region.scans)]
        return results

    def _without_shared_rows(self, i: int, eqn, invals, start) -> list:
        """Operands of reduction ``i`` whose rows the overlapping last step covers again replaced by the
        monoid's identity, in every step but the last: each row enters the reduction once, from the step
        that also writes it last (so a value written by one loop and summed by another rounds alike)."""
        last = self.region.size - self.chunk
        masked = list(invals)
        for pos, atom in enumerate(eqn.invars):
            axis = self.region.operand_axis.get((i, pos))
            if not isinstance(atom, jx.Var) or axis is None:
                continue
            value = invals[pos]
            shape = [1] * jnp.ndim(value)
            shape[axis] = jnp.shape(value)[axis]
            rows = start + lax.broadcasted_iota(jnp.int32, tuple(shape), axis)
            keep = (rows < last) | (start == last)
            dtype = jnp.result_type(value)
            fill = jnp.zeros((), dtype) if eqn.primitive.name == "dot_general" else \
                identity(self.region.reducing[i], dtype)
            masked[pos] = jnp.where(keep, value, fill)
        return masked

    def _bind(self, i: int, eqn, invals, start, size: int):
        """Results of equation ``i`` on a slice (global indices), and an arg-reduction's value."""
        shapes = []
        for var in eqn.outvars:
            shape = list(var.aval.shape)
            axis = self.region.var_axis.get(var)
            if axis is not None:
                shape[axis] = size
            shapes.append(tuple(shape))
        monoid = self.region.reducing.get(i)
        params = chunk_params(eqn, shapes)
        if eqn.primitive.name == "top_k":
            invals = [_positive_nan(invals[0])]
        if monoid == "top_k" and size < eqn.params["k"]:
            outs = _whole_slice_as_top_k(eqn, invals[0])
        elif eqn.primitive.name == "top_k" and self.grouped_top_k and not getattr(self.candidate, "nested", False) \
                and eqn.params.get("axis", -1) in (-1, jnp.ndim(invals[0]) - 1) \
                and (grouped := grouped_top_k(invals[0], eqn.params["k"], eqn.outvars[1].aval.dtype)) is not None:
            # (a step split again keeps its top_k whole: the inner loop merges it along its own axis)
            outs = grouped
        elif eqn.primitive.name == "pad" and self.region.var_axis.get(eqn.outvars[0]) is not None and \
                tuple(eqn.params["padding_config"][self.region.var_axis[eqn.outvars[0]]]) != (0, 0, 0):
            outs = [pad_window(invals[0], invals[1], eqn.params["padding_config"],
                               self.region.var_axis[eqn.outvars[0]], start, size)]
        elif eqn.primitive.name == "dot_general":
            if monoid == "add" and _is_low_float(eqn.outvars[0].aval.dtype):
                # partial products stay in float32 until the end, as XLA accumulates one dot
                params = {**params, "preferred_element_type": jnp.dtype(jnp.float32)}
                if self.upcast_16_bit_dots:
                    invals = [x.astype(jnp.float32) if _is_low_float(jnp.result_type(x)) else x for x in invals]
            fused = _thin_dot_as_sum(invals, params) if self.fuse_thin_dots else None
            outs = [fused] if fused is not None else _bind_dot(eqn, invals, params)
        else:
            outs = bind_equation(eqn, invals, params)
        if eqn.primitive.name in NAN_PROPAGATING and jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.inexact):
            outs = [_propagate_nan(invals[0], outs[0], eqn.params["axes"])]
        if eqn.primitive.name == "iota" and self.region.var_axis[eqn.outvars[0]] == eqn.params["dimension"]:
            outs = [outs[0] + lax.convert_element_type(start, outs[0].dtype)]
        extra = None
        if monoid in ("argmax", "argmin"):
            axis = eqn.params["axes"][0]
            local = jnp.expand_dims(outs[0], axis)
            extra = jnp.squeeze(jnp.take_along_axis(invals[0], local, axis), axis)
        if monoid in ("argmax", "argmin", "top_k"):
            index_pos = 0 if monoid != "top_k" else 1
            outs[index_pos] = outs[index_pos] + lax.convert_element_type(start, outs[index_pos].dtype)
        return outs, extra

    @functools.cached_property
    def sibling_thin_dots(self) -> dict[int, tuple[int, ...]]:
        """Products of one large region value with thin operands, contracting the same dimensions of it
        (a kernel row block times a vector and times the points: a gradient's two sums), by the first
        of them. On an accelerator they are bound as one product with the thin operands side by side,
        so the large value has one reader and XLA fuses it instead of storing it."""
        if not self.fuse_thin_dots or self.online is not None:
            return {}
        groups: dict = collections.defaultdict(list)
        for i in self.region.ordered():
            eqn = self.jaxpr.eqns[i]
            if eqn.primitive.name != "dot_general" or i in self.region.final or i in self.region.shift \
                    or _is_low_float(eqn.outvars[0].aval.dtype):
                continue
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            lhs, rhs = eqn.invars
            if lb or rb or not isinstance(lhs, jx.Var) or not isinstance(rhs, jx.Var) or lhs == rhs:
                continue
            if fusible_dot(lhs.aval.shape, rhs.aval.shape, eqn.params["dimension_numbers"]) != "thin":
                continue
            lfree = math.prod(d for k, d in enumerate(lhs.aval.shape) if k not in lc)
            rfree = math.prod(d for k, d in enumerate(rhs.aval.shape) if k not in rc)
            large, contract = (lhs, tuple(lc)) if rfree <= lfree else (rhs, tuple(rc))
            groups[(large, contract)].append(i)
        return {members[0]: tuple(members) for members in groups.values() if len(members) > 1}

    def _sibling_operands(self, first: int, env: dict, operand):
        """``(large value, its contracting dimensions, [(thin operand, its contracting dimensions,
        large on the left, result dtype)])`` for the group led by ``first``, or ``None`` when a thin
        operand is computed later in the step."""
        parts, large_value, large_contract = [], None, None
        for i in self.sibling_thin_dots[first]:
            eqn = self.jaxpr.eqns[i]
            (lc, rc), _ = eqn.params["dimension_numbers"]
            lhs, rhs = eqn.invars
            lfree = math.prod(d for k, d in enumerate(lhs.aval.shape) if k not in lc)
            rfree = math.prod(d for k, d in enumerate(rhs.aval.shape) if k not in rc)
            on_left = rfree <= lfree
            thin_pos, thin_var = (1, rhs) if on_left else (0, lhs)
            if thin_var not in env and thin_var in self.region.var_axis:
                return None
            if large_value is None:
                large_pos = 0 if on_left else 1
                large_value = operand(i, large_pos, eqn.invars[large_pos])
                large_contract = tuple(lc if on_left else rc)
            parts.append((operand(i, thin_pos, thin_var), tuple(rc if on_left else lc), on_left,
                          eqn.outvars[0].aval.dtype))
        return large_value, large_contract, parts

    def step_function(self, size: int) -> Callable:
        """``f(start, *input values, *scattered results) -> step results`` for slices of ``size``,
        nested-split if asked."""
        names = self.input_vars
        scatter_eqns = [i for i, _ in self.scatters]
        maxima = self.maxima

        scans = sorted(self.region.scans)

        def step(start, *vals):
            values, states = vals[:len(names)], vals[len(names):len(names) + len(scatter_eqns)]
            rest = vals[len(names) + len(scatter_eqns):]
            running = dict(zip(maxima, rest[:len(maxima)])) if self.online is not None else None
            carries = dict(zip(scans, rest[len(maxima):]))
            return self.step_values(start, size, dict(zip(names, values)), dict(zip(scatter_eqns, states)), running,
                                    carries)

        if self.refine_step is None:
            return step
        avals = [jx.ShapedArray((), jnp.int32)] + [v.aval for v in names] + [v.aval for _, v in self.scatters] \
            + [v.aval for v in maxima] + [self.carry_aval(i) for i in scans]
        closed = trace_flat(step, avals, "split_step")
        refined = self.refine_step(closed)
        return jx.jaxpr_as_fun(refined)

    # -- the loop ------------------------------------------------------------------------------
    def build(self, *input_values) -> list:
        """Values of ``self.outputs`` computed by the loop (the Replacement's builder)."""
        size, chunk = self.region.size, self.chunk
        full, remainder = divmod(size, chunk)
        if self.overlaps:  # one more whole step, ending at the axis's end, instead of a short one
            full, remainder = full + 1, 0
        step = self.step_function(chunk)
        arg_outputs = [v for v in self.carried if self._is_arg_reduced(v)]
        has_top_k = any(self._monoid_or_none(v) == "top_k" for v in self.carried)
        scattered = [v for _, v in self.scatters]
        values = dict(zip(self.input_vars, input_values))

        maxima = self.maxima
        sums = [self.jaxpr.eqns[i].outvars[0] for i in self.online.sums] if self.online is not None else []
        n_state = len(self.carried) + len(arg_outputs)

        scans = sorted(self.region.scans)
        n_scales = len(sums)
        reverse = any(rev for _, rev in self.region.scans.values())

        def running(state):  # the scatters' running results, the running maxima, the cumulative totals
            return [state[self.carried.index(v)] for v in scattered] + [state[self.carried.index(v)] for v in maxima] \
                + list(state[n_state + n_scales:])

        def accumulate(state, start, partial):
            new_state = list(state)
            n = len(self.carried)
            extras = dict(zip(arg_outputs, partial[n:]))
            top_k_done = set()
            for k, var in enumerate(self.carried):
                axis = self.output_axis(var)
                if axis is not None:
                    new_state[k] = lax.dynamic_update_slice_in_dim(state[k], _like(partial[k], state[k]), start, axis,
                                                                     allow_negative_indices=False)
                    continue
                monoid = self.monoid_of(var)
                if var in maxima:
                    new_state[k] = partial[k]  # the step took the maximum with the state already
                elif var in sums:
                    m = sums.index(var)
                    old_scale, new_scale = state[n_state + m], partial[n + len(arg_outputs) + m]
                    new_state[k] = rescale(state[k], new_scale - old_scale) + partial[k].astype(state[k].dtype)
                    new_state[n_state + m] = new_scale
                elif var in scattered:
                    new_state[k] = partial[k]  # the slice was scattered into the running result
                elif monoid in ELEMENTWISE_MONOIDS:
                    new_state[k] = combine(monoid, state[k], _like(partial[k], state[k]))
                elif monoid in ("argmax", "argmin"):
                    j = n + arg_outputs.index(var)
                    new_state[k], new_state[j] = _arg_merge(monoid, (state[j], state[k]), (extras[var], partial[k]))
                elif monoid == "top_k" and self.producer(var) not in top_k_done:
                    i = self.producer(var)
                    top_k_done.add(i)
                    self._top_k_merge(i, state, new_state, partial)
            if scans:
                new_state[n_state + n_scales:] = partial[len(partial) - len(scans):]
            return new_state

        operands = [self._operand_value(i, values) for i, _ in self.scatters]
        if has_top_k:
            first = step(jnp.int32(0), *input_values, *operands)
            state = self._initial_state(first, values)
            loop_from = 1
        else:
            state = self._initial_state(None, values)
            if any(distributed_type(jx.typeof(v)) for v in (*input_values, *operands)):
                # the carries take the types of the step's results (mesh, sharding, manual axes)
                types = trace_flat(step, [jx.typeof(v) for v in (jnp.int32(0), *input_values, *operands)],
                                   "split_step_types").out_avals
                state = [conform(value, aval) for value, aval in zip(state, types)]
            loop_from = 0

        def body(it, state):
            if self.overlaps:
                start = jnp.minimum(it * chunk, size - chunk).astype(jnp.int32)
            else:
                start = ((full - 1 - it) * chunk if reverse else it * chunk).astype(jnp.int32)
            return accumulate(state, start, step(start, *input_values, *running(state)))

        def tail(state):
            start = jnp.int32(full * chunk)
            return accumulate(state, start, self.step_function(remainder)(start, *input_values, *running(state)))

        if sums:
            state = state + [jnp.zeros(v.aval.shape, self.scales.dtype) for v in sums]
        for i in scans:
            aval = self.carry_aval(i)
            state.append(jnp.full(aval.shape, _scan_identity(self.region.scans[i][0], aval.dtype), aval.dtype))
        if remainder and reverse:  # a reverse cumulative op runs from the end: the short last slice first
            state = tail(state)
        if full > loop_from and self.unroll:
            for it in range(loop_from, full):
                state = body(jnp.int32(it), state)
        elif full > loop_from:
            state = lax.fori_loop(loop_from, full, body, state,
                                   unroll=max(1, min(self.steps_per_iteration, full - loop_from)))
        if remainder and not reverse:
            state = tail(state)
        if self.online is None:
            return [value.astype(var.aval.dtype) for value, var in zip(state, self.outputs)]
        return self._finish_online(state, values, sums, n_state)

    def carry_aval(self, i: int):
        """The running total of cumulative op ``i``: its result with the split axis of length one."""
        var = self.jaxpr.eqns[i].outvars[0]
        shape = list(var.aval.shape)
        shape[self.region.var_axis[var]] = 1
        return jx.ShapedArray(tuple(shape), _accumulator_dtype(self.region.scans[i][0], var.aval.dtype))

    @property
    def maxima(self) -> list:
        """Results of the running maxima of an online region (carried, taken with each slice)."""
        return [self.jaxpr.eqns[i].outvars[0] for i in self.online.maxima] if self.online is not None else []

    def _finish_online(self, state, values: dict, sums: list, n_state: int) -> list:
        """The outputs of an online loop: the shift program on the final maxima (unclamped), and each
        running sum brought from its last (clamped) scale to the scale of the true shift values."""
        env = {v: state[self.carried.index(v)] for v in self.maxima}
        for i in self.online.shift:
            eqn = self.jaxpr.eqns[i]
            invals = [a.val if isinstance(a, jx.Literal) else env[a] if a in env else values[a] for a in eqn.invars]
            env.update(zip(eqn.outvars, bind_equation(eqn, invals)))
        whole = {var: values[var] for var, axis in self.inputs if axis is None}
        entries = {v: env[v] for v in self.online.entries}
        true_scales = self.scales(entries, whole)
        for var in self.carried:
            value = state[self.carried.index(var)]
            if var in sums:
                m = sums.index(var)
                value = value * jnp.exp(true_scales[m] - state[n_state + m]).astype(value.dtype)
            env[var] = value
        if self.online.final:  # the final program on the sums, then each sum's deferred factor
            for i in self.online.final:
                eqn = self.jaxpr.eqns[i]
                invals = [a.val if isinstance(a, jx.Literal) else env[a] if a in env else values[a]
                          for a in eqn.invars]
                env.update(zip(eqn.outvars, bind_equation(eqn, [v.astype(a.aval.dtype) if hasattr(v, "astype")
                                                                 and hasattr(a, "aval") else v
                                                                 for v, a in zip(invals, eqn.invars)])))
            finals = {v: env[v] for i in self.online.final for v in self.jaxpr.eqns[i].outvars}
            factors = self.scales(entries, whole, finals)
            for m, var in enumerate(sums):
                env[var] = env[var] * factors[m].astype(env[var].dtype)
        return [env[var].astype(var.aval.dtype) for var in self.outputs]

    def _monoid_or_none(self, var):
        return None if self.output_axis(var) is not None else self.monoid_of(var)

    def _is_arg_reduced(self, var) -> bool:
        return self._monoid_or_none(var) in ("argmax", "argmin")

    def _operand_value(self, i: int, values: dict):
        atom = self.jaxpr.eqns[i].invars[0]
        return atom.val if isinstance(atom, jx.Literal) else values[atom]

    def _initial_state(self, first, values: dict) -> list:
        """Buffers for axis outputs, identities for accumulators, a scatter's operand for its running
        result; the first step's values if given; each with its value's manual axes and sharding."""
        state = []
        scatter_of = {v: i for i, v in self.scatters}
        for k, var in enumerate(self.carried):
            aval = var.aval
            if var in scatter_of and first is None:
                state.append(jnp.asarray(self._operand_value(scatter_of[var], values), aval.dtype))
                continue
            if first is not None and self._monoid_or_none(var) is not None:
                monoid = self._monoid_or_none(var)
                state.append(first[k].astype(_accumulator_dtype(monoid, aval.dtype))
                             if monoid in ELEMENTWISE_MONOIDS and var not in scatter_of else first[k])
                continue
            if self.output_axis(var) is not None:
                buf = jnp.zeros(aval.shape, aval.dtype)
                if first is not None:
                    buf = lax.dynamic_update_slice_in_dim(buf, first[k].astype(aval.dtype), 0, self.output_axis(var))
                state.append(buf)
            elif self._monoid_or_none(var) in ("argmax", "argmin"):
                state.append(jnp.zeros(aval.shape, aval.dtype))
            else:
                monoid = self.monoid_of(var)
                dtype = _accumulator_dtype(monoid, aval.dtype)
                state.append(jnp.full(aval.shape, identity(monoid, dtype), dtype))
        n = len(self.carried)
        for m, var in enumerate(v for v in self.carried if self._is_arg_reduced(v)):
            if first is not None:
                state.append(first[n + m])
                continue
            eqn = self.jaxpr.eqns[self.producer(var)]
            dtype = eqn.invars[0].aval.dtype
            worst = "max" if self.monoid_of(var) == "argmin" else "min"
            state.append(jnp.full(var.aval.shape, _extreme(worst, dtype), dtype))
        # a loop carry has the type of the value it builds: its varying manual axes (inside
        # shard_map) and its explicit sharding, which the step's results have
        avals = [v.aval for v in self.carried] + [v.aval for v in self.carried if self._is_arg_reduced(v)]
        return [conform(value, aval) for value, aval in zip(state, avals)]

    def _top_k_merge(self, i: int, state, new_state, partial) -> None:
        eqn = self.jaxpr.eqns[i]
        slots = [self.carried.index(v) if v in self.carried else None for v in eqn.outvars]
        axis = eqn.params.get("axis", len(eqn.outvars[0].aval.shape) - 1)
        values = _positive_nan(jnp.concatenate([state[slots[0]], partial[slots[0]]], axis=axis))
        indices = jnp.concatenate([state[slots[1]], partial[slots[1]]], axis=axis)
        best, where = bind_equation(eqn, [values])
        new_state[slots[0]] = best
        new_state[slots[1]] = jnp.take_along_axis(indices, where.astype(jnp.int32), axis=axis)


def can_overlap(plan: LoopPlan) -> bool:
    """Whether ``plan``'s loop may end with an overlapping step (:attr:`LoopPlan.overlap_tail`): every
    result is written along the axis or reduced by an elementwise monoid (a row left out of one step's
    sum is the identity there; an online region's running maximum and rescaled sums too), and no step
    depends on the ones before it otherwise (no scan, scatter, ``top_k`` or arg-reduction, whose
    repeated rows would count twice or tie); not for written-out steps, a step split again (its inner
    planning would see the mask) or products of thin operands bound together (accelerators)."""
    region = plan.region
    return (not plan.unroll and not plan.fuse_thin_dots and not region.scans
            and not plan.scatters and not getattr(plan.candidate, "nested", False)
            and all(monoid in ELEMENTWISE_MONOIDS for monoid in region.reducing.values()))


#: A ``dot_general`` operand is thin when its free dimensions hold at most this many elements.
THIN_DOT_ELEMENTS = 8
#: ...and the product is bound as a sum only when the other operand is at least this large.
THIN_DOT_MIN_OTHER = 2**20


def pad_window(operand, padding_value, padding_config, axis: int, start, size: int):
    """``lax.pad(operand, padding_value, padding_config)[start:start + size]`` along ``axis`` (padded
    at its ends only), without building the padded whole: the step's positions are looked up in
    the operand, those outside it take the padding value."""
    low, _, _ = padding_config[axis]
    length = jnp.shape(operand)[axis]
    source = lax.convert_element_type(start, jnp.int32) + jnp.arange(size, dtype=jnp.int32) - low
    inside = (source >= 0) & (source < length)
    taken = jnp.take(operand, jnp.clip(source, 0, max(length - 1, 0)), axis=axis) if length else \
        jnp.zeros((*jnp.shape(operand)[:axis], size, *jnp.shape(operand)[axis + 1:]), jnp.result_type(operand))
    shape = [1] * jnp.ndim(operand)
    shape[axis] = size
    window = jnp.where(inside.reshape(shape), taken, padding_value.astype(taken.dtype))
    rest = [(0, 0, 0) if d == axis else tuple(cfg) for d, cfg in enumerate(padding_config)]
    return lax.pad(window, padding_value.astype(window.dtype), rest) if any(c != (0, 0, 0) for c in rest) else window


def fusible_dot(lshape, rshape, dimension_numbers) -> str | None:
    """``"thin"`` for a product with a thin operand (a vector, a few columns) against a large one,
    ``"short"`` for one with a short contraction and a large result, else ``None``: the products an
    accelerator's step binds as elementwise work XLA fuses (:func:`_thin_dot_as_sum`)."""
    (lc, rc), (lb, rb) = dimension_numbers
    lfree = [d for d in range(len(lshape)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rshape)) if d not in rc and d not in rb]
    thin = lambda shape, free: math.prod(shape[d] for d in free) <= THIN_DOT_ELEMENTS  # noqa: E731
    if (thin(rshape, rfree) and math.prod(lshape) >= THIN_DOT_MIN_OTHER) or \
            (thin(lshape, lfree) and math.prod(rshape) >= THIN_DOT_MIN_OTHER):
        return "thin"
    if math.prod(lshape[d] for d in lc) <= THIN_DOT_ELEMENTS and \
            math.prod(lshape[d] for d in (*lb, *lfree)) * math.prod(rshape[d] for d in rfree) >= THIN_DOT_MIN_OTHER:
        return "short"
    return None


def _thin_dot_as_sum(invals, params):
    """``dot_general`` of a large operand with a thin one (a vector, a few columns) as a broadcast
    multiply and a sum over the contracting dimensions, or ``None`` when the product is not of that
    shape. Same value up to the order of additions; on a GPU XLA fuses the sum with the elementwise
    work that computes the large operand, which a matrix-vector call cannot. A product with a short
    contraction is bound as a few broadcast products instead (:func:`_short_dot_as_products`)."""
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    lhs, rhs = invals
    lshape, rshape = jnp.shape(lhs), jnp.shape(rhs)
    lfree = [d for d in range(len(lshape)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rshape)) if d not in rc and d not in rb]
    kind = fusible_dot(lshape, rshape, params["dimension_numbers"])
    if kind is None:
        return None
    dtype = params.get("preferred_element_type") or jnp.result_type(lhs, rhs)
    if kind == "short":
        return _short_dot_as_products(lhs, rhs, (lc, rc), (lb, rb), lfree, rfree, dtype)
    nb, nl, nr, nc = len(lb), len(lfree), len(rfree), len(lc)
    # lhs as (batch, lhs free, contracting, 1 per rhs free); rhs as (batch, 1 per lhs free, contracting, rhs free)
    left = lax.transpose(lhs, (*lb, *lfree, *lc)).astype(dtype)
    left = lax.expand_dims(left, tuple(range(nb + nl + nc, nb + nl + nc + nr)))
    right = lax.transpose(rhs, (*rb, *rc, *rfree)).astype(dtype)
    right = lax.expand_dims(right, tuple(range(nb, nb + nl)))
    return jnp.sum(left * right, axis=tuple(range(nb + nl, nb + nl + nc)))


def _merged_thin_dots(large, contract, parts) -> list:
    """Products of ``large`` with each thin operand in ``parts`` (see
    :meth:`LoopPlan.sibling_thin_dots`), computed as one broadcast multiply and sum over the thin
    operands side by side, then taken apart."""
    free = [d for d in range(jnp.ndim(large)) if d not in contract]
    free_shape = tuple(jnp.shape(large)[d] for d in free)
    dtype = jnp.result_type(*(dt for *_, dt in parts))
    columns, shapes = [], []
    for thin, thin_contract, _, _ in parts:
        thin_free = [d for d in range(jnp.ndim(thin)) if d not in thin_contract]
        shapes.append(tuple(jnp.shape(thin)[d] for d in thin_free))
        laid = lax.transpose(thin, (*thin_contract, *thin_free))
        columns.append(laid.reshape(*laid.shape[:len(thin_contract)], -1).astype(dtype))
    side_by_side = jnp.concatenate(columns, axis=-1)                      # (contracting..., columns)
    left = lax.expand_dims(lax.transpose(large, (*free, *contract)).astype(dtype), (len(free) + len(contract),))
    total = jnp.sum(left * side_by_side, axis=tuple(range(len(free), len(free) + len(contract))))
    results, offset = [], 0
    for (_, _, on_left, out_dtype), shape in zip(parts, shapes):
        width = math.prod(shape)
        piece = total[..., offset:offset + width].reshape(*free_shape, *shape)
        offset += width
        if not on_left:  # the thin operand's free dimensions come first
            nf, ns = len(free_shape), len(shape)
            piece = lax.transpose(piece, (*range(nf, nf + ns), *range(nf)))
        results.append(piece.astype(out_dtype))
    return results


def _short_dot_as_products(lhs, rhs, contracting, batch, lfree, rfree, dtype):
    """A product with a short contraction (a few coordinates: the cross term of squared distances) as
    that many broadcast products added up: elementwise work XLA fuses with what reads the result,
    where a matrix multiplication with an inner dimension of three would write it out."""
    (lc, rc), (lb, rb) = contracting, batch
    nb, nl, nr = len(lb), len(lfree), len(rfree)
    left = lax.transpose(lhs, (*lb, *lfree, *lc)).astype(dtype)
    left = left.reshape(*left.shape[:nb + nl], -1)
    left = lax.expand_dims(left, tuple(range(nb + nl, nb + nl + nr)))       # (batch, lfree, 1.., c)
    right = lax.transpose(rhs, (*rb, *rfree, *rc)).astype(dtype)
    right = right.reshape(*right.shape[:nb + nr], -1)
    right = lax.expand_dims(right, tuple(range(nb, nb + nl)))               # (batch, 1.., rfree, c)
    total = None
    for k in range(left.shape[-1]):
        term = left[..., k] * right[..., k]
        total = term if total is None else total + term
    return total


def _bind_dot(eqn, invals, params) -> list:
    """A step's ``dot_general``. A vector against a matrix laid out the other way round from what XLA
    wants of that operand (a slice of keys ``[..., S, H]`` on the right contracting ``H``, of values
    ``[..., S, H]`` on the left contracting ``S``: one query's scores, its weighted sum) is bound with
    the operands swapped, so XLA:CPU reads the slice as it lies instead of copying it transposed
    every step (a matrix-vector product either way); the result's dimensions are put back with a
    transpose of unit dimensions."""
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    lhs, rhs = invals
    lshape, rshape = jnp.shape(lhs), jnp.shape(rhs)
    lfree = [d for d in range(len(lshape)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rshape)) if d not in rc and d not in rb]

    def vector_against_transposed(vshape, vfree, mshape, mfree, mcontract, contract_last):
        return (bool(mcontract) and all(vshape[d] == 1 for d in vfree) and bool(mfree)
                and any(mshape[d] > 1 for d in mfree)
                and (max(mfree) < min(mcontract) if contract_last else max(mcontract) < min(mfree)))

    swap = params.get("out_sharding") is None and (
        vector_against_transposed(lshape, lfree, rshape, rfree, rc, contract_last=True)
        or vector_against_transposed(rshape, rfree, lshape, lfree, lc, contract_last=False))
    if not swap:
        return bind_equation(eqn, invals, params)
    precision = params.get("precision")
    if isinstance(precision, tuple):  # one per operand
        precision = precision[::-1]
    out = bind_equation(eqn, [rhs, lhs], {**params, "dimension_numbers": ((rc, lc), (rb, lb)),
                                          "precision": precision})[0]
    nb, nr, nl = len(lb), len(rfree), len(lfree)
    perm = list(range(nb)) + [nb + nr + i for i in range(nl)] + [nb + i for i in range(nr)]
    return [lax.transpose(out, perm)]


#: Reductions whose floating results follow IEEE-754 maximum/minimum (NaN wins), whatever kernel
#: XLA picks for one slice (XLA:CPU's YNNPACK reductions skip NaN in large inputs, its own do not).
NAN_PROPAGATING = ("reduce_max", "reduce_min")


def _propagate_nan(operand, reduced, axes):
    has_nan = lax.reduce_or(lax.ne(operand, operand), tuple(axes))
    return lax.select(has_nan, lax.full_like(reduced, jnp.nan), reduced)


def _positive_nan(values):
    """``values`` with every NaN made positive: ``top_k`` ranks NaN above every number whatever its sign
    (which XLA's kernels do not keep consistently), earlier index first."""
    if not jnp.issubdtype(values.dtype, jnp.floating):
        return values
    return lax.select(lax.ne(values, values), lax.full_like(values, jnp.nan), values)


def _scan_identity(monoid: str, dtype):
    if monoid == "logaddexp":
        return -jnp.inf
    return identity(monoid, dtype)


def _is_low_float(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def _like(partial, state):
    """A step's partial result with the dtype, manual axes and explicit sharding of its loop carry."""
    return conform(partial.astype(state.dtype), jx.typeof(state))


def _accumulator_dtype(monoid: str, dtype):
    """Sums, products and running log-sum-exps of 16-bit floats accumulate across slices in float32 (as
    XLA does within one): in 16 bits a running total stops growing once each term is under half its ulp."""
    if monoid in ("add", "mul", "logaddexp") and _is_low_float(dtype):
        return jnp.float32
    return dtype


def _whole_slice_as_top_k(eqn, operand) -> list:
    """A slice no longer than ``k``: every element is a candidate, in index order."""
    axis = eqn.params.get("axis", operand.ndim - 1)
    index_dtype = eqn.outvars[1].aval.dtype
    indices = lax.broadcasted_iota(index_dtype, operand.shape, axis)
    return [operand, indices]


def _extreme(which: str, dtype):
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.inf if which == "max" else -jnp.inf
    info = jnp.iinfo(dtype) if jnp.issubdtype(dtype, jnp.integer) else None
    if info is None:
        return which == "max"
    return info.max if which == "max" else info.min


def _arg_merge(monoid: str, best, new):
    """Merge (value, index) pairs; earlier slices win ties, a NaN beats any number."""
    best_value, best_index = best
    value, index = new
    better = value > best_value if monoid == "argmax" else value < best_value
    if jnp.issubdtype(value.dtype, jnp.inexact):
        better = better | (jnp.isnan(value) & ~jnp.isnan(best_value))
    return jnp.where(better, index, best_index), jnp.where(better, value, best_value)
