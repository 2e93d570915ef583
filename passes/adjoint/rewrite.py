"""Finding the linear recurrences of a program and replacing each by an adjoint scan."""

from __future__ import annotations

import contextlib
import logging
import math
import threading

from hlopass import internals as jx

from hlopass.families import CALLS, CUSTOM_DERIVATIVE_CALLS, RESHARDS
from hlopass.interpreter import Replacement, inline_calls, rewrite, rewrite_nested
from hlopass.jaxpr_utils import iter_eqns, subjaxprs
from hlopass.report import Note, source_line
from hlopass.sharding import type_axis
from hlopass.sizes import format_size

from .chains import find_chains, roll, rolled_scan
from .emit import adjoint_scan
from .sharded import context_mesh, mesh_axis_size, sharded_adjoint_scan, sharded_region
from .recurrence import Recurrence, body_function, classify
from .stack import Region, balanced_chunk, chunked_region, find_region, kept_states, near_divisor, nested_groups

logger = logging.getLogger("hlopass")

NAME = "adjoint"

#: The relative gradient difference each truncated recurrence measured, by source line (the last
#: measurement; filled when the program's backward pass runs with checks on).
truncation_errors: dict[str, float] = {}

_own = threading.local()


def in_machinery() -> bool:
    """Whether the code running now is this pass's own (its derivatives are not the user's)."""
    return getattr(_own, "depth", 0) > 0


@contextlib.contextmanager
def own_machinery():
    _own.depth = getattr(_own, "depth", 0) + 1
    try:
        yield
    finally:
        _own.depth -= 1


def chunk_length(length: int, rec: Recurrence, memory_limit: int | None, chunk: int | None) -> int:
    """K for one scan: the option if given, else the K that balances the carries kept at chunk
    boundaries (``T/K`` of them) against one chunk's intermediates (``K`` steps of the body's,
    measured on its jaxpr), at most an eighth of the memory limit for the chunk; a divisor of T
    near it when there is one (no partial last chunk)."""
    return balanced_chunk(length, rec.carry_bytes, rec.step_bytes, memory_limit, chunk)


def _not_differentiated(closed: jx.ClosedJaxpr) -> set[int]:
    """Ids of the bodies of custom-derivative calls (JAX differentiates those by their rules)."""
    out: set[int] = set()

    def collect(jaxpr):
        out.add(id(jaxpr))
        for eqn in jaxpr.eqns:
            for sub in subjaxprs(eqn):
                collect(sub)
    for eqn in iter_eqns(closed.jaxpr):
        if eqn.primitive.name in CUSTOM_DERIVATIVE_CALLS:
            for sub in subjaxprs(eqn):
                collect(sub)
    return out


def _sharding(options, length: int, forms, sources=(), producers=None) -> tuple:
    """``(mesh, axis, devices, why_not, gathered)`` for sharding ``length`` steps over
    ``options.sequence_axis``, or, when it is not set, over the mesh axis the time axis (axis 0) of
    one of ``sources`` is cut along (:func:`_time_axis`); ``why_not`` is ``None`` when they can be,
    else the reason (also when no axis is asked for or found); ``gathered`` maps each source that is
    a sharded value made whole (``reshard``) to that value, which the sharded loop reads instead."""
    axis, mesh, gathered = options.sequence_axis, options.mesh, {}
    if axis is None:
        found = _time_axis(sources, producers or {})
        if found is None:
            return None, None, None, "no sequence_axis is set", {}
        mesh, axis, gathered = found
    mesh = mesh if mesh is not None else context_mesh()
    devices = mesh_axis_size(mesh, axis)
    why = ("no mesh with that axis is set" if devices is None else
           "complex recurrences are not sharded (XLA 0.10's CPU compiler fails on them in a shard_map)"
           if "complex" in forms else
           f"{length} steps do not split evenly over {devices} devices" if length % devices else None)
    return mesh, axis, devices, why, gathered


def _time_axis(sources, producers: dict):
    """``(mesh, axis, gathered)`` when the time axis of a source is cut along one mesh axis in its type
    (an ``Explicit`` mesh), or the source is such a value made whole for the scan (``lax.scan`` wants
    its ``xs`` whole along time: ``reshard(xs, P())``); ``None`` when no source says so."""
    for var in sources:
        hit = type_axis(var.aval, 0)
        if hit is not None:
            return (*hit, {})
        eqn = producers.get(var)
        if eqn is not None and eqn.primitive.name in RESHARDS:
            hit = type_axis(eqn.invars[0].aval, 0)
            if hit is not None:
                gathered = {v: producers[v].invars[0] for v in sources
                            if v in producers and producers[v].primitive.name in RESHARDS
                            and type_axis(producers[v].invars[0].aval, 0) == hit}
                return (*hit, gathered)
    return None


def _describe(eqn, rec: Recurrence, k: int, options) -> tuple[str, tuple]:
    length = eqn.params["length"]
    n_kept = -(-length // k)
    kept = n_kept * rec.carry_bytes
    plain = length * max(rec.step_bytes, rec.carry_bytes)
    ours = kept + k * max(rec.step_bytes, rec.carry_bytes)
    solver = "associative scan" if rec.form in ("diagonal", "complex") else "sequential scan"
    form = {"diagonal": "diagonal (h' = a*h + b)", "complex": "complex diagonal (h' = a*h + b, a complex)",
            "dense": "dense (h' = A h + b)"}[rec.form]
    summary = (f"linear recurrence over {length} steps, {form}: gradient by the adjoint method "
               f"(adjoint states by {solver}, per-step VJPs batched over chunks of {k} steps); keeps the "
               f"carry every {k} steps ({format_size(kept)}) instead of every step's intermediates "
               f"(up to {format_size(plain)}): saves up to {format_size(max(plain - ours, 0))}")
    if options.truncate is not None:
        summary += (f"; TRUNCATED to {options.truncate} steps: the gradient is approximate (the adjoint is "
                    f"not carried across blocks of {options.truncate} steps)")
    if options.levels == 2:
        summary += "; levels=2 has no effect here (it groups the chunks of a time region; this scan is on its own)"
    details = (("form", rec.form), ("length", length), ("chunk", k), ("kept_bytes", kept),
               ("plain_bytes", plain), ("saved_bytes", max(plain - ours, 0)),
               ("truncate", options.truncate))
    return summary, details


def region_levels(options, rows: int, k: int, region: Region, memory_limit: int | None) -> int:
    """Levels of checkpointing for a region of ``rows`` rows in chunks of ``k``: the option if given;
    else 2 where one level would keep more than a quarter of the memory limit (the boundary states
    and one chunk's values; a second level keeps about ``2 sqrt(T/K)`` states instead of ``T/K``),
    else 1."""
    if options.levels is not None:
        return options.levels
    one_level = -(-rows // k) * region.carry_bytes + k * region.row_bytes
    return 2 if memory_limit is not None and one_level > memory_limit // 4 else 1


def _describe_region(jaxpr, region: Region, k: int, steps: int | None = None,
                     groups: int = 1) -> list[tuple[int, str, tuple]]:
    """One (eqn index, summary, details) per recurrence of ``region`` chunked with ``k`` rows
    (``steps``: the rows each device runs, when the time axis is sharded; what is kept is per device;
    ``groups``: the groups of chunks of a second level of checkpointing)."""
    T = region.length
    steps = T if steps is None else steps
    where = " per device" if steps != T else ""
    n_kept = kept_states(steps // k, groups) + (1 if steps % k else 0)
    kept = n_kept * region.carry_bytes
    per = (steps // k) // groups
    every = (f"every {k * per} steps and, in the backward pass, those of one group of {per} chunks (two "
             f"levels of checkpointing: one more forward pass)" if groups > 1 else f"every {k} steps")
    plain = T * region.row_bytes
    ours = kept + k * region.row_bytes
    others = len(region.scans) - 1
    rows = sum(1 for i in region.eqns if region.kinds[i] != "scan")
    out = []
    for i, rec in region.scans.items():
        form = {"diagonal": "diagonal (h' = a*h + b)", "complex": "complex diagonal (h' = a*h + b, a complex)",
                "dense": "dense (h' = A h + b)"}[rec.form]
        solver = "associative scan" if rec.form in ("diagonal", "complex") else "sequential scan"
        summary = (f"linear recurrence over {T} steps, {form}: gradient by the adjoint method (adjoint states "
                   f"by {solver}, per-step VJPs batched over the chunk) in time chunks of {k} steps together "
                   f"with {others} other recurrence{'s' if others != 1 else ''} and {rows} row-wise equations "
                   f"(layers backpropagated chunk by chunk); keeps the states {every} "
                   f"({format_size(kept)}{where}) instead of every step's intermediates and T-row values "
                   f"(up to {format_size(plain)}): saves up to {format_size(max(plain - ours, 0))}")
        details = (("form", rec.form), ("length", T), ("chunk", k), ("kept_bytes", kept), ("plain_bytes", plain),
                   ("saved_bytes", max(plain - ours, 0)), ("truncate", None), ("stacked", len(region.scans)),
                   ("row_equations", rows), ("levels", 2 if groups > 1 else 1), ("groups", groups))
        out.append((i, summary, details))
    return out


def _has_chain(closed: jx.ClosedJaxpr) -> bool:
    """Whether any level of ``closed`` holds a Python loop's chain of steps (:mod:`.chains`)."""
    if find_chains(closed.jaxpr):
        return True
    return any(find_chains(sub) for e in iter_eqns(closed.jaxpr) for sub in subjaxprs(e))


def _chain_forms(c: jx.ClosedJaxpr | jx.Jaxpr):
    """(chain, Recurrence of its rolled scan) for each Python loop's chain in ``c``'s own equations."""
    jaxpr = getattr(c, "jaxpr", c)
    for chain in find_chains(jaxpr):
        try:
            rec = classify(rolled_scan(jaxpr, chain))
        except Exception as err:  # noqa: BLE001 - a chain that cannot be rolled stays as written
            rec = Recurrence(None, f"it could not be rolled into a scan ({type(err).__name__}: {err})")
        yield chain, rec


def linear_chains_only(closed: jx.ClosedJaxpr) -> bool:
    """Whether some level of ``closed`` holds a chain of steps linear in its carry and no chain of
    the same length that is not (a differentiated Python loop that is itself linear)."""
    for jaxpr in [closed.jaxpr, *(sub for e in iter_eqns(closed.jaxpr) for sub in subjaxprs(e))]:
        linear, other = set(), set()
        for chain, rec in _chain_forms(jaxpr):
            (linear if rec.form is not None else other).add(chain.steps)
        if linear - other:
            return True
    return False


def roll_chains(c: jx.ClosedJaxpr, add) -> jx.ClosedJaxpr:
    """``c`` with each Python loop's chain of steps whose rolled scan is a linear recurrence rolled
    into that scan (:mod:`.chains`); the other chains left as written, each named in a note."""
    reps = []
    for chain, rec in _chain_forms(c):
        site = source_line(chain.eqn(c.jaxpr, 0, chain.body[0]))
        what = f"Python loop unrolled into {chain.steps} steps of {chain.period} equations"
        if rec.form is None:
            add(Note(NAME, "skip", site, f"{what}: {rec.reason}; left as written", "loop"))
            continue
        reps.append(roll(c.jaxpr, chain))
        add(Note(NAME, "roll_loop", site,
                 f"{what} ({len(chain.body)} of them on the carried state): rolled into a lax.scan for the "
                 f"adjoint method", "loop", (("steps", chain.steps), ("period", chain.period))))
    return rewrite(c, reps) if reps else c


def rewrite_scans(closed: jx.ClosedJaxpr, memory_limit, options, notes: list[Note],
                  check: bool = False) -> jx.ClosedJaxpr:
    """Replace every linear-recurrence scan of ``closed`` (at any depth outside custom-derivative
    bodies), and every Python loop's chain of steps that rolls into one, by an adjoint scan;
    ``closed`` itself when there is none. Findings go to ``notes``."""
    if not any(e.primitive.name == "scan" for e in iter_eqns(closed.jaxpr)) and not _has_chain(closed):
        return closed
    original = closed
    closed = inline_calls(closed, CALLS)     # scans in jitted layers join the time regions around them
    skipped = _not_differentiated(closed)

    def add(note: Note):
        if note not in notes:
            notes.append(note)

    def level(c: jx.ClosedJaxpr) -> jx.ClosedJaxpr:
        if id(c.jaxpr) in skipped:
            return c
        c = roll_chains(c, add)
        reps = []
        found: dict[int, Recurrence] = {}
        producers = {v: e for e in c.jaxpr.eqns for v in e.outvars}
        for i, eqn in enumerate(c.jaxpr.eqns):
            if eqn.primitive.name != "scan":
                continue
            if eqn.params["length"] == 0:
                add(Note(NAME, "skip", source_line(eqn), "a scan of no steps: nothing to differentiate along time",
                         "scan"))
                continue
            try:
                rec = classify(eqn)
            except Exception as err:  # noqa: BLE001 - an unknown body is left alone, never a crash
                rec = Recurrence(None, f"its body could not be analysed ({type(err).__name__}: {err})")
            if rec.form is None:
                add(Note(NAME, "skip", source_line(eqn), rec.reason, "scan"))
                continue
            found[i] = rec
        in_region: set[int] = set()
        if options.truncate is None:
            for length in sorted({c.jaxpr.eqns[i].params["length"] for i in found}, reverse=True):
                region = find_region(c.jaxpr, length, {i: r for i, r in found.items()
                                                       if c.jaxpr.eqns[i].params["length"] == length
                                                       and i not in in_region})
                if region is None or len(region.eqns) < 2 or in_region & set(region.eqns):
                    continue
                mesh, axis, devices, why, gathered = _sharding(
                    options, region.length, [r.form for r in region.scans.values()], region.sources, producers)
                rows = length if why else length // devices
                k = balanced_chunk(rows, region.carry_bytes, region.row_bytes, memory_limit, options.chunk)
                groups = nested_groups(rows // k, region_levels(options, rows, k, region, memory_limit))
                build = (chunked_region(c.jaxpr, region, k, own_machinery, groups) if why else
                         sharded_region(c.jaxpr, region, k, own_machinery, mesh, axis, groups))
                sources = [gathered.get(v, v) for v in region.sources] if not why else region.sources
                reps.append(Replacement(list(region.eqns), sources + region.invariants,
                                        region.rows_out + region.finals, build,
                                        anchor=min(region.scans)))
                in_region.update(region.eqns)
                for i, summary, details in _describe_region(c.jaxpr, region, k, rows, groups):
                    if not why:
                        summary += (f"; time axis sharded over mesh axis {axis!r} ({devices} "
                                    f"devices, {rows} steps each, run one device after the other; one set of "
                                    f"states per device boundary)")
                        details = details + (("devices", devices),)
                    add(Note(NAME, "adjoint_scan", source_line(c.jaxpr.eqns[i]), summary, "scan", details))
                if why and axis is not None:
                    add(Note(NAME, "skip", source_line(c.jaxpr.eqns[min(region.scans)]),
                             f"not sharded over {axis!r}: {why}; one device's time region "
                             f"instead", "scan"))
        for i, rec in found.items():
            if i in in_region:
                continue
            eqn = c.jaxpr.eqns[i]
            site = source_line(eqn)
            params = eqn.params
            nc, nk = jx.scan_num_consts(params), jx.scan_num_carry(params)
            k = chunk_length(params["length"], rec, memory_limit, options.chunk)
            if options.truncate is not None:
                k = min(options.truncate, params["length"])
            summary, details = _describe(eqn, rec, k, options)
            on_trunc = None
            if options.truncate is not None and check:
                def on_trunc(rel, site=site):
                    truncation_errors[site] = float(rel)
                    logger.info("hlopass: adjoint at %s: truncated gradient differs from the exact one by "
                                "%.3g (relative)", site, float(rel))
            fun = None
            mesh, axis, devices, why, gathered = (
                _sharding(options, params["length"], [rec.form], eqn.invars[nc + nk:], producers)
                if options.truncate is None else (None, None, None, "truncated", {}))
            if axis is not None:
                why = why or ("dense recurrences are not sharded (their per-device map is a matrix)"
                              if rec.form == "dense" else None)
                if why is None:
                    rows = params["length"] // devices
                    k = chunk_length(rows, rec, memory_limit, options.chunk)
                    fun = sharded_adjoint_scan(body_function(params["jaxpr"], nc, nk, own_context=False), nc, nk,
                                               len(eqn.invars) - nc - nk, params["length"], k, rec.form, mesh,
                                               axis, own_machinery,
                                               [v.aval for v in eqn.outvars])
                    summary, details = _describe(eqn, rec, k, options)
                    summary += (f"; time axis sharded over mesh axis {axis!r} ({devices} devices, "
                                f"{rows} steps each; one state per device boundary, parameter cotangents summed "
                                f"by one psum each)")
                    details = details + (("devices", devices),)
                else:
                    add(Note(NAME, "skip", site, f"not sharded over {axis!r}: {why}; "
                             f"one device's adjoint scan instead", "scan"))
            if fun is None:
                fun = adjoint_scan(body_function(params["jaxpr"], nc, nk), nc, nk, params["length"], k, rec.form,
                                   truncate=options.truncate, on_truncation=on_trunc, guard=own_machinery)
            inputs = list(eqn.invars)
            if axis is not None and why is None:   # sharded: read the sharded values, not their gathers
                inputs[nc + nk:] = [gathered.get(v, v) for v in inputs[nc + nk:]]
            reps.append(Replacement([i], inputs, list(eqn.outvars),
                                    lambda *vals, fun=fun: fun(*vals), anchor=i))
            add(Note(NAME, "adjoint_scan", site, summary, "scan", details))
        return rewrite(c, reps) if reps else c

    with own_machinery():
        new = rewrite_nested(closed, level)
    return original if new is closed else new
