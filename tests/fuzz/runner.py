"""Run seeded batches of random programs through ``hlopass.jit`` and ``jax.jit`` and compare.

A *batch* (one seed) is ``size`` programs drawn around one random threshold and split size and run
in one *mode*; all of its programs are compiled together, as one function returning every program's
outputs, so one compile serves many programs:

- ``value``: ``hlopass.jit(F)`` against ``jax.jit(F)``;
- ``vmap_in`` / ``vmap_out``: ``hlopass.jit(jax.vmap(F))`` / ``jax.jit(jax.vmap(hlopass.jit(F)))`` (each
  input gets a leading axis of 2);
- ``grad_in`` / ``grad_out``: values and gradients of a fixed linear functional of the float outputs
  with respect to every float input, ``hlopass.jit(value_and_grad(F))`` /
  ``jax.jit(value_and_grad(hlopass.jit(F)))`` (the outer ``jax.jit`` keeps it one compile).

Values are compared with dtype-aware tolerances relative to the largest finite reference magnitude,
NaN and infinities where they are, integers and indices exactly. A batch that raises is re-run one
program at a time to find the culprit. Reproduce a failure with
``python -m tests.fuzz.runner --seeds SEED [--program INDEX] -v`` (``--no-exclusions`` to draw the
programs of known defects too).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import resource
import sys
import time
import traceback

import jax
import jax.numpy as jnp
from hlopass import internals as jx
import numpy as np

import hlopass
import hlopass.call
import hlopass.checked
from tests.fuzz.exclusions import excluded
from tests.fuzz.pieces import PIECES
from tests.fuzz.programs import Program, RandomDraw, draw_program, float_inputs, linear_loss, vocabulary

MODES = ["value", "value", "value", "value", "vmap_in", "vmap_out", "grad_in", "grad_out"]
#: Modes of a batch run on 4 host devices (``--devices 4``, a child process with
#: ``XLA_FLAGS=--xla_force_host_platform_device_count=4``): every input gets a leading axis of 4, placed
#: ``NamedSharding(mesh, P("x"))``; ``sharded_vmap`` / ``sharded_grad``: ``hlopass.jit(jax.vmap(F))`` (and
#: its value and gradient) on the sharded inputs; ``shard_map_in`` / ``shard_map_out``:
#: ``hlopass.jit(shard_map(vmap(F)))`` / ``jax.jit(shard_map(vmap(hlopass.jit(F))))``.
SHARDED_MODES = ["sharded_vmap", "sharded_grad", "shard_map_in", "shard_map_out"]
DEVICES = 4
#: Gradient batches of the frontier vocabulary run under a memory limit this often: the arguments and
#: results plus a fraction (below) of the temporaries ``jax.jit`` needs, so the ``remat`` pass (and the
#: split's memory-limit retries) change the program.
MEMORY_LIMIT_P = 0.25
#: The gradient modes that draw a memory limit: not ``grad_out`` yet. The remat pass's ``before_linearize``
#: raised there (``test_regressions.py::test_remat_before_linearize_of_a_cumulative_op``, fixed); adding it
#: changes the fixed frontier seeds' programs, which must be run again first.
MEMORY_LIMIT_MODES = ("grad_in", "sharded_grad")
MEMORY_FRACTIONS = [0.25, 0.5, 0.75]   # below 0.5 with splitting off (the remat pass alone)
THRESHOLDS = [8_000, 12_000, 16_000, 24_000, 32_000, 64_000, 128_000, 256_000]
#: Tolerance relative to the largest finite magnitude of the reference leaf.
TOLERANCE = {"float64": 1e-9, "float32": 2e-4, "float16": 2e-2, "bfloat16": 8e-2}
#: Gradients sum hundreds of terms, and an expanded distance's gradient cancels (x·Σg − Σg·y): float32
#: gradients get this tolerance instead.
GRADIENT_TOLERANCE_FLOAT32 = 1e-3
BATCH_SIZE = 8
#: Lines the test run prints at its end (tests/fuzz/conftest.py).
SUMMARY_LINES: list[str] = []


#: Pieces that select among values (which one is the largest, the order): a gradient through them
#: jumps when rounding reorders near-equal values.
SELECTIONS = ("reduce:max", "reduce:min", "reduce:top_k", "post:sort", "post:top_k", "frontier:cummax_long",
              "frontier:scatter_reduce")


def is_gradient_mode(mode: str) -> bool:
    """Whether ``mode`` compares gradients too (its results are ``(values, gradients)``)."""
    return mode.startswith("grad") or mode == "sharded_grad"


def lead_axes(mode: str) -> tuple:
    """The leading axes every input gets in ``mode``."""
    if mode.startswith("vmap"):
        return (2,)
    if mode in SHARDED_MODES:
        return (DEVICES,)
    return ()


def well_posed(program: Program, mode: str) -> bool:
    """Whether comparing ``program`` in ``mode`` can only fail for a wrong rewrite.

    Not so: gradients through a selection of inexact values (a reordered sum picks another of two
    near-equal maxima, or sorts them the other way, and the gradient lands on another entry; on the
    integer grid, float32 and float64 values are exact and ties are real ties), and gradients of
    ``sqrt`` near zero off the integer grid (a value rounded to 1e-8 instead of 0 has derivative 5e3
    instead of 0): the derivative is discontinuous or unbounded there, rounding decides. Nor
    gradients of 16-bit programs off the integer grid or through transcendental functions: rounding
    at 8 to 11 bits inside sums of hundreds of terms decides them (their values are still compared).
    """
    gradient = is_gradient_mode(mode) or program.has("wrap:grad")
    if gradient and any(PIECES[p.split(":")[0]][p.split(":")[1]].differentiable is False for p in program.pieces):
        return False   # a while_loop: not reverse-differentiable, under jax.jit either
    if gradient and program.dtype in ("float16", "bfloat16") and not program.exact:
        return False
    if gradient and any(program.has(s) for s in SELECTIONS) and (
            not program.grid or program.dtype in ("float16", "bfloat16")):
        return False
    if gradient and program.has("map:safe_sqrt") and (not program.grid or program.dtype in ("float16", "bfloat16")):
        return False
    return True


@dataclasses.dataclass
class Batch:
    seed: str
    threshold: int
    split_size: int
    mode: str
    x64: bool
    programs: list[Program]
    excluded: dict = dataclasses.field(default_factory=dict)
    #: run under a memory limit of the arguments and results plus this fraction of jax.jit's temporaries
    memory_fraction: float | None = None

    def header(self) -> str:
        limit = "" if self.memory_fraction is None else f" memory_limit=args+outs+{self.memory_fraction}*temp"
        return (f"seed {self.seed}: mode={self.mode} threshold={self.threshold} split_size={self.split_size} "
                f"x64={self.x64}{limit}")


def draw_batch(seed, size: int = BATCH_SIZE, only: int | None = None, exclusions: bool = True,
               devices: int = 1, choices: list[int] | None = None) -> Batch:
    """The batch of ``seed`` (deterministic); ``only`` keeps one program (same draws);
    ``exclusions=False`` draws the known-failing programs too (to reproduce a defect); ``devices=4``
    draws a mode of :data:`SHARDED_MODES` (run it with that many host devices); ``choices`` replays a
    minimised program (:func:`minimise`) in place of program ``only``."""
    r = RandomDraw(f"batch/{seed}")
    threshold = r.choice(THRESHOLDS)
    split_size = max(1, threshold // r.choice([1, 1, 2, 4, 8]))
    mode = r.choice(MODES)
    x64 = r.boolean(0.3)
    frontier = vocabulary(seed) >= 2
    # drawn after the choices above, and only for the frontier vocabulary: older seeds keep their batches
    memory_fraction = None
    if frontier and devices > 1:
        mode = r.choice(SHARDED_MODES)
    if frontier and mode in MEMORY_LIMIT_MODES and r.boolean(MEMORY_LIMIT_P):
        memory_fraction = r.choice(MEMORY_FRACTIONS)
    batch = Batch(str(seed), threshold, split_size, mode, x64, [], memory_fraction=memory_fraction)
    hits = collections.Counter()
    for i in range(size):
        if only is not None and i != only:
            continue
        if choices is not None and i == only:
            batch.programs.append(draw_program(ReplayDraw(choices), threshold, label=f"{seed}/{i}", x64=x64,
                                               frontier=frontier))
            continue
        for attempt in range(50):
            program = draw_program(RandomDraw(f"{seed}/{i}/{attempt}"), threshold, label=f"{seed}/{i}", x64=x64,
                                   frontier=frontier)
            if not well_posed(program, mode):
                continue
            hit = excluded(program, mode) if exclusions else None
            if hit is None:
                break
            hits[hit] += 1
        batch.programs.append(program)
    batch.excluded = dict(hits)
    return batch


# ------------------------------------------------------------------------------------ minimising
class RecordingDraw(RandomDraw):
    """A :class:`RandomDraw` that records each choice as a small integer (an index, an offset from the
    low end, 0/1), so that :class:`ReplayDraw` can replay it, changed."""

    def __init__(self, seed):
        super().__init__(seed)
        self.choices: list[int] = []

    def choice(self, seq):
        k = self.rng.randrange(len(seq))
        self.choices.append(k)
        return seq[k]

    def integer(self, lo, hi):
        value = self.rng.randint(lo, hi)
        self.choices.append(value - lo)
        return value

    def boolean(self, p=0.5):
        value = self.rng.random() < p
        self.choices.append(int(value))
        return value


class ReplayDraw(RandomDraw):
    """Replays recorded choices; a choice past the end, or out of range, is the simplest (the first
    item, the low end, ``False``)."""

    def __init__(self, choices):
        super().__init__(0)
        self.queue = list(choices)
        self.used = 0

    def _next(self, limit: int) -> int:
        k = self.queue[self.used] if self.used < len(self.queue) else 0
        self.used += 1
        return k if 0 <= k < limit else 0

    def choice(self, seq):
        return seq[self._next(len(seq))]

    def integer(self, lo, hi):
        return lo + self._next(hi - lo + 1)

    def boolean(self, p=0.5):
        return bool(self._next(2))


def primitive_families(program: Program) -> list[str]:
    """The primitive families (``hlopass.families``, coarser where it has none) of the equations of
    ``program``, sub-programs walked into."""
    from hlopass import families as fam
    named = [("custom derivative", fam.CUSTOM_DERIVATIVE_CALLS), ("control flow", fam.CONTROL_FLOW),
             ("cumulative", set(fam.CUMULATIVE)), ("reduction", set(fam.REDUCTIONS) | fam.ARG_REDUCTIONS),
             ("contraction", {"dot_general"}), ("linear algebra", {"triangular_solve", "cholesky", "lu", "qr",
                                                                   "eigh", "svd", "custom_linear_solve"}),
             ("indexing", {"gather", "scatter", "scatter-add", "scatter_add", "scatter_mul", "scatter_min",
                           "scatter_max", "dynamic_slice", "dynamic_update_slice", "slice", "pad", "concatenate"}),
             ("sorting", {"sort", "top_k"}), ("layout", fam.LAYOUT), ("elementwise", fam.ELEMENTWISE)]
    seen: set[str] = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            seen.add(next((label for label, names in named if name in names), "other"))
            for value in eqn.params.values():
                for sub in (value if isinstance(value, (tuple, list)) else (value,)):
                    inner = getattr(sub, "jaxpr", None)
                    if inner is not None:
                        walk(inner if hasattr(inner, "eqns") else inner.jaxpr)
                    elif hasattr(sub, "eqns"):
                        walk(sub)
    try:
        walk(jax.make_jaxpr(program.fn)(*program.make_inputs()).jaxpr)
    except Exception:  # noqa: BLE001 - a program that cannot be traced alone: unknown
        return []
    return sorted(seen)


def failure_kind(failure: dict) -> str:
    """What a failure is: ``value mismatch``, ``gradient mismatch``, ``pass skipped`` (a pass raised:
    a user's run would skip it, and name it in the report), ``crash`` (anything else raised) or
    ``batch`` (the batch raised and no program alone does)."""
    problem = failure["problem"]
    if problem.startswith("batch raised"):
        return "batch"
    if problem.startswith("raised"):
        return "pass skipped" if failure.get("pass") else "crash"
    if problem.startswith("d/d input"):
        return "gradient mismatch"
    return "value mismatch"


def minimise(seed, index: int, size: int = BATCH_SIZE, devices: int = 1, budget_s: float = 600.0,
             log=None) -> dict:
    """Shrink program ``index`` of batch ``seed`` while it still fails the same way.

    The program's draw is recorded (:class:`RecordingDraw`) and replayed with choices moved towards the
    simplest (each to 0 — no map, no post, no wrap, the first piece, the smallest size — then halved),
    keeping each change under which the program, alone in a batch of the same threshold, split size,
    mode and memory limit, still fails with the same :func:`failure_kind`; programs that are not
    well posed or are excluded are not candidates. Returns ``{"choices", "program", "pieces",
    "problem", "kind", "trials", "reproduce"}``; ``choices`` is ``None`` when the program alone no
    longer fails (the batch's other programs matter)."""
    start = time.perf_counter()
    batch = draw_batch(seed, size, only=index, devices=devices)
    first = batch.programs[0]
    attempt = 0
    while True:   # the attempt whose draw became the program (draw_batch redraws ill-posed ones)
        recorder = RecordingDraw(f"{seed}/{index}/{attempt}")
        program = draw_program(recorder, batch.threshold, label=first.label, x64=batch.x64,
                               frontier=vocabulary(seed) >= 2)
        if program.description == first.description or attempt >= 50:
            break
        attempt += 1

    rewrites = {}

    def failing(choices):
        candidate = draw_batch(seed, size, only=index, devices=devices, choices=choices)
        program = candidate.programs[0]
        if not well_posed(program, candidate.mode) or excluded(program, candidate.mode):
            return None
        with jax.enable_x64(candidate.x64):
            result = check_batch(candidate, isolate=False)
        if result["failures"]:
            rewrites[tuple(choices)] = dict(result["rewrites"])
        return result["failures"][0] if result["failures"] else None

    best = list(recorder.choices)
    found = failing(best)
    trials = 1
    if found is None:
        return {"choices": None, "program": repr(first), "pieces": list(first.pieces), "problem": None,
                "kind": None, "trials": trials, "reproduce": None}
    kind = failure_kind(found)
    changed = True
    while changed and time.perf_counter() - start < budget_s:
        changed = False
        for k in range(len(best)):
            for smaller in dict.fromkeys([0, best[k] // 2]):
                if k >= len(best) or smaller >= best[k] or time.perf_counter() - start >= budget_s:
                    continue
                trial = best[:k] + [smaller] + best[k + 1:]
                trials += 1
                try:
                    again = failing(trial)
                except Exception:  # noqa: BLE001 - a candidate that cannot be built or run is no smaller case
                    again = None
                if again is not None and failure_kind(again) == kind:
                    best, found, changed = trial, again, True
                    if log:
                        log(f"  shrunk choice {k} to {smaller}: {found['program']}")
                    break
    program = draw_batch(seed, size, only=index, devices=devices, choices=best).programs[0]
    used = ReplayDraw(best)
    draw_program(used, batch.threshold, x64=batch.x64, frontier=vocabulary(seed) >= 2)
    fired = rewrites.get(tuple(best), {})
    best = best[:used.used]
    text = ",".join(map(str, best))
    with jax.enable_x64(batch.x64):
        families = primitive_families(program)
    return {"choices": best, "program": repr(program), "pieces": list(program.pieces), "problem": found["problem"],
            "kind": kind, "trials": trials, "rewrites": fired, "families": families, "pass": found.get("pass"),
            "reproduce": f"python -m tests.fuzz.runner --seeds {seed} --size {size} --program {index} "
                         f"--choices {text}" + (f" --devices {devices}" if devices > 1 else "") + " -v"}


# ----------------------------------------------------------------------------------------- running
def _combined(programs: list[Program]):
    offsets = np.cumsum([0] + [len(p.inputs) for p in programs]).tolist()

    def F(*flat):
        return [p.fn(*flat[offsets[i]:offsets[i + 1]]) for i, p in enumerate(programs)]
    return F, offsets


def _value_and_grad(F, float_pos):
    def g(*flat):
        def loss(*diff):
            full = list(flat)
            for k, v in zip(float_pos, diff):
                full[k] = v
            outs = F(*full)
            return linear_loss(outs), outs
        (_, outs), grads = jax.value_and_grad(loss, argnums=tuple(range(len(float_pos))), has_aux=True)(
            *[flat[k] for k in float_pos])
        return outs, grads
    return g


@contextlib.contextmanager
def observed_reports():
    """Collect the report of every pipeline run the ``hlopass_call`` s make meanwhile (lowered, or
    called eagerly: forward, backward and batched programs alike), without running the passes a
    second time."""
    reports = []
    original = hlopass.call.run_pipeline
    runners = (hlopass.call, hlopass.checked)  # the lowering rule, and the primitive's eager calls

    def observing(*args, **kwargs):
        result = original(*args, **kwargs)
        reports.append(result.report)
        return result
    for module in runners:
        module.run_pipeline = observing
    try:
        yield reports
    finally:
        for module in runners:
            module.run_pipeline = original


def execute(batch: Batch, reference_only: bool = False, widen: bool = False, perturb: bool = False):
    """Run ``batch`` both ways: ``(got, want, reports, float_pos, offsets, mode)``. ``widen`` runs the
    programs on inputs of the next wider float type (16-bit -> float32 -> float64, with x64 on), the
    reference only (``reference_only``). A sharded batch whose ``jax.jit`` refuses its explicitly typed
    values outside their mesh (a vmapped scan or loop) runs again, both ways, with the mesh set."""
    try:
        return _execute(batch, reference_only, widen, perturb)
    except ReferenceFailed:
        if batch.mode not in SHARDED_MODES:
            raise
    with jax.set_mesh(jax.make_mesh((DEVICES,), ("x",))):
        return _execute(batch, reference_only, widen, perturb)


def _execute(batch: Batch, reference_only: bool, widen: bool, perturb: bool):
    programs = batch.programs
    F, offsets = _combined(programs)
    flat = [a for p in programs for a in p.make_inputs(lead_axes(batch.mode))]
    if widen:
        jitter = np.random.default_rng(0)
        flat = [_widened(a, jitter if perturb else None) for a in flat]
    specs = [s for p in programs for s in p.inputs]
    float_pos = float_inputs(specs)
    mode = batch.mode
    if not float_pos and is_gradient_mode(mode):
        mode = "sharded_vmap" if mode in SHARDED_MODES else "value"
    settings = dict(threshold=batch.threshold, split_size=batch.split_size)
    if mode in SHARDED_MODES:
        ours, ref, flat = _sharded(mode, F, float_pos, flat, settings)
    elif mode == "value":
        ours, ref = hlopass.jit(F, **settings), jax.jit(F)
    elif mode == "vmap_in":
        ours, ref = hlopass.jit(jax.vmap(F), **settings), jax.jit(jax.vmap(F))
    elif mode == "vmap_out":
        ours, ref = jax.jit(jax.vmap(hlopass.jit(F, **settings))), jax.jit(jax.vmap(F))
    elif mode == "grad_in":
        ours, ref = hlopass.jit(_value_and_grad(F, float_pos), **settings), jax.jit(_value_and_grad(F, float_pos))
    elif mode == "grad_out":
        ours = jax.jit(_value_and_grad(hlopass.jit(F, **settings), float_pos))
        ref = jax.jit(_value_and_grad(F, float_pos))
    else:
        raise ValueError(mode)
    try:
        if batch.memory_fraction is not None and not reference_only:
            compiled = ref.lower(*flat).compile()
            stats = compiled.memory_analysis()
            if batch.memory_fraction < 0.5:   # the remat pass alone (no split) against the limit
                settings["threshold"] = settings["split_size"] = "off"
            settings["memory_limit"] = max(1, int(stats.argument_size_in_bytes + stats.output_size_in_bytes
                                                  + batch.memory_fraction * stats.temp_size_in_bytes))
            ours = _rebuilt(mode, F, float_pos, flat, settings, ours)
            want = jax.device_get(compiled(*flat))
        else:
            want = jax.device_get(ref(*flat))
    except Exception as err:
        raise ReferenceFailed(f"jax.jit itself raised {type(err).__name__}: {err}") from err
    if reference_only:
        return None, want, [], float_pos, offsets, mode
    with observed_reports() as reports:
        got = jax.device_get(ours(*flat))
    return got, want, reports, float_pos, offsets, mode


class ReferenceFailed(RuntimeError):
    """``jax.jit`` of the program itself raised: not a finding about hlopass."""


def _rebuilt(mode, F, float_pos, flat, settings, ours):
    """``ours`` again with ``settings`` (a memory limit added once jax.jit's figures are known)."""
    if mode in SHARDED_MODES:
        return _sharded(mode, F, float_pos, flat, settings)[0]
    if mode in ("value", "vmap_in", "grad_in"):
        inner = {"value": F, "vmap_in": jax.vmap(F), "grad_in": _value_and_grad(F, float_pos)}[mode]
        return hlopass.jit(inner, **settings)
    if mode == "vmap_out":
        return jax.jit(jax.vmap(hlopass.jit(F, **settings)))
    return jax.jit(_value_and_grad(hlopass.jit(F, **settings), float_pos))


def _sharded(mode, F, float_pos, flat, settings):
    """``(ours, ref, flat)`` of a :data:`SHARDED_MODES` batch: the inputs placed along their leading
    axis of :data:`DEVICES` on a mesh of that many devices."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((DEVICES,), ("x",))
    flat = [jax.device_put(a, NamedSharding(mesh, P("x"))) for a in flat]

    def mapped(fn):
        return jax.shard_map(jax.vmap(fn), mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
    if mode == "sharded_vmap":
        return hlopass.jit(jax.vmap(F), **settings), jax.jit(jax.vmap(F)), flat
    if mode == "sharded_grad":
        grad = _value_and_grad(jax.vmap(F), float_pos)
        return hlopass.jit(grad, **settings), jax.jit(grad), flat
    if mode == "shard_map_in":
        return hlopass.jit(mapped(F), **settings), jax.jit(mapped(F)), flat
    if mode == "shard_map_out":
        return jax.jit(mapped(hlopass.jit(F, **settings))), jax.jit(mapped(F)), flat
    raise ValueError(mode)


#: Leaves found ill-conditioned by :func:`as_accurate` (jax.jit itself off the wider run), for the summary.
ILL_CONDITIONED: list[str] = []
#: The wider type a program is re-run in to judge a difference from ``jax.jit`` (:func:`as_accurate`).
WIDER = {"float16": np.float32, "bfloat16": np.float32, "float32": np.float64}


def _widened(a: np.ndarray, jitter: np.random.Generator | None) -> np.ndarray:
    """``a`` in its wider type (float64 stays float64: there is none wider); with ``jitter``, each entry
    moved by about one rounding step of its own type."""
    if a.dtype.name not in WIDER and not (jitter is not None and a.dtype.name == "float64"):
        return a
    wide = a.astype(WIDER.get(a.dtype.name, a.dtype))
    if jitter is not None:
        wide = wide * (1 + float(jnp.finfo(a.dtype).eps) * jitter.standard_normal(a.shape)).astype(wide.dtype)
    return wide


def _reference_of(batch: Batch, index: int, **how):
    """The reference run's values (and gradients, in a gradient mode) of program ``index`` alone
    (``how``: :func:`execute`'s ``widen`` and ``perturb``)."""
    single = dataclasses.replace(batch, programs=[batch.programs[index]])
    _, want, _, _, _, mode = execute(single, reference_only=True, **how)
    if is_gradient_mode(mode):
        return want[0][0], want[1]
    return want[0], None


def wider_reference(batch: Batch, index: int, perturb: bool = False):
    """``jax.jit``'s values (and gradients) of program ``index`` run in the next wider float type
    (``perturb``: on inputs moved by about one rounding step of their own type)."""
    with jax.enable_x64(True):
        return _reference_of(batch, index, widen=True, perturb=perturb)


def as_accurate(got, want, wide, jittered, where: str = "") -> str | None:
    """``None`` when ``got`` is as close to ``wide`` (the program run in a wider type) as plain
    ``jax.jit``'s ``want`` is, within a factor of 2 and the dtype's tolerance of the wide values'
    scale; or when the program is ill-conditioned in its type (rounding decides, e.g. a softmax of
    bfloat16 logits in the thousands, whose rounding step is 16): ``jax.jit`` itself, or the wide run
    on inputs moved by one rounding step (``jittered``), is farther than that tolerance from the wide
    values. Integer leaves (counts, indices of inexact values) are judged by how many entries differ
    from the wide run: hlopass within twice ``jax.jit``'s count, or within the count that one rounding
    step of the inputs moves. Else what differs."""
    problems = []
    leaves = zip(*(jax.tree_util.tree_leaves(t) for t in (got, want, wide, jittered)))
    for k, (g, w, h, j) in enumerate(leaves):
        g, w = np.asarray(g), np.asarray(w)
        if not jnp.issubdtype(w.dtype, jnp.floating):
            h, j = np.asarray(h), np.asarray(j)
            if h.shape != w.shape or j.shape != w.shape:
                return f"{where}[{k}]: the wider run has shape {h.shape}"
            ours, plains, spread = (int(np.sum(a != h)) for a in (g, w, j))
            if ours > max(2 * plains, spread):
                problems.append(f"{where}[{k}]: {ours} integer entries differ from the wider run, "
                                f"jax.jit's {plains}, one rounding step of the inputs moves {spread}")
            elif spread > 2 * plains:
                ILL_CONDITIONED.append(f"{where}[{k}]: one rounding step of the inputs moves {spread} integer "
                                       f"entries of the wider run, jax.jit differs in {plains}, hlopass in {ours}")
            continue
        g64, w64, h64, j64 = (np.asarray(a, np.float64) for a in (g, w, h, j))
        if h64.shape != w64.shape or j64.shape != w64.shape:
            return f"{where}[{k}]: the wider run has shape {h64.shape}"
        ok = np.isfinite(g64) & np.isfinite(w64) & np.isfinite(h64) & np.isfinite(j64)
        if not ok.any():
            continue
        scale = max(float(np.max(np.abs(h64[ok]))), 1e-30)
        ours, plains = np.abs(g64[ok] - h64[ok]).max(), np.abs(w64[ok] - h64[ok]).max()
        spread = np.abs(j64[ok] - h64[ok]).max()
        tol = TOLERANCE[w.dtype.name] * scale
        if max(plains, spread) > tol:
            ILL_CONDITIONED.append(f"{where}[{k}]: one rounding step of the inputs moves the {h.dtype} run by "
                                   f"{spread:.3g}, jax.jit is {plains:.3g} from it, hlopass {ours:.3g} "
                                   f"(tolerance {tol:.3g})")
            continue
        if ours > 2 * plains + tol:
            problems.append(f"{where}[{k}]: hlopass is {ours:.3g} from the {h.dtype} run, jax.jit {plains:.3g}")
    return "; ".join(problems) or None


def _tolerance(leaf_dtype, program_dtype: str, gradient: bool) -> float:
    """Relative tolerance of a float leaf: its own dtype's or the program's, whichever is looser, and
    :data:`GRADIENT_TOLERANCE_FLOAT32` for a float32 gradient."""
    leaf = jnp.dtype(leaf_dtype).name
    wider_grad = GRADIENT_TOLERANCE_FLOAT32 if gradient and "float32" in (leaf, program_dtype) else 0.0
    return max(TOLERANCE[leaf], TOLERANCE.get(program_dtype, 0.0), wider_grad)


def compare(got, want, where: str = "", dtype: str = "float64", gradient: bool = False) -> str | None:
    """``None`` when ``got`` matches ``want``, else what differs. Float leaves get the tolerance of
    their own dtype or of the program's ``dtype``, whichever is looser (a float32 loss of float16
    values carries float16 rounding)."""
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    if got_tree != want_tree:
        return f"{where}: structure {got_tree} != {want_tree}"
    for k, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        g, w = np.asarray(g), np.asarray(w)
        name = f"{where}[{k}]"
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"{name}: {g.dtype}{g.shape} != {w.dtype}{w.shape}"
        if not jnp.issubdtype(w.dtype, jnp.floating):
            if not np.array_equal(g, w):
                bad = np.argwhere(g != w)
                return f"{name}: {len(bad)} of {w.size} integer entries differ, first at {bad[0].tolist()}: " \
                       f"{g[tuple(bad[0])]} != {w[tuple(bad[0])]}"
            continue
        g64, w64 = g.astype(np.float64), w.astype(np.float64)
        nan_g, nan_w = np.isnan(g64), np.isnan(w64)
        if not np.array_equal(nan_g, nan_w):
            return f"{name}: NaN at {int((nan_g & ~nan_w).sum())} entries only in hlopass, " \
                   f"{int((nan_w & ~nan_g).sum())} only in jax.jit (of {w.size})"
        inf_w = np.isinf(w64)
        if not np.array_equal(g64[inf_w], w64[inf_w]):
            return f"{name}: {int((g64[inf_w] != w64[inf_w]).sum())} infinities of jax.jit differ"
        finite = np.isfinite(w64)
        if not finite.any():
            continue
        near_max = np.abs(w64) > 0.25 * float(jnp.finfo(w.dtype).max)   # overflow is rounding there
        if np.isinf(g64[finite & ~near_max]).any():
            return f"{name}: hlopass overflows where jax.jit is finite"
        scale = max(float(np.max(np.abs(w64[finite]))), 1e-30)
        ok = finite & ~near_max
        err = np.abs(g64[ok] - w64[ok])
        tol = _tolerance(w.dtype, dtype, gradient) * scale
        if err.size and float(err.max()) > tol:
            i = int(np.argmax(err))
            return f"{name}: max error {err.max():.3g} > {tol:.3g} (scale {scale:.3g}; " \
                   f"{g64[ok][i]!r} vs {w64[ok][i]!r})"
    return None


def check_batch(batch: Batch, isolate: bool = True) -> dict:
    """Run and compare; ``{"failures": [...], "rewrites": Counter, "programs": n}``."""
    result = {"failures": [], "rewrites": collections.Counter(), "programs": len(batch.programs),
              "excluded": dict(batch.excluded)}
    try:
        got, want, reports, float_pos, offsets, mode = execute(batch)
    except Exception as err:  # noqa: BLE001 - a crash is a finding
        message = f"{type(err).__name__}: {err}".splitlines()[0][:400]
        trace = traceback.format_exc(limit=-8)
        if len(batch.programs) == 1 and isinstance(err, ReferenceFailed):
            result["reference_failed"] = [f"{batch.programs[0].label}: {message}"]
            return result
        if not isolate or len(batch.programs) == 1:
            result["failures"].append(_failure(batch, batch.programs[0] if len(batch.programs) == 1 else None,
                                               f"raised {message}", traceback.format_exc(limit=-6),
                                               culprit=_culprit_pass(err)))
            return result
        found = False
        for program in batch.programs:  # find the program(s) that raise alone
            single = dataclasses.replace(batch, programs=[program])
            sub = check_batch(single, isolate=False)
            result["failures"].extend(sub["failures"])
            result["rewrites"].update(sub["rewrites"])
            result.setdefault("reference_failed", []).extend(sub.get("reference_failed", []))
            found |= bool(sub["failures"]) or bool(sub.get("reference_failed"))
        # jax.jit refusing the batch whole while every program alone runs both ways and compares (a
        # sharded batch may mix a program that needs the values' mesh set with one JAX refuses under it:
        # s406148508680) tests every program: not a finding
        if not found and not isinstance(err, ReferenceFailed):
            result["failures"].append(_failure(batch, None, f"batch raised, no program alone does: {message}", trace))
        return result
    unguarded = []
    for report in reports:
        for rewrite in report.rewrites:
            result["rewrites"][f"{rewrite.pass_name}:{rewrite.kind}"] += 1
            if "Inf/NaN not guarded" in rewrite.summary:
                unguarded.append(f"{rewrite.pass_name}:{rewrite.kind}")
    grads_got = grads_want = None
    if is_gradient_mode(mode):
        (got, grads_got), (want, grads_want) = got, want
    for i, program in enumerate(batch.programs):
        mine = [j for j, k in enumerate(float_pos) if offsets[i] <= k < offsets[i + 1]]
        problem = compare(got[i], want[i], "values", program.dtype, gradient=program.has("wrap:grad"))
        if problem is None and grads_got is not None:
            for j in mine:
                problem = compare(grads_got[j], grads_want[j], f"d/d input {float_pos[j] - offsets[i]}",
                                  program.dtype, gradient=True)
                if problem:
                    break
        if problem and "NaN" not in problem and "infinit" not in problem \
                and ("integer" not in problem or not _exact_in_its_type(batch, i, want)) \
                and (program.dtype in WIDER or program.dtype == "float64"):
            # float64 has no wider type: its "wider run" is itself, and a leaf that one rounding step
            # of the inputs moves past the tolerance is rounding noise (an analytically zero gradient)
            problem = _judged_by_wider_run(batch, i, got, want, grads_got, grads_want, mine, problem)
            if problem is None:
                result["as_accurate"] = result.get("as_accurate", 0) + 1
            elif program.dtype in ("float16", "bfloat16") and batch.mode not in SHARDED_MODES:
                problem = _judged_as_written(batch, i, got, grads_got, mine, problem)
                if problem is None:
                    result.setdefault("as_written", []).append(program.label)
                    continue
        if problem and problem.startswith("d/d input") and program.has("wrap:grad") \
                and result["rewrites"]["hvp:fwdrev_hvp"] and program.dtype in WIDER:
            problem = _judged_fwdrev(batch, i, grads_got, grads_want, mine, problem)
            if problem is None:
                result.setdefault("fwdrev", []).append(program.label)
                continue
        if problem and ("NaN" in problem or "infinit" in problem) and not program.specials \
                and program.dtype in ("float16", "bfloat16"):
            problem = _judged_overflow(batch, i, got, want, grads_got, grads_want, mine, problem)
            if problem is None:
                result["overflow"] = result.get("overflow", 0) + 1
                continue
        if problem and program.specials and unguarded and ("NaN" in problem or "infinit" in problem):
            # the README's documented deviation: a rewrite without the finite guard (its report says
            # "Inf/NaN not guarded") may give NaN where plain gives ±Inf
            result.setdefault("unguarded", []).append(f"{program.label} ({', '.join(sorted(set(unguarded)))}): {problem}")
            continue
        if problem:
            result["failures"].append(_failure(batch, program, problem))
    return result


#: Past this magnitude a float type no longer holds every integer.
EXACT_INTEGERS = {"bfloat16": 2.0 ** 8, "float16": 2.0 ** 11, "float32": 2.0 ** 24, "float64": 2.0 ** 53}


def largest_intermediate(program: Program) -> float | None:
    """The largest magnitude of any float value ``program`` computes on its inputs, evaluated in float64
    equation by equation (calls walked into); ``None`` when an equation cannot be so evaluated (a loop
    or a conditional, whose body expects its own types)."""
    from hlopass.jaxpr_utils import call_body
    inputs = program.make_inputs()

    def walk(jaxpr, consts, args, largest):
        env = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        def read(v):
            value = v.val if isinstance(v, jx.Literal) else env[v]
            return jnp.asarray(value, jnp.float64) if jnp.issubdtype(jnp.result_type(value), jnp.floating) else value
        for eqn in jaxpr.eqns:
            values = [read(v) for v in eqn.invars]
            body = call_body(eqn)
            if body is not None:
                outs = walk(body.jaxpr, body.consts, values, largest)
            elif eqn.primitive.name == "convert_element_type" and jnp.issubdtype(eqn.params["new_dtype"], jnp.floating):
                outs = [jnp.asarray(values[0], jnp.float64)]
            else:
                params = dict(eqn.params)
                if "preferred_element_type" in params and params["preferred_element_type"] is not None \
                        and jnp.issubdtype(params["preferred_element_type"], jnp.floating):
                    params["preferred_element_type"] = jnp.float64
                outs = eqn.primitive.bind(*values, **params)
                outs = outs if eqn.primitive.multiple_results else [outs]
            for v, out in zip(eqn.outvars, outs):
                env[v] = out
                if jnp.issubdtype(jnp.result_type(out), jnp.floating):
                    finite = np.abs(np.asarray(out, np.float64))
                    finite = finite[np.isfinite(finite)]
                    if finite.size:
                        largest[0] = max(largest[0], float(finite.max()))
        return [read(v) for v in jaxpr.outvars]

    try:
        with jax.enable_x64(True):
            closed = jax.make_jaxpr(program.fn)(*inputs)
            wide = [np.asarray(a, np.float64) if np.issubdtype(a.dtype, np.floating) else a for a in inputs]
            largest = [max((float(np.abs(a).max()) for a in wide if a.dtype == np.float64 and a.size), default=0.0)]
            walk(closed.jaxpr, closed.consts, wide, largest)
    except Exception:  # noqa: BLE001 - not evaluable in float64: unknown
        return None
    return largest[0]


def _exact_in_its_type(batch, i, want) -> bool:
    """Whether program ``i`` is exact (integer grid inputs, exact pieces) and stays so in its own type:
    no value it computes is past the integers its type holds (:func:`largest_intermediate`), and
    ``jax.jit``'s float results equal the program run in the next wider type. A bfloat16 square or sum
    of grid values past 256 rounds, and then its ties, and the indices that break them, depend on
    rounding like any other program's (fresh seeds r127685842164, r660789466657)."""
    program = batch.programs[i]
    if not program.exact:
        return False
    largest = largest_intermediate(program)
    if largest is not None and largest > EXACT_INTEGERS.get(program.dtype, float("inf")):
        return False
    try:
        wide_values, _ = wider_reference(batch, i)
    except Exception:  # noqa: BLE001 - no wider run: keep the strict judgement
        return True
    for w, h in zip(jax.tree_util.tree_leaves(want[i]), jax.tree_util.tree_leaves(wide_values)):
        w, h = np.asarray(w), np.asarray(h)
        if jnp.issubdtype(w.dtype, jnp.floating) and not np.array_equal(w.astype(np.float64), np.asarray(h, np.float64),
                                                                          equal_nan=True):
            return False
    return True


def _judged_by_wider_run(batch, i, got, want, grads_got, grads_want, mine, problem) -> str | None:
    """``None`` when program ``i``'s difference from ``jax.jit`` is rounding: hlopass is as close as
    ``jax.jit`` to the program run in a wider type (:func:`as_accurate`); else ``problem`` and why."""
    try:
        wide_values, wide_grads = wider_reference(batch, i)
        jit_values, jit_grads = wider_reference(batch, i, perturb=True)
    except Exception as err:  # noqa: BLE001 - no wider run, the difference stands
        return f"{problem} (no wider run: {type(err).__name__})"
    label = batch.programs[i].label
    verdict = as_accurate(got[i], want[i], wide_values, jit_values, f"{label} values")
    if verdict is None and grads_got is not None:
        verdict = as_accurate([grads_got[j] for j in mine], [grads_want[j] for j in mine], wide_grads, jit_grads,
                              f"{label} gradients")
    return None if verdict is None else f"{problem}; {verdict}"


def as_written(batch: Batch, index: int):
    """Program ``index``'s values (and gradients, in a gradient mode) evaluated operation by operation
    in its own types (under ``jax.disable_jit``: every intermediate is rounded to its type, where XLA
    may keep a fused 16-bit intermediate in float32)."""
    with jax.disable_jit():
        return _reference_of(batch, index)


def _judged_as_written(batch, i, got, grads_got, mine, problem) -> str | None:
    """``None`` when 16-bit program ``i`` equals, to the usual tolerance, the program evaluated operation
    by operation in its own types (:func:`as_written`): hlopass computes what is written, and ``jax.jit``
    differs by XLA's excess precision (on CPU XLA computes a 16-bit product that feeds a float32 sum in
    float32 and never rounds it, where a split loop reads the product from memory in its type: fresh seed
    s804230096662). Else ``problem`` and why."""
    program = batch.programs[i]
    try:
        values, grads = as_written(batch, i)
    except Exception as err:  # noqa: BLE001 - no second opinion, the difference stands
        return f"{problem} (no evaluation as written: {type(err).__name__})"
    verdict = compare(got[i], values, "values", program.dtype, gradient=program.has("wrap:grad"))
    if verdict is None and grads_got is not None:
        for k, j in enumerate(mine):
            verdict = compare(grads_got[j], grads[k], f"d/d input {k}", program.dtype, gradient=True)
            if verdict:
                break
    return None if verdict is None else f"{problem}; as written, operation by operation: {verdict}"


def plain_forward_over_reverse(batch: Batch, index: int):
    """The gradients of program ``index`` in ``batch``'s mode under plain ``jax.jit``, with its inner
    gradient taken forward-over-reverse as written by hand (the hvp pass's trace-time interception,
    without the rest of hlopass): the formula the hvp pass emits, in plain JAX."""
    from passes.hvp.trace import intercept_gradients
    program = batch.programs[index]
    F, _ = _combined([program])
    flat = program.make_inputs()
    float_pos = float_inputs(program.inputs)
    with intercept_gradients([]):
        _, grads = jax.jit(_value_and_grad(F, float_pos))(*flat)
    return jax.device_get(grads)


def _judged_fwdrev(batch, i, grads_got, grads_want, mine, problem) -> str | None:
    """``None`` when program ``i``'s gradient difference is the rounding of forward-over-reverse: the
    program's inner gradient is differentiated again, which the hvp pass does forward-over-reverse
    (``jax.jvp`` of the gradient, where ``jax.jit`` goes reverse-over-reverse); the rewritten program
    run in the next wider type matches ``jax.jit``'s run there to that type's tolerance (the formula
    is right); and in its own type hlopass is as close to the wider run as the same formula written by
    hand in plain JAX (:func:`plain_forward_over_reverse`), within a factor of 2 and the tolerance.
    README, *hvp*, Rounding. Else ``problem`` and why."""
    single = dataclasses.replace(batch, programs=[batch.programs[i]])
    try:
        with jax.enable_x64(True):
            (_, wide_got), (_, wide_want), *_ = execute(single, widen=True)
        by_hand = plain_forward_over_reverse(batch, i)
    except Exception as err:  # noqa: BLE001 - no second opinion, the difference stands
        return f"{problem} (no forward-over-reverse check: {type(err).__name__}: {err})"
    label, dtype = batch.programs[i].label, batch.programs[i].dtype
    for j, (ours, hand, wide, reference) in enumerate(zip([grads_got[k] for k in mine], by_hand,
                                                          wide_got, wide_want)):
        formula = compare(wide, reference, f"{label} gradient {j} in the wider type", gradient=True)
        if formula:
            return f"{problem}; the rewrite differs from jax.jit in the wider type too: {formula}"
        ours64, hand64, ref64 = (np.asarray(a, np.float64) for a in (ours, hand, reference))
        ok = np.isfinite(ours64) & np.isfinite(hand64) & np.isfinite(ref64)
        if not ok.any():
            continue
        tol = _tolerance(np.asarray(ours).dtype, dtype, True) * float(np.abs(ref64[ok]).max())
        mine_off, hand_off = (float(np.abs(a[ok] - ref64[ok]).max()) for a in (ours64, hand64))
        if mine_off > 2 * hand_off + tol:
            return f"{problem}; {label} gradient {j}: hlopass is {mine_off:.3g} from the wider run, " \
                   f"forward-over-reverse by hand {hand_off:.3g}"
    return None


def overflowed_alike(got, want, wide, where: str = "") -> str | None:
    """``None`` when every entry where hlopass and ``jax.jit`` disagree about a 16-bit value being
    finite is an overflow of the type, not a change of the answer: the program run in float32
    (``wide``) is finite there, and either ``jax.jit`` overflowed (it is ±Inf/NaN) while hlopass is
    non-finite too or within the dtype's tolerance of the float32 value, or hlopass overflowed where
    the float32 value is within a factor 2 of the type's largest number, or at no more than twice as
    many entries as ``jax.jit`` overflowed where the float32 value is well inside the range (then the
    program's intermediates overflow in its type, and where is a matter of summation order: listed as
    ill-conditioned); or when ``jax.jit`` itself is farther than the tolerance from the float32 run
    where both are finite (ill-conditioned in its type, listed as such). Else what differs."""
    problems = []
    leaves = zip(*(jax.tree_util.tree_leaves(t) for t in (got, want, wide)))
    for k, (g, w, h) in enumerate(leaves):
        g, w = np.asarray(g), np.asarray(w)
        if not jnp.issubdtype(w.dtype, jnp.floating):
            continue
        g64, w64, h64 = (np.asarray(a, np.float64) for a in (g, w, h))
        same = (g64 == w64) | (np.isnan(g64) & np.isnan(w64)) | (np.isfinite(g64) & np.isfinite(w64))
        differ = ~same
        if not differ.any():
            continue
        if h64.shape != w64.shape or not np.isfinite(h64[differ]).all():
            problems.append(f"{where}[{k}]: the float32 run is not finite where they differ")
            continue
        finite_h = h64[np.isfinite(h64)]
        tol = TOLERANCE[w.dtype.name] * max(float(np.max(np.abs(finite_h))) if finite_h.size else 0.0, 1e-30)
        both = np.isfinite(w64) & np.isfinite(h64)
        if both.any() and np.abs(w64[both] - h64[both]).max() > tol:  # rounding decides in this type
            ILL_CONDITIONED.append(f"{where}[{k}]: overflow in 16 bits, and jax.jit is "
                                   f"{np.abs(w64[both] - h64[both]).max():.3g} from the float32 run where "
                                   f"finite (tolerance {tol:.3g})")
            continue
        big = float(jnp.finfo(w.dtype).max) / 2
        plain_over = differ & ~np.isfinite(w64)
        ours_over = differ & ~np.isfinite(g64) & np.isfinite(w64)
        close = ~np.isfinite(g64) | (np.abs(g64 - h64) <= tol)
        if not close[plain_over].all():
            problems.append(f"{where}[{k}]: jax.jit overflowed and hlopass is off the float32 run")
        ours_inside = int(np.sum(np.abs(h64[ours_over]) < big))
        plain_inside = int(np.sum(np.abs(h64[plain_over]) < big))   # jax.jit's own intermediates overflowed
        if ours_inside > 2 * plain_inside:
            problems.append(f"{where}[{k}]: hlopass overflowed where the float32 run is well inside the range")
        elif ours_inside:
            ILL_CONDITIONED.append(f"{where}[{k}]: 16-bit intermediates overflow: jax.jit is not finite at "
                                   f"{plain_inside} entries where the float32 run is well inside the range, "
                                   f"hlopass at {ours_inside}")
    return "; ".join(problems) or None


def _judged_overflow(batch, i, got, want, grads_got, grads_want, mine, problem) -> str | None:
    """``None`` when program ``i``'s non-finite difference from ``jax.jit`` is 16-bit overflow
    (:func:`overflowed_alike`: a sum or product whose order the rewrite changed overflows one way and
    not the other); else ``problem`` and why."""
    try:
        wide_values, wide_grads = wider_reference(batch, i)
    except Exception as err:  # noqa: BLE001 - no wider run, the difference stands
        return f"{problem} (no wider run: {type(err).__name__})"
    label = batch.programs[i].label
    verdict = overflowed_alike(got[i], want[i], wide_values, f"{label} values")
    if verdict is None and grads_got is not None:
        verdict = overflowed_alike([grads_got[j] for j in mine], [grads_want[j] for j in mine], wide_grads,
                                   f"{label} gradients")
    return None if verdict is None else f"{problem}; {verdict}"


def _culprit_pass(err: BaseException) -> str | None:
    """The pass whose code raised ``err`` (its innermost frame under ``passes/<name>/``), or None."""
    name = None
    for frame in traceback.extract_tb(err.__traceback__):
        parts = frame.filename.replace(os.sep, "/").split("/")
        if "passes" in parts[:-1]:
            k = len(parts) - 1 - parts[::-1].index("passes")
            if k + 1 < len(parts) - 1:
                name = parts[k + 1]
    return name


def _failure(batch: Batch, program: Program | None, problem: str, trace: str = "", culprit: str | None = None) -> dict:
    index = program.label.split("/")[-1] if program else None
    devices = f" --devices {DEVICES}" if batch.mode in SHARDED_MODES else ""
    repro = (f"python -m tests.fuzz.runner --seeds {batch.seed} --size {BATCH_SIZE}"
             + (f" --program {index}" if index else "") + devices + " -v")
    failure = {"batch": batch.header(), "seed": str(batch.seed), "program": repr(program) if program else None,
               "index": int(index) if index and index.isdigit() else None, "mode": batch.mode,
               "problem": problem, "pass": culprit,
               "pieces": list(program.pieces) if program else [], "reproduce": repro, "traceback": trace}
    failure["kind"] = failure_kind(failure)
    return failure


#: XLA flag the CI workers use to halve compile time; a failure seen with it is re-run without it
#: (in a child process) and counts only if it happens there too.
FAST_FLAG = "--xla_backend_optimization_level=0"


#: XLA:CPU's YNNPACK fusions off. jaxlib 0.10.2's fusion of ``exp(c * x)`` summed along a row, ``x``
#: bfloat16, gives infinities where the values are small (plain JAX written by hand shows it:
#: ``test_regressions.test_xla_cpus_ynn_fusion_of_a_bfloat16_exp_sum_is_checked_without_it``).
NO_YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type="


def recheck_with_default_flags(seed, size, only, exclusions, devices: int = 1, choices=None,
                               flags: str = "") -> set | None:
    """``(program, what)`` of the failures of batch ``seed`` under XLA's default flags (and ``flags``),
    without further rechecks; ``None`` when the recheck did not finish (died or timed out: the failures
    then stand)."""
    import subprocess
    import tempfile
    xla_flags = (os.environ.get("XLA_FLAGS", "").replace(FAST_FLAG, "") + " " + flags).strip()
    env = dict(os.environ, XLA_FLAGS=xla_flags, HLOPASS_FUZZ_RECHECK="1")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "recheck.json")
        cmd = [sys.executable, "-m", "tests.fuzz.runner", "--seeds", str(seed), "--size", str(size), "--json", out]
        cmd += ([] if only is None else ["--program", str(only)]) + ([] if exclusions else ["--no-exclusions"])
        cmd += ([] if devices == 1 else ["--devices", str(devices)])
        cmd += ([] if choices is None else ["--choices", ",".join(map(str, choices))])
        try:
            subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1200)
        except subprocess.TimeoutExpired:
            return None
        if not os.path.exists(out):
            return None
        with open(out) as fh:
            return {(f["program"], f["problem"].split(":")[0]) for f in json.load(fh)["failures"]}


def _key(failure: dict) -> tuple:
    return failure["program"], failure["problem"].split(":")[0]


def run_seeds(seeds, size: int = BATCH_SIZE, only: int | None = None, verbose: bool = False,
              exclusions: bool = True, devices: int = 1, choices: list[int] | None = None) -> dict:
    """Run the batches of ``seeds`` (see :func:`draw_batch` for the other arguments); the summary:
    programs, batches, rewrites fired, failures, the pieces and modes drawn, exclusions and the
    differences judged rounding, overflow or forward-over-reverse, seconds and CPU seconds."""
    total = {"seeds": [str(s) for s in seeds], "programs": 0, "rewrites": collections.Counter(), "failures": [],
             "excluded": collections.Counter(), "batches": 0, "seconds": 0.0, "modes": collections.Counter(),
             "fast_flag_only": [], "as_accurate": 0, "overflow": 0, "unguarded": [], "fwdrev": [],
             "pieces": collections.Counter(), "memory_limited": 0, "reference_failed": [], "as_written": [],
             "ynn_only": []}
    start = time.perf_counter()
    for seed in seeds:
        batch = draw_batch(seed, size, only, exclusions, devices=devices, choices=choices)
        for program in batch.programs:
            total["pieces"].update(set(program.pieces))
        total["memory_limited"] += len(batch.programs) if batch.memory_fraction is not None else 0
        if verbose:
            print(batch.header())
            for p in batch.programs:
                print("  ", p)
        t0 = time.perf_counter()
        with jax.enable_x64(batch.x64):
            result = check_batch(batch)
        total["batches"] += 1
        total["programs"] += result["programs"]
        total["rewrites"].update(result["rewrites"])
        total["excluded"].update(result["excluded"])
        total["as_accurate"] += result.get("as_accurate", 0)
        total["overflow"] += result.get("overflow", 0)
        total["unguarded"] += result.get("unguarded", [])
        total["fwdrev"] += result.get("fwdrev", [])
        total["as_written"] += result.get("as_written", [])
        total["reference_failed"] += result.get("reference_failed", [])
        failures = result["failures"]
        rechecking = failures and not os.environ.get("HLOPASS_FUZZ_RECHECK")
        if rechecking and FAST_FLAG in os.environ.get("XLA_FLAGS", ""):
            confirmed = recheck_with_default_flags(batch.seed, size, only, exclusions, devices, choices)
            for f in failures:
                if confirmed is None:
                    f["problem"] += " (the recheck at XLA's default flags did not finish)"
            total["fast_flag_only"] += [f for f in failures if confirmed is not None and _key(f) not in confirmed]
            failures = [f for f in failures if confirmed is None or _key(f) in confirmed]
        if rechecking and failures and jax.default_backend() == "cpu" and NO_YNN_FLAG not in os.environ.get("XLA_FLAGS", ""):
            kept = recheck_with_default_flags(batch.seed, size, only, exclusions, devices, choices, NO_YNN_FLAG)
            total["ynn_only"] += [f for f in failures if kept is not None and _key(f) not in kept]
            failures = [f for f in failures if kept is None or _key(f) in kept]
        total["failures"].extend(failures)
        total["modes"][batch.mode] += result["programs"]
        if verbose:
            print(f"  {time.perf_counter() - t0:.1f} s, rewrites {dict(result['rewrites'])}")
            for f in result["failures"]:
                print(f"  FAIL {f['program']}\n       {f['problem']}\n{f['traceback']}")
    total["seconds"] = time.perf_counter() - start
    total["ill_conditioned"] = list(ILL_CONDITIONED)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    total["cpu_seconds"] = usage.ru_utime + usage.ru_stime
    return total


def _parse_seeds(text: str) -> list[str]:
    seeds = []
    for part in text.split(","):
        if "-" in part and part.replace("-", "").isdigit():
            lo, hi = part.split("-")
            seeds.extend(str(s) for s in range(int(lo), int(hi) + 1))
        elif part:
            seeds.append(part)
    return seeds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", required=True, help="comma-separated seeds or ranges, e.g. 0-9,f123")
    parser.add_argument("--size", type=int, default=BATCH_SIZE, help="programs per batch")
    parser.add_argument("--program", type=int, default=None, help="run only this program of each batch")
    parser.add_argument("--json", default=None, help="write the summary here")
    parser.add_argument("--no-exclusions", dest="exclusions", action="store_false",
                        help="also draw the programs tests/fuzz/exclusions.py leaves out (known defects)")
    parser.add_argument("--devices", type=int, default=1,
                        help=f"run the sharded modes on this many host devices ({DEVICES}; sets XLA_FLAGS itself)")
    parser.add_argument("--choices", default=None,
                        help="replay these recorded choices as program --program (a minimised program)")
    parser.add_argument("--minimise", action="store_true",
                        help="shrink program --program of the (one) seed while it fails the same way; "
                             "print the result as JSON")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("HLOPASS_RAISE_PASS_ERRORS", "1")
    os.environ.setdefault("HLOPASS_CHECK_PASSES", "1")
    flag = f"--xla_force_host_platform_device_count={args.devices}"
    if args.devices > 1 and flag not in os.environ.get("XLA_FLAGS", ""):   # before JAX starts its backend
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    if args.devices > 1 and jax.device_count() < args.devices:
        raise SystemExit(f"--devices {args.devices}: this process has {jax.device_count()} devices; run it with "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={args.devices}")
    if args.minimise:
        if args.program is None:
            raise SystemExit("--minimise needs --program")
        found = minimise(args.seeds, args.program, args.size, args.devices, log=print if args.verbose else None)
        print(json.dumps(found))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(found, fh)
        return 0
    choices = None if args.choices is None else [int(c) for c in args.choices.split(",") if c]
    if choices is not None and args.program is None:
        raise SystemExit("--choices needs --program")
    total = run_seeds(_parse_seeds(args.seeds), args.size, args.program, args.verbose, args.exclusions,
                      args.devices, choices)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(total, fh)
    print(f"{total['programs']} programs in {total['batches']} batches, {total['seconds']:.0f} s "
          f"({total['cpu_seconds']:.0f} CPU s), {len(total['fast_flag_only'])} differences only at {FAST_FLAG}, "
          f"{len(total['ynn_only'])} only with XLA:CPU's YNN fusions, "
          f"{len(total['failures'])} failures; rewrites: {dict(total['rewrites'])}")
    return 1 if total["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
