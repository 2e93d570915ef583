"""Rematerialisation before linearisation: ``jax.grad`` of a hlopass function.

JAX splits a differentiated ``hlopass_call`` into a forward call that
returns the residuals and a backward call that reads them; what is saved is
decided when JAX linearises the program, so the decision is made here, in
the pass's :meth:`~hlopass.pass_base.Pass.before_linearize`:

1. the program JAX will run for the backward call (its residuals as
   arguments, :func:`backward_program`) is compiled and measured; if it fits
   the limit, or an upper bound says it must, the program is returned as it
   is;
2. its equations are cut into stages at small cuts (:mod:`.chain`), each
   stage's residuals estimated by linearising the stage alone (what JAX
   would save for it); each top-level ``scan`` is a problem of its own, its
   steps' residuals estimated by linearising its body, checkpointed in
   blocks of a length dividing it (a kept run of steps would need sliced
   copies of its ``xs``);
3. the closed loop of :mod:`.loop` chooses schedules, re-traces the program
   with each recomputed block as a :func:`.gate.remat_block` (a
   ``custom_vjp`` that keeps its inputs and recomputes under the gate, nested
   blocks inside) and each checkpointed scan as :func:`.scans.checkpointed_scan`,
   and measures the gradient of the result, until it fits.

What was done reaches the pass's report as notes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from hlopass import internals as jx

from hlopass.interpreter import bind_equation, inline_calls
from hlopass.jaxpr_utils import aval_nbytes, dce, subjaxprs, trace_flat
from hlopass.memory import footprint, upper_bound
from hlopass.report import Note, PassReport

from .chain import Analysis, build_chain, derived_residuals, is_cheap
from .cost import jaxpr_counts, rates
from .gate import remat_block
from .loop import ChainProblem, ScanProblem, closed_loop
from .report import describe_outcome
from .scans import block_lengths, checkpointed_scan, segments
from .schedule import Chain, Stored


def _inexact(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def vjp_program(closed: jx.ClosedJaxpr) -> jx.ClosedJaxpr:
    """``(primals, cotangents) -> (outputs, gradients)``: the gradient of ``closed`` with respect to its
    floating-point inputs, for its floating-point outputs, as one program."""
    ins, outs = closed.in_avals, closed.out_avals
    diff = [i for i, a in enumerate(ins) if _inexact(a)]
    float_outs = [j for j, a in enumerate(outs) if _inexact(a)]

    def program(*args):
        primals, cts = args[:len(ins)], args[len(ins):]

        def f(*d):
            full = list(primals)
            for i, v in zip(diff, d):
                full[i] = v
            values = jx.jaxpr_as_fun(closed)(*full)
            return [values[j] for j in float_outs]
        values, pullback = jax.vjp(f, *[primals[i] for i in diff])
        return [*values, *pullback(list(cts))]

    return trace_flat(program, [*ins, *[outs[j] for j in float_outs]], "vjp")


def backward_program(closed: jx.ClosedJaxpr, threshold: int | None) -> jx.ClosedJaxpr:
    """The program JAX's split of ``jax.grad`` of a hlopass function runs second:
    ``(residuals, cotangents) -> gradients``, as ``hlopass.call`` builds it (its residuals are
    arguments, as when it runs on its own). When a residual is over ``threshold``, ``hlopass.call``
    linearises under ``jax.checkpoint`` and the second program recomputes the forward pass: then
    the whole gradient, :func:`vjp_program`."""
    nzs = [_inexact(a) for a in closed.in_avals]
    primal, num_res, _, in_fwd, tangent = jx.linearize_jaxpr(closed, nzs, is_vjp=True)
    residuals = primal.out_avals[len(primal.out_avals) - num_res:]
    if threshold is not None and any(aval_nbytes(a) > threshold for a in residuals):
        return vjp_program(closed)
    n_res = len(in_fwd)
    res_avals, tangent_avals = tangent.in_avals[:n_res], tangent.in_avals[n_res:]
    ct_avals = [a.to_tangent_aval() for a in tangent.out_avals]

    def backward(*args):
        res, cts = args[:n_res], args[n_res:]
        out = jx.backward_pass(tangent.jaxpr, False, tangent.consts,
                               [*res, *[jx.UndefinedPrimal(a) for a in tangent_avals]], list(cts))
        out = out[n_res:]
        return [jnp.zeros(a.shape, a.dtype) if isinstance(ct, jx.Zero) or ct is None else ct
                for ct, a in zip(out, tangent_avals)]

    return trace_flat(backward, [*res_avals, *ct_avals], "backward")


def _stage_jaxpr(eqns, inputs, outputs) -> jx.ClosedJaxpr:
    def run(*vals):
        env = dict(zip(inputs, vals))
        for eqn in eqns:
            outs = bind_equation(eqn, [a.val if isinstance(a, jx.Literal) else env[a] for a in eqn.invars])
            env.update(zip(eqn.outvars, outs))
        return [env[v] for v in outputs]
    return trace_flat(run, [v.aval for v in inputs], "stage")


def _residuals(stage: jx.ClosedJaxpr) -> tuple[int, list[int], list[int]]:
    """What JAX would save to differentiate ``stage``: ``(bytes of the values it computes for that,
    positions of the inputs it keeps, positions of the outputs it keeps)``. A value one cheap
    elementwise step from kept ones (``1 - y`` next to ``y``) costs nothing: XLA fuses it into its
    reader instead of keeping it."""
    nzs = [_inexact(a) for a in stage.in_avals]
    if not any(nzs):
        return 0, [], []
    primal, num_res, _, in_fwd, _ = jx.linearize_jaxpr(stage, nzs, is_vjp=True)
    outs = primal.jaxpr.outvars
    n_out = len(outs) - num_res
    residuals = [v for v in outs[n_out:] if isinstance(v, jx.Var)]  # a constant residual is a Literal
    kept_outputs = [outs[:n_out].index(v) for v in residuals if v in outs[:n_out]]
    own_vars = [v for v in residuals if v not in outs[:n_out]]
    cheap = derived_residuals(primal.jaxpr.eqns, set(residuals) | set(primal.jaxpr.invars))
    own = sum(aval_nbytes(v.aval) for v in set(own_vars) if v not in cheap)
    consts = len(stage.consts)
    kept_inputs = [f - consts for f in in_fwd if f is not None and f >= consts]
    return own, kept_inputs, kept_outputs


def _primal_problems(closed, machine, options):
    """The flat chain of a primal program (residuals estimated per stage, see :func:`_residuals`)
    and its scans (``(equation index, chain_of)``)."""
    jaxpr = closed.jaxpr
    eqns = jaxpr.eqns
    program_inputs = set(jaxpr.invars) | set(jaxpr.constvars)
    last_read: dict = {}
    for i, e in enumerate(eqns):
        for a in e.invars:
            if isinstance(a, jx.Var):
                last_read[a] = i
    for v in jaxpr.outvars:
        if isinstance(v, jx.Var):
            last_read[v] = len(eqns)
    scans = []
    for i, e in enumerate(eqns):
        if e.primitive.name == "scan" and not e.effects:
            chain_of = _scan_problem(e, machine)
            if chain_of is not None:
                scans.append((i, chain_of))
    scanned = {i for i, _ in scans}
    recomputable = [not e.effects and i not in scanned for i, e in enumerate(eqns)]
    # fine stages first, each linearised alone (structurally equal stages once)
    fine = build_chain(eqns, list(range(len(eqns))), set(), machine, 4 * options.max_stages, recomputable)
    cache: dict = {}
    own_at: dict[int, int] = {}
    residual_vars: set = set()
    for qs in fine.stages:
        stage_eqns = [eqns[q] for q in qs if q not in scanned]
        if not stage_eqns:
            continue
        inputs = _free_vars(stage_eqns)
        inside = [v for e in stage_eqns for v in e.outvars]
        outs = [v for v in inside if last_read.get(v, -1) > qs[-1]] or list(stage_eqns[-1].outvars)
        key = (tuple((e.primitive, tuple(str(a.aval) if isinstance(a, jx.Var) else repr(a.val) for a in e.invars),
                      tuple(sorted((k, repr(v)) for k, v in e.params.items()))) for e in stage_eqns),
               tuple(a in program_inputs for a in inputs), tuple(inside.index(v) for v in outs))
        if key not in cache:
            cache[key] = _residuals(_stage_jaxpr(stage_eqns, inputs, outs))
        own, kept_in, kept_out = cache[key]
        own_at[qs[-1]] = own_at.get(qs[-1], 0) + own
        residual_vars.update(inputs[k] for k in kept_in if inputs[k] not in program_inputs)
        residual_vars.update(outs[k] for k in kept_out)
    flat = build_chain(eqns, list(range(len(eqns))), residual_vars, machine, options.max_stages, recomputable)
    residual = tuple(sum(own_at.get(q, 0) for q in qs) + sum(aval_nbytes(v.aval) for q in qs
                                                              for v in eqns[q].outvars if v in residual_vars)
                     for qs in flat.stages)
    flat.chain = dataclasses.replace(flat.chain, residual=residual)
    return flat, scans


def _scan_problem(eqn, machine):
    """``chain_of(k)`` for a :class:`.loop.ScanProblem` over a scan's steps (residuals per step from
    its body linearised alone), or ``None`` when a step keeps nothing."""
    p = eqn.params
    body = p["jaxpr"]
    nzs = [_inexact(a) for a in body.in_avals]
    if not any(nzs):
        return None
    primal, num_res, _, in_fwd, _ = jx.linearize_jaxpr(body, nzs, is_vjp=True)
    ncon, ncar = jx.scan_num_consts(p), jx.scan_num_carry(p)
    consts = len(body.consts)
    own = sum(aval_nbytes(a) for a in primal.out_avals[len(primal.out_avals) - num_res:])
    carried = sum(aval_nbytes(body.in_avals[f - consts]) for f in in_fwd
                  if f is not None and f >= consts and ncon <= f - consts < ncon + ncar)
    per_step = own + carried
    if not per_step:
        return None
    carry = sum(aval_nbytes(a) for a in body.in_avals[ncon:ncon + ncar])
    step_time = machine.seconds(jaxpr_counts(body))
    n = p["length"]

    def chain_of(k: int) -> Chain:
        stages = -(-n // k)
        sizes = [min(k, n - s * k) for s in range(stages)]
        return Chain(time=tuple(step_time * g for g in sizes), residual=tuple(per_step * g for g in sizes),
                     extra=(0,) * stages, cut=(carry,) * (stages + 1))
    return chain_of


def _not_cheap(prim, *avals, **params) -> bool:
    """Remat policy: every value is saveable except those of cheap elementwise primitives."""
    return not is_cheap(prim.name)


def _free_vars(eqns) -> list:
    inside = {v for e in eqns for v in e.outvars}
    out = []
    for e in eqns:
        for a in e.invars:
            if isinstance(a, jx.Var) and a not in inside and a not in out:
                out.append(a)
    return out


def emit_primal(closed: jx.ClosedJaxpr, flat, items, scan_plans: dict[int, list]) -> jx.ClosedJaxpr:
    """``closed`` re-traced with the blocks of ``items`` as :func:`.gate.remat_block` s (nested as
    the schedule nests them) and the scans of ``scan_plans`` checkpointed."""
    jaxpr = closed.jaxpr
    eqns = jaxpr.eqns
    last_read: dict = {}
    for i, e in enumerate(eqns):
        for a in e.invars:
            if isinstance(a, jx.Var):
                last_read[a] = i
    for v in jaxpr.outvars:
        if isinstance(v, jx.Var):
            last_read[v] = len(eqns)

    def run_eqn(q, env):
        eqn = eqns[q]
        invals = [a.val if isinstance(a, jx.Literal) else env[a] for a in eqn.invars]
        outs = checkpointed_scan(eqn, invals, scan_plans[q]) if q in scan_plans else bind_equation(eqn, invals)
        env.update(zip(eqn.outvars, outs))

    def run_stored(stages, env):
        """Stored stages: differentiated by JAX as they are, except that cheap elementwise values
        are not kept (``jax.checkpoint`` with a policy keeping the rest): what XLA would fuse into
        the backward pass when it sees both passes, made explicit for the forward call."""
        qs = [q for l in stages for q in flat.stages[l]]
        if any(q in scan_plans for q in qs):
            for q in qs:
                run_eqn(q, env)
            return
        args = _free_vars([eqns[q] for q in qs])
        results = [v for q in qs for v in eqns[q].outvars if last_read.get(v, -1) > qs[-1]]
        if not results:
            return

        def fn(*vals):
            local = dict(zip(args, vals))
            for q in qs:
                run_eqn(q, local)
            return [local[v] for v in results]
        outs = jax.checkpoint(fn, policy=_not_cheap, prevent_cse=False)(*[env[v] for v in args])
        env.update(zip(results, outs))

    def run_items(items_, env, top=False):
        run: list[int] = []
        for item in items_:
            if isinstance(item, Stored):
                if top:
                    run.append(item.stage)
                else:
                    for q in flat.stages[item.stage]:
                        run_eqn(q, env)
                continue
            if run:
                run_stored(run, env)
                run = []
            qs = [q for l in range(item.start, item.end) for q in flat.stages[l]]
            block_eqns = [eqns[q] for q in qs]
            args = _free_vars(block_eqns)
            results = [v for q in qs for v in eqns[q].outvars if last_read.get(v, -1) > qs[-1]]
            if not results:
                continue

            def fn(*vals, item=item, args=args, results=results):
                local = dict(zip(args, vals))
                run_items(item.inner, local)
                return [local[v] for v in results]
            outs = remat_block(fn)(*[env[v] for v in args])
            env.update(zip(results, outs))
        if run:
            run_stored(run, env)

    def run(*vals):
        env = dict(zip(jaxpr.constvars, closed.consts))
        env.update(zip(jaxpr.invars, vals))
        run_items(items, env, top=True)
        return [v.val if isinstance(v, jx.Literal) else env[v] for v in jaxpr.outvars]

    return dce(trace_flat(run, [v.aval for v in jaxpr.invars], "remat"))


def unrolled_bound(closed) -> int:
    """Bytes of every value the program defines, ``scan`` bodies counted once per step, plus its
    inputs: its gradient cannot keep more than this for the backward pass, nor need more than
    about three times this (values, residuals, cotangents)."""
    def values(jaxpr) -> int:
        total = 0
        for eqn in jaxpr.eqns:
            total += sum(aval_nbytes(v.aval) for v in eqn.outvars)
            scale = eqn.params["length"] if eqn.primitive.name == "scan" else 1
            for sub in subjaxprs(eqn):
                total += scale * values(sub)
        return total
    return values(closed.jaxpr) + sum(aval_nbytes(a) for a in closed.in_avals)


def rematerialize_primal(closed: jx.ClosedJaxpr, config, notes: list[Note], options) -> jx.ClosedJaxpr:
    """See the module docstring; ``closed`` itself when nothing is to be done."""
    limit = config.memory_limit
    if limit is None or not any(_inexact(a) for a in closed.in_avals) or not closed.jaxpr.eqns:
        return closed
    if 3 * unrolled_bound(closed) <= limit:
        return closed
    gradient = vjp_program(closed)
    if upper_bound(gradient, own_values_only=True) <= limit:
        return closed

    def measure(program):
        return footprint(backward_program(program, config.threshold), typed=False).footprint
    footprint0 = measure(closed)
    if footprint0 <= limit:
        return closed
    machine = rates()
    base = inline_calls(closed)
    flat, scans = _primal_problems(base, machine, options)
    chain = flat.chain
    problems, names = [ChainProblem("flat", chain, buckets=options.buckets, depth=options.depth)], [("flat", None)]
    for q, chain_of in scans:
        n = base.jaxpr.eqns[q].params["length"]
        # blocks only, of a length dividing the scan: one outer scan over the unsliced xs (a kept
        # run of steps would slice the xs, and every slice is a copy JAX cannot avoid here)
        lengths = [k for k in block_lengths(n, options.max_stages) if n % k == 0]
        problems.append(ScanProblem(f"scan{q}", chain_of, n, lengths, keep_steps=False))
        names.append(("scan", _PrimalScan(q, n)))

    def emit_plan(plan):
        items, scan_plans = (), {}
        for (kind, scan), sol in zip(names, plan.solutions):
            if kind == "flat":
                items = sol.items
            else:
                scan_plans[scan.forward] = segments(sol.items, sol.group, scan.n)
        return emit_primal(base, flat, items, scan_plans)

    outcome = closed_loop(problems, emit_plan, measure, footprint0, limit,
                          max_rounds=options.max_rounds, slack=options.slack)
    report = PassReport("remat")
    analysis = Analysis(closed=base, backward=[], residuals=set(), pairs=[], flat=flat, pinned=0)
    describe_outcome(report, outcome, names, analysis, footprint0, limit, machine)
    for r in report.rewrites:
        notes.append(Note("remat", r.kind, r.location, r.summary,
                          details=tuple((k, v if isinstance(v, (int, float, str)) else repr(v))
                                        for k, v in r.details.items())))
    for s in report.skipped:
        notes.append(Note("remat", "skip", s.location, s.reason, s.primitive))
    if outcome.chosen is None or (not outcome.fits and outcome.chosen.footprint >= footprint0):
        return closed
    return outcome.chosen.jaxpr


class _PrimalScan:
    """A scan of the primal program, named like a :class:`.chain.ScanPair` for the report."""

    def __init__(self, forward: int, n: int):
        self.forward = forward
        self.n = n

    def length(self, jaxpr) -> int:
        return self.n

