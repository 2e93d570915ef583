"""Cases for the sharded adjoint scan, run on 4 host devices in a child process
(``XLA_FLAGS=--xla_force_host_platform_device_count=4``): ``python -m tests.passes.adjoint.sharded_cases NAME...``
prints one ``ROW {json}`` line per case."""

from __future__ import annotations

import contextlib
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import hlopass
from hlopass.jaxpr_utils import iter_eqns
from hlopass.passes.adjoint import AdjointPass
from hlopass.sharding import type_axis

from tests.passes.adjoint import models
from tests.passes.adjoint.test_adjoint import problem


def _rel(got, want) -> float:
    return max(float(np.max(np.abs(np.asarray(g) - np.asarray(w)))) / max(float(np.max(np.abs(np.asarray(w)))), 1e-30)
               for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)))


def _report(f, *args):
    report = f.trace(*args).report
    return ([str(r) for r in report.rewrites], [str(s) for s in report.skipped])


def layer_case(name: str, T: int, dtype: str) -> dict:
    mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.enable_x64(dtype == "float64") if dtype == "float64" else contextlib.nullcontext():
        layer, params, h0, xs = problem(name, T, dtype)
        loss = models.loss_of(layer)
        grad = jax.grad(loss, (0, 1, 2))
        want = jax.jit(grad)(params, h0, xs)
        xs_s = xs if T % 4 else jax.device_put(xs, NamedSharding(mesh, P("x")))
        f = hlopass.jit(grad, passes=[AdjointPass(sequence_axis="x", mesh=mesh)])
        got = f(params, h0, xs_s)
        rewrites, skips = _report(f, params, h0, xs_s)
        return dict(error=_rel(got, want), rewrites=rewrites, skips=skips)


def lm_case() -> dict:
    mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.enable_x64(True):
        params, emb = models.lm_params(jax.random.key(0), 3, 6, 3, 11, "float64")
        tokens = jax.random.randint(jax.random.key(1), (65,), 0, 11)
        grad = jax.grad(models.lm_stack, (0, 1))
        want = jax.jit(grad)(params, emb, tokens)
        f = hlopass.jit(grad, passes=[AdjointPass(sequence_axis="x", mesh=mesh)])
        got = f(params, emb, tokens)
        rewrites, skips = _report(f, params, emb, tokens)
    return dict(error=_rel(got, want), rewrites=rewrites, skips=skips)


def rows_after_loss(params, h0s, xs):
    """Stacked layers whose rows are also read after the region (a cumulative sum over time mixes
    rows), with a maximum over time, final states and the sum ending the region."""
    ys, total = xs, 0.0
    for p, h0 in zip(params, h0s):
        h, ys = models.diagonal(p, h0, ys)
        ys = jnp.tanh(ys) + xs
        total = total + jnp.sum(h)
    return jnp.sum(jnp.cumsum(ys, 0)[::7] ** 2) + jnp.max(ys) + 0.1 * total + jnp.mean(ys ** 2)


def stacked_case(loss, T: int, chunk: int | None = None, levels: int | None = None) -> dict:
    """Three stacked diagonal layers (float64), time axis over 4 devices: gradients of every input
    (``chunk``: K within a device's rows, a last partial chunk where it does not divide them;
    ``levels``: the option)."""
    mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.enable_x64(True):
        k = jax.random.split(jax.random.key(2), 10)
        P_, N = 5, 3
        params = [tuple(0.3 * jax.random.normal(k[3 * i + j], (P_, N), "float64") for j in range(3))
                  for i in range(3)]
        h0s = [0.1 * jax.random.normal(k[9], (N, P_), "float64") for _ in range(3)]
        xs = jax.random.normal(k[0], (T, P_), "float64")
        grad = jax.grad(loss, (0, 1, 2))
        want = jax.jit(grad)(params, h0s, xs)
        f = hlopass.jit(grad, passes=[AdjointPass(sequence_axis="x", mesh=mesh, chunk=chunk, levels=levels)])
        got = f(params, h0s, xs)
        rewrites, skips = _report(f, params, h0s, xs)
    return dict(error=_rel(got, want), rewrites=rewrites, skips=skips)


def no_inputs_case(T: int = 36) -> dict:
    """A recurrence that reads nothing per step: a region with no sources, its rows made per device."""
    mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.enable_x64(True):
        loss, args = models.free_running(T)
        grad = jax.grad(loss, (0, 1, 2, 3))
        want = jax.jit(grad)(*args)
        f = hlopass.jit(grad, passes=[AdjointPass(sequence_axis="x", mesh=mesh)])
        got = f(*args)
        rewrites, skips = _report(f, *args)
    return dict(error=_rel(got, want), rewrites=rewrites, skips=skips)


def explicit_case(T: int = 36) -> dict:
    """Under an ``Explicit`` mesh (``jax.set_mesh``): a region (stacked layers) and a scan alone (its
    rows read by a cumulative sum, which needs them unsharded along time, as they were)."""
    mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))

    def lone(params, h0, xs):
        h, ys = models.diagonal(params, h0, xs)
        return jnp.sum(jnp.cumsum(ys, 0) ** 2) + jnp.sum(h)
    errors, rewrites = [], []
    with jax.enable_x64(True), jax.set_mesh(mesh):
        k = jax.random.split(jax.random.key(3), 4)
        params = tuple(0.3 * jax.random.normal(k[j], (5, 3), "float64") for j in range(3))
        h0, xs = 0.1 * jax.random.normal(k[3], (3, 5), "float64"), jax.random.normal(k[0], (T, 5), "float64")
        for loss, args in ((lone, (params, h0, xs)), (models.stacked_loss, ([params] * 2, [h0] * 2, xs))):
            grad = jax.grad(loss, (0, 1, 2))
            f = hlopass.jit(grad, passes=[AdjointPass(sequence_axis="x")])
            errors.append(_rel(f(*args), jax.jit(grad)(*args)))
            rewrites += _report(f, *args)[0]
    return dict(error=max(errors), rewrites=rewrites, skips=[])


def detected_case(T: int = 36) -> dict:
    """No ``sequence_axis`` given: under an ``Explicit`` mesh the time axis of the inputs is cut along
    ``"x"`` in their types, made whole for ``lax.scan`` (``reshard(xs, P())``, as JAX asks), and the
    pass shards along it (a region of stacked layers, a scan alone), reading the sharded values."""
    mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))

    def lone(params, h0, xs):
        h, ys = models.diagonal(params, h0, jax.sharding.reshard(xs, P()))
        return jnp.sum(ys ** 2) + jnp.sum(h)

    def stacked(params, h0s, xs):
        return models.stacked_loss(params, h0s, jax.sharding.reshard(xs, P()))
    errors, rewrites = [], []
    with jax.enable_x64(True), jax.set_mesh(mesh):
        k = jax.random.split(jax.random.key(4), 4)
        params = tuple(0.3 * jax.random.normal(k[j], (5, 3), "float64") for j in range(3))
        h0 = 0.1 * jax.random.normal(k[3], (3, 5), "float64")
        xs = jax.device_put(jax.random.normal(k[0], (T, 5), "float64"), P("x", None))
        gathers = []   # reshards that make a T-row value whole, in the plain and in the rewritten program
        for loss, args in ((lone, (params, h0, xs)), (stacked, ([params] * 2, [h0] * 2, xs))):
            grad = jax.grad(loss, (0, 1, 2))
            f = hlopass.jit(grad)
            errors.append(_rel(f(*args), jax.jit(grad)(*args)))
            rewrites += _report(f, *args)[0]
            gathers.append([sum(e.primitive.name == "reshard" and e.outvars[0].aval.shape[:1] == (T,)
                                and type_axis(e.outvars[0].aval, 0) is None for e in iter_eqns(closed.jaxpr))
                            for closed in (jax.make_jaxpr(grad)(*args), f.trace(*args).rewritten_jaxpr)])
    return dict(error=max(errors), rewrites=rewrites, skips=[], gathers=gathers)


def lm_memory_case(T: int = 8192) -> dict:
    """The benchmark's language model (4 layers, width 256, state 16): per-device temp, compiled only."""
    from tools.bench_adjoint import init, make_loss
    mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    params, emb = init(jax.random.key(0), 4, 256, 16)
    tokens = jax.random.randint(jax.random.key(1), (T + 1,), 0, 64)
    grad = jax.grad(make_loss(), (0, 1))
    row = {}
    for name, fn in (("one_device", hlopass.jit(grad, passes="adjoint")),
                     ("sharded", hlopass.jit(grad, passes=[AdjointPass(sequence_axis="x", mesh=mesh)])),
                     ("sharded_two_levels",
                      hlopass.jit(grad, passes=[AdjointPass(sequence_axis="x", mesh=mesh, levels=2)]))):
        row[f"temp_{name}"] = int(fn.lower(params, emb, tokens).compile().memory_analysis().temp_size_in_bytes)
    return row


def memory_case(T: int = 8192, repeat: int = 2) -> dict:
    """One wide diagonal layer: per-device temp and time, sharded over 4 devices vs one device."""
    mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    k = jax.random.split(jax.random.key(0), 4)
    P_, N = 64, 16
    params = tuple(0.2 * jax.random.normal(k[i], (P_, N)) for i in range(3))
    h0, xs = jnp.zeros((N, P_)), jax.random.normal(k[3], (T, P_))
    grad = jax.grad(models.loss_of(models.diagonal), (0, 1, 2))
    row = {}
    columns = {"plain": (jax.jit(grad), xs), "one_device": (hlopass.jit(grad, passes="adjoint"), xs)}
    xs_s = jax.device_put(xs, NamedSharding(mesh, P("x")))
    columns["sharded"] = (hlopass.jit(grad, passes=[AdjointPass(sequence_axis="x", mesh=mesh)]), xs_s)
    outs = {}
    if True:
        for name, (fn, x) in columns.items():
            compiled = fn.lower(params, h0, x).compile()
            row[f"temp_{name}"] = int(compiled.memory_analysis().temp_size_in_bytes)
            outs[name] = jax.block_until_ready(compiled(params, h0, x))
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                jax.block_until_ready(compiled(params, h0, x))
                times.append(time.perf_counter() - t0)
            row[f"seconds_{name}"] = min(times)
            if name == "sharded":
                row["all_reduces"] = compiled.as_text().count("all-reduce(")
    row["error"] = _rel(outs["sharded"], outs["plain"])
    return row


CASES = {
    "diagonal_f32": lambda: layer_case("diagonal", 64, "float32"),
    "diagonal_f64": lambda: layer_case("diagonal", 92, "float64"),
    "complex_f32": lambda: layer_case("complex", 64, "float32"),
    "dense_f32": lambda: layer_case("dense_shared", 64, "float32"),
    "indivisible": lambda: layer_case("diagonal", 30, "float32"),
    "lm_f64": lm_case,
    "memory": memory_case,
    "stacked_f64": lambda: stacked_case(models.stacked_loss, 92),
    "rows_after_f64": lambda: stacked_case(rows_after_loss, 60),
    "tail_f64": lambda: stacked_case(rows_after_loss, 44, chunk=4),   # 11 rows per device: 4 + 4 + 3
    # 23 rows per device: 11 chunks of 2 (3 groups of 3, 2 chunks left over) and a last row
    "two_levels_f64": lambda: stacked_case(rows_after_loss, 92, chunk=2, levels=2),
    "lm_memory": lm_memory_case,
    "no_inputs_f64": no_inputs_case,
    "explicit_f64": explicit_case,
    "detected_f64": detected_case,
}

if __name__ == "__main__":
    assert len(jax.devices()) == 4, jax.devices()
    for name in sys.argv[1:]:
        print("ROW " + json.dumps(CASES[name]()), flush=True)
