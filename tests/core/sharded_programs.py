"""Sharded programs on 4 host devices, each run by hlopass and by ``jax.jit`` with the same shardings.

Run as a script in a child process (``tests/core/test_sharding.py`` sets
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` there, so the rest of the suite keeps one
device): ``python -m tests.core.sharded_programs CASE...`` prints one JSON object per case with
the largest relative differences of values and gradients, the output and gradient shardings of
both, and each one's per-device XLA figures.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

#: Settings of every case: the split keeps one iteration's largest value within SPLIT bytes per device.
THRESHOLD, SPLIT = 2_000_000, 1_000_000
N, M, D = 4 * 601, 3001, 3      # rows (601 per device: a prime), columns (prime), coordinates
#: Columns of the per-device threshold case: the (N, M_SMALL, D) difference is 7.8 MB, 1.95 MB per device.
M_SMALL = 271
#: Memory limit of the memory-limit case: over one device's footprint of the split program (0.6 MB;
#: 1.05 MB until its loops ended with a short step, whose temporaries XLA kept beside the loop's),
#: under that program's footprint compiled without the shardings (2.1 MB; 3.9 MB) and jax.jit's (7.3 MB).
LIMIT = 1_500_000


def _setup():
    import jax
    return jax


def kernel_matvec(x, y, v):
    import jax.numpy as jnp
    d2 = jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, axis=-1)
    return jnp.exp(-d2) @ v


def knn(x, y):
    import jax
    import jax.numpy as jnp
    d2 = jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, axis=-1)
    values, indices = jax.lax.top_k(-d2, 5)
    return -values, indices


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.dtype.kind not in "fc":
        return float(np.max(a != b)) if a.size else 0.0
    scale = max(float(np.max(np.abs(b))), 1e-30)
    return float(np.max(np.abs(a - b))) / scale


def _spec(array) -> str:
    sharding = getattr(array, "sharding", None)
    return str(getattr(sharding, "spec", sharding))


def _same_shardings(ours, ref) -> bool:
    return all(a.sharding.is_equivalent_to(b.sharding, a.ndim) for a, b in zip(ours, ref))


def _figures(compiled) -> dict:
    m = compiled.memory_analysis()
    return dict(temp=int(m.temp_size_in_bytes), arguments=int(m.argument_size_in_bytes),
                outputs=int(m.output_size_in_bytes))


def _compare(name, ours, ref, args, grad_of=None, hlopass_fn=None) -> dict:
    """Run ``ours`` and ``ref`` (both jitted callables) on ``args``; their gradients too."""
    import jax
    out, expected = ours(*args), ref(*args)
    leaves, ref_leaves = jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(expected)
    row = dict(case=name, value_error=max(_rel(a, b) for a, b in zip(leaves, ref_leaves)),
               value_shardings=[_spec(a) for a in leaves], ref_value_shardings=[_spec(b) for b in ref_leaves],
               same_value_shardings=_same_shardings(leaves, ref_leaves),
               hlopass=_figures(ours.lower(*args).compile()), jit=_figures(ref.lower(*args).compile()),
               split_size=SPLIT)
    if hlopass_fn is not None:
        report = hlopass_fn.trace(*args).report if hasattr(hlopass_fn, "trace") else None
        row["splits"] = None if report is None else sum(1 for r in report.rewrites if r.kind == "split")
        # the report's splits are those of the compiled program: never the sharded rows (axis 0)
        row["split_axes"] = [] if report is None else [r.details["axis"] for r in report.rewrites
                                                       if r.kind == "split"]
        row["iterations"] = [] if report is None else [r.details["iterations"] for r in report.rewrites
                                                       if r.kind == "split"]
        row["memory_checks"] = [] if report is None else [
            dict(kind=r.kind, **{k: r.details[k] for k in ("footprint", "limit")})
            for r in report.rewrites if r.kind in ("retry", "memory_check")]
    if grad_of is not None:
        grad_ours = jax.jit(jax.grad(grad_of(ours), argnums=(0, 2)))
        grad_ref = jax.jit(jax.grad(grad_of(ref), argnums=(0, 2)))
        g, gr = grad_ours(*args), grad_ref(*args)
        row.update(grad_error=max(_rel(a, b) for a, b in zip(g, gr)),
                   grad_shardings=[_spec(a) for a in g], ref_grad_shardings=[_spec(b) for b in gr],
                   same_grad_shardings=_same_shardings(g, gr),
                   grad_hlopass=_figures(grad_ours.lower(*args).compile()),
                   grad_jit=_figures(grad_ref.lower(*args).compile()))
    return row


def _inputs(jax, mesh, spec_x, dtype=None):
    from jax.sharding import NamedSharding, PartitionSpec as P
    dtype = dtype or jax.numpy.float32
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (N, D), dtype)
    y = jax.random.normal(keys[1], (M, D), dtype)
    v = jax.random.normal(keys[2], (M,), dtype)
    if spec_x is None:  # left uncommitted: jit's in_shardings place them
        return x, y, v
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    return put(x, spec_x), put(y, P()), put(v, P())


def _loss(fn):
    return lambda x, y, v: (fn(x, y, v) ** 2).sum()


def case_placed(axis_type: str = "Auto", dtype: str = "float32") -> dict:
    """Inputs placed with NamedSharding(mesh, P("x")), no shardings given to either jit."""
    jax = _setup()
    import hlopass
    from jax.sharding import AxisType, PartitionSpec as P
    mesh = jax.make_mesh((4,), ("x",), axis_types=(getattr(AxisType, axis_type),))
    args = _inputs(jax, mesh, P("x"), getattr(jax.numpy, dtype))
    ours = hlopass.jit(kernel_matvec, threshold=THRESHOLD, split_size=SPLIT)
    row = _compare(f"placed_{axis_type}_{dtype}", ours, jax.jit(kernel_matvec), args, _loss, ours)
    whole = [jax.device_put(a, jax.sharding.NamedSharding(mesh, P())) for a in args]
    checks = len(ours.memory_checks())
    row["whole_error"] = _rel(ours(*whole), jax.jit(kernel_matvec)(*whole))
    row["new_check_per_sharding"] = len(ours.memory_checks()) == checks + 1  # another layout: checked again
    explained = hlopass.explain(ours, *args)  # per-device XLA figures before and after the passes
    row["explain"] = dict(before=explained.memory_before.temp_bytes, after=explained.memory_after.temp_bytes,
                          split_axes=[r.details["axis"] for r in explained.report.rewrites if r.kind == "split"])
    return row


def case_per_device_threshold(axis_type: str = "Auto") -> dict:
    """Rows sharded 4 ways, fewer columns: the (N, M_SMALL, 3) difference is over the threshold as a
    whole array but each device's quarter is under it: not split (jax.jit's program)."""
    jax = _setup()
    import hlopass
    from jax.sharding import AxisType, PartitionSpec as P
    mesh = jax.make_mesh((4,), ("x",), axis_types=(getattr(AxisType, axis_type),))
    x, y, v = _inputs(jax, mesh, P("x"))
    y, v = y[:M_SMALL], v[:M_SMALL]
    ours = hlopass.jit(kernel_matvec, threshold=THRESHOLD, split_size=SPLIT)
    row = _compare(f"per_device_{axis_type}", ours, jax.jit(kernel_matvec), (x, y, v), _loss, ours)
    row["global_difference"] = N * M_SMALL * D * 4
    row["device_difference"] = N // 4 * M_SMALL * D * 4
    return row


def case_memory_limit(axis_type: str = "Auto") -> dict:
    """A memory limit between one device's footprint of the split program and the whole program's:
    the split pass's check compiles with the arguments' shardings (one device's figure), so it fits
    without splitting again."""
    jax = _setup()
    import hlopass
    from jax.sharding import AxisType, PartitionSpec as P
    mesh = jax.make_mesh((4,), ("x",), axis_types=(getattr(AxisType, axis_type),))
    args = _inputs(jax, mesh, P("x"))
    ours = hlopass.jit(kernel_matvec, threshold=THRESHOLD, split_size=SPLIT, memory_limit=LIMIT)
    # (gradients under an Explicit mesh with a memory limit: the remat pass compiles the backward
    # program without the mesh and fails, so that pass is skipped there; not compared here)
    grad_of = _loss if axis_type == "Auto" else None
    row = _compare(f"memory_limit_{axis_type}", ours, jax.jit(kernel_matvec), args, grad_of, ours)
    if axis_type == "Auto":  # the same split program compiled without the shardings: the whole arrays
        from hlopass import internals as jx
        new = ours.trace(*args).rewritten_jaxpr
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in new.in_avals]
        row["unsharded"] = _figures(jax.jit(jx.jaxpr_as_fun(new)).lower(*specs).compile())
    row["limit"] = LIMIT
    return row


def case_given() -> dict:
    """in_shardings / out_shardings given (an Auto mesh)."""
    jax = _setup()
    import hlopass
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))
    rows, whole = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
    kw = dict(in_shardings=(rows, whole, whole), out_shardings=rows)
    args = _inputs(jax, mesh, None)
    ours = hlopass.jit(kernel_matvec, threshold=THRESHOLD, split_size=SPLIT, **kw)
    return _compare("given", ours, jax.jit(kernel_matvec, **kw), args, _loss, ours)


def case_shard_map_inside() -> dict:
    """shard_map (with a psum) inside a hlopass function."""
    jax = _setup()
    import hlopass
    from jax.sharding import AxisType, PartitionSpec as P
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))

    def program(x, y, v):
        def body(a, b, c):
            local = kernel_matvec(a, b, c)
            return local / jax.lax.psum(local.sum(), "x")
        return jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(), P()), out_specs=P("x"))(x, y, v)

    args = _inputs(jax, mesh, P("x"))
    ours = hlopass.jit(program, threshold=THRESHOLD, split_size=SPLIT)
    return _compare("shard_map_inside", ours, jax.jit(program), args, _loss, ours)


def case_inside_shard_map() -> dict:
    """A hlopass function called inside a shard_map body (under jax.jit)."""
    jax = _setup()
    import hlopass
    from jax.sharding import AxisType, PartitionSpec as P
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))
    inner = hlopass.jit(kernel_matvec, threshold=THRESHOLD, split_size=SPLIT)

    def with_inner(fn):
        def program(x, y, v):
            body = lambda a, b, c: fn(a, b, c) * jax.lax.psum(1.0, "x")  # noqa: E731
            return jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(), P()), out_specs=P("x"))(x, y, v)
        return program

    args = _inputs(jax, mesh, P("x"))
    row = _compare("inside_shard_map", jax.jit(with_inner(inner)), jax.jit(with_inner(kernel_matvec)), args, _loss)
    local_args = [np.asarray(a)[:N // 4] if a.shape[0] == N else np.asarray(a) for a in args]
    row["splits"] = sum(1 for r in inner.trace(*local_args).report.rewrites if r.kind == "split")
    return row


def case_grad() -> dict:
    """jax.grad of a row-sharded loss, the hlopass function differentiated inside jax.jit."""
    jax = _setup()
    import hlopass
    from jax.sharding import AxisType, PartitionSpec as P
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))
    args = _inputs(jax, mesh, P("x"))
    ours = hlopass.jit(_loss(kernel_matvec), threshold=THRESHOLD, split_size=SPLIT)
    grad_ours = jax.jit(jax.grad(ours, argnums=(0, 2)))
    grad_ref = jax.jit(jax.grad(_loss(kernel_matvec), argnums=(0, 2)))
    row = _compare("grad", grad_ours, grad_ref, args)
    return row


def case_knn(axis_type: str = "Auto") -> dict:
    """k nearest neighbours (running top-k) of row-sharded queries."""
    jax = _setup()
    import hlopass
    from jax.sharding import AxisType, PartitionSpec as P
    mesh = jax.make_mesh((4,), ("x",), axis_types=(getattr(AxisType, axis_type),))
    x, y, _ = _inputs(jax, mesh, P("x"))
    ours = hlopass.jit(knn, threshold=THRESHOLD, split_size=SPLIT)
    row = _compare(f"knn_{axis_type}", ours, jax.jit(knn), (x, y), None, ours)
    (values, indices), (ref_values, _) = ours(x, y), jax.jit(knn)(x, y)
    # near-tied neighbours may come in either order: the distances at our indices must agree
    at_index = np.sum((np.asarray(x)[:, None, :] - np.asarray(y)[np.asarray(indices)]) ** 2, axis=-1)
    row["value_error"] = max(_rel(values, ref_values), _rel(at_index, ref_values))
    return row


def case_constraint() -> dict:
    """with_sharding_constraint inside a hlopass function nested in a larger jax.jit (its operands
    are computed there, not jit arguments); the inputs themselves are not placed."""
    jax = _setup()
    import hlopass
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))

    def program(x, y, v):
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("x")))
        return kernel_matvec(x, y, v)

    inner = hlopass.jit(program, threshold=THRESHOLD, split_size=SPLIT)
    nest = lambda fn: jax.jit(lambda x, y, v: fn(2.0 * x, y, v))  # noqa: E731
    args = _inputs(jax, mesh, None)
    row = _compare("constraint", nest(inner), nest(program), args, _loss)
    row["splits"] = sum(1 for r in inner.trace(*args).report.rewrites if r.kind == "split")
    return row


CASES = {
    "placed_auto": lambda: case_placed("Auto"),
    "placed_explicit": lambda: case_placed("Explicit"),
    "placed_auto_f64": lambda: case_placed("Auto", "float64"),
    "given": case_given,
    "per_device_auto": lambda: case_per_device_threshold("Auto"),
    "per_device_explicit": lambda: case_per_device_threshold("Explicit"),
    "memory_limit_auto": lambda: case_memory_limit("Auto"),
    "memory_limit_explicit": lambda: case_memory_limit("Explicit"),
    "shard_map_inside": case_shard_map_inside,
    "inside_shard_map": case_inside_shard_map,
    "grad": case_grad,
    "constraint": case_constraint,
    "knn_auto": lambda: case_knn("Auto"),
    "knn_explicit": lambda: case_knn("Explicit"),
}


def main(names) -> None:
    if any(n.endswith("f64") for n in names):
        import jax
        jax.config.update("jax_enable_x64", True)
    import jax
    assert jax.device_count() == 4, jax.devices()
    for name in names:
        print("ROW " + json.dumps(CASES[name]()), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("HLOPASS_RAISE_PASS_ERRORS", "1")
    os.environ.setdefault("HLOPASS_CHECK_PASSES", "1")
    main(sys.argv[1:] or list(CASES))
