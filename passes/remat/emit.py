"""Re-emitting a differentiated program under a recomputation schedule (``jax.grad`` inside the
hlopass function).

The program is re-traced equation by equation. The forward pass runs once,
as it was. A backward equation that reads a residual of a stage the
schedule recomputes reads instead the value recomputed for it: the first
such read recomputes the stage's block from the values kept at the block's
entry (re-emitted forward equations, with their source lines, inside
:func:`.gate.gated`, ordered by the cotangent that equation reads). A block
recomputes, and exposes, what its own schedule keeps: the residuals of its
stored stages and the entry and exit values of its inner blocks, which are
recomputed in turn when first needed. A residual that is one cheap
elementwise step from others (``1 - y`` next to ``y``) is computed from them
where it is read, outside the conditional, where XLA fuses it into its
reader as it did before. The original residuals are then read
by nothing after the forward pass and XLA frees them. Scan pairs are
rewritten by :class:`.scans.PairPlan`.
"""

from __future__ import annotations

from collections import ChainMap
from typing import Sequence

from hlopass import internals as jx

from hlopass.interpreter import bind_equation
from hlopass.jaxpr_utils import dce, trace_flat

from .chain import Analysis, FlatChain
from .gate import first_scalar, gated, is_float as scalar_ok
from .scans import PairPlan
from .schedule import Block, Stored


def _read(env, atom):
    return atom.val if isinstance(atom, jx.Literal) else env[atom]


def _items_containing(items, stage):
    for item in items:
        if isinstance(item, Stored) and item.stage == stage:
            return item
        if isinstance(item, Block) and item.start <= stage < item.end:
            return item
    raise KeyError(stage)


class FlatRecompute:
    """Recomputed values of a flat chain, made when first read (see the module docstring)."""

    def __init__(self, jaxpr: jx.Jaxpr, flat: FlatChain, items: Sequence, env: dict, inputs: dict):
        self.jaxpr = jaxpr
        self.flat = flat
        self.items = tuple(items)
        self.env = env            # the original program's values
        self.inputs = inputs      # program inputs and constants: all a recomputation may read besides its entry
        self.cache: dict[tuple[int, int], dict] = {}
        self.cut_sets = [set(c) for c in flat.cuts]
        self.derived_values: dict = {}
        stored = {item.stage for item in self.items if isinstance(item, Stored)}
        self._stored = {v for v, l in flat.owner.items() if l in stored}

    def value(self, var, trigger):
        """The value of residual ``var`` that the schedule provides at this point."""
        if var in self.flat.derived and var not in self._stored:
            if var not in self.derived_values:
                eqn = self.jaxpr.eqns[self.flat.derived[var]]
                ins = [self.value(a, trigger) if isinstance(a, jx.Var) and a in self.flat.owner
                       else _read(self.env, a) for a in eqn.invars]
                self.derived_values[var] = bind_equation(eqn, ins)[0]
            return self.derived_values[var]
        stage = self.flat.owner[var]
        items, env = self.items, self.env
        while True:
            item = _items_containing(items, stage)
            if isinstance(item, Stored) or var in self.cut_sets[item.end]:
                return env[var]
            env = ChainMap(self._recompute(item, env, trigger), env)
            items = item.inner

    def _exposed(self, block: Block) -> list:
        inside = {v for l in range(block.start, block.end) for q in self.flat.stages[l]
                  for v in self.jaxpr.eqns[q].outvars}
        out: list = []
        for item in block.inner:
            if isinstance(item, Stored):
                out.extend(v for v in self.flat.residuals[item.stage] if v not in self.flat.derived)
            else:
                out.extend(self.flat.cuts[item.start])
                if item.end < block.end:
                    out.extend(self.flat.cuts[item.end])
        seen: set = set()
        return [v for v in out if v in inside and not (v in seen or seen.add(v))]

    def _recompute(self, block: Block, env, trigger) -> dict:
        key = (block.start, block.end)
        if key in self.cache:
            return self.cache[key]
        entry = list(self.flat.cuts[block.start])
        exposed = self._exposed(block)
        eqn_ids = sorted(q for l in range(block.start, block.end) for q in self.flat.stages[l])
        needed = set(exposed)
        used = []
        for q in reversed(eqn_ids):                       # only what the exposed values need
            eqn = self.jaxpr.eqns[q]
            if any(v in needed for v in eqn.outvars):
                used.append(eqn)
                needed.update(v for v in eqn.invars if isinstance(v, jx.Var))
        used.reverse()
        inputs = self.inputs

        def recompute(*entry_values):
            local = ChainMap(dict(zip(entry, entry_values)), inputs)
            for eqn in used:
                outs = bind_equation(eqn, [_read(local, a) for a in eqn.invars])
                local.maps[0].update(zip(eqn.outvars, outs))
            return [local[v] for v in exposed]

        values = gated(trigger, recompute, *[env[v] for v in entry])
        self.cache[key] = dict(zip(exposed, values))
        return self.cache[key]


def emit(analysis: Analysis, flat_items: Sequence | None, scan_plans: dict[int, list]) -> jx.ClosedJaxpr:
    """The program of ``analysis`` re-traced under the flat chain's schedule ``flat_items`` (or
    ``None``) and the scan pairs' segment plans (``scan_plans``: forward-scan index -> segments)."""
    closed = analysis.closed
    jaxpr = closed.jaxpr
    plans: dict[int, PairPlan] = {}
    used = {a for e in jaxpr.eqns for a in e.invars if isinstance(a, jx.Var)}
    used.update(v for v in jaxpr.outvars if isinstance(v, jx.Var))
    for pair in analysis.pairs:
        if pair.forward in scan_plans:
            plan = PairPlan(pair.residual_ys, pair.backward_xs, scan_plans[pair.forward], used)
            plans[pair.forward] = plans[pair.backward] = plan
    backward_of = {pair.backward: pair.forward for pair in analysis.pairs if pair.forward in plans}

    def run(*args):
        env: dict = {}
        env.update(zip(jaxpr.constvars, closed.consts))
        env.update(zip(jaxpr.invars, args))
        inputs = dict(env)
        flat = None
        if flat_items is not None and analysis.flat is not None:
            flat = FlatRecompute(jaxpr, analysis.flat, flat_items, env, inputs)
        last = None                   # the latest floating-point value of the backward pass
        produced_backward: set = set()
        for i, eqn in enumerate(jaxpr.eqns):
            invals = [_read(env, a) for a in eqn.invars]
            if analysis.backward[i]:
                if flat is not None and any(isinstance(a, jx.Var) and a in analysis.residuals
                                            for a in eqn.invars):
                    own = [v for a, v in zip(eqn.invars, invals) if isinstance(a, jx.Var) and a in produced_backward]
                    trigger = first_scalar(own + ([last] if last is not None else []))
                    invals = [flat.value(a, trigger) if isinstance(a, jx.Var) and a in analysis.residuals
                              else v for a, v in zip(eqn.invars, invals)]
            if i in plans and i not in backward_of:
                outs = plans[i].forward(eqn, invals)
            elif i in backward_of:
                outs = plans[i].backward(eqn, invals)
            else:
                outs = bind_equation(eqn, invals)
            env.update(zip(eqn.outvars, outs))
            if analysis.backward[i]:
                produced_backward.update(eqn.outvars)
                last = next((o for o in outs if scalar_ok(o)), last)
        return [_read(env, v) for v in jaxpr.outvars]

    new = trace_flat(run, [v.aval for v in jaxpr.invars], "remat")
    return dce(new)
