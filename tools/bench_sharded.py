"""Sharded programs on 4 host devices: hlopass.jit against jax.jit with the same shardings.

    python -m tools.bench_sharded [--n 24000] [--m 24000] [--threshold 64MB] [--repeats 3]
                                [--tiny] [--json tools/results/sharded.json]

Kernel matvec (``exp(-|x_i - y_j|^2) @ v``) and kNN (``top_k`` of the negated squared distances,
k = 5) with the query rows placed ``NamedSharding(mesh, P("x"))`` on a 4-device mesh
(``XLA_FLAGS=--xla_force_host_platform_device_count=4``, set here before JAX starts), no shardings
given to either jit. For each: XLA's per-device temporaries, arguments and outputs, compile time,
the median run time, the output shardings of both, and the largest relative difference (kNN: the
distances, and the distances at hlopass's indices). Ratios are hlopass / jax.jit. Times on a
shared machine are noisy: both columns are measured side by side in one run, called in turns.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from hlopass.sizes import format_size, parse_size  # noqa: E402
from tools import harness  # noqa: E402

K = 5


def kernel_matvec(x, y, v):
    import jax.numpy as jnp
    d2 = jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, axis=-1)
    return jnp.exp(-d2) @ v


def knn(x, y):
    import jax
    import jax.numpy as jnp
    d2 = jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, axis=-1)
    values, indices = jax.lax.top_k(-d2, K)
    return -values, indices


def _timed(columns: dict, args, repeats: int) -> dict[str, tuple]:
    """Per column (name -> jitted): its output and figures (XLA's per-device memory, compile seconds and the
    median call, the columns called in turns)."""
    figures = {}
    for name, fn in columns.items():
        _, compiled, compile_s = harness.compile_timed(fn, args)
        figures[name] = {**harness.memory_figures(compiled), "compile_s": compile_s}
    timings = harness.time_calls({name: functools.partial(fn, *args) for name, fn in columns.items()}, repeats)
    return {name: (timings[name].out, {**figures[name], "run_s": timings[name].median}) for name in columns}


def run(n: int, m: int, d: int, threshold: int, repeats: int) -> list[dict]:
    import jax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import hlopass
    assert jax.device_count() == 4, jax.devices()
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(0)
    x = jax.device_put(rng.standard_normal((n, d)).astype(np.float32), NamedSharding(mesh, P("x")))
    y = jax.device_put(rng.standard_normal((m, d)).astype(np.float32), NamedSharding(mesh, P()))
    v = jax.device_put(rng.standard_normal(m).astype(np.float32), NamedSharding(mesh, P()))
    rows = []
    for name, fn, args in [("kernel matvec", kernel_matvec, (x, y, v)), ("kNN (k=5)", knn, (x, y))]:
        timed = _timed({"hlopass": hlopass.jit(fn, threshold=threshold), "jit": jax.jit(fn)}, args, repeats)
        (out, figures), (ref, ref_figures) = timed["hlopass"], timed["jit"]
        out, ref = jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)
        error = harness.relative_difference(out[0], ref[0])
        if name.startswith("kNN"):
            at_index = np.sum((np.asarray(x)[:, None, :] - np.asarray(y)[np.asarray(out[1])]) ** 2, axis=-1)
            error = max(error, harness.relative_difference(at_index, ref[0]))
        rows.append(dict(program=name, n=n, m=m, d=d, devices=4, threshold=threshold, hlopass=figures,
                         jit=ref_figures, relative_error=error,
                         shardings=[str(a.sharding.spec) for a in out],
                         jit_shardings=[str(a.sharding.spec) for a in ref],
                         same_shardings=all(a.sharding.is_equivalent_to(b.sharding, a.ndim)
                                            for a, b in zip(out, ref)),
                         temp_ratio=figures["temp"] / max(ref_figures["temp"], 1),
                         time_ratio=figures["run_s"] / max(ref_figures["run_s"], 1e-12)))
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| program | n x m | per-device temp: hlopass / jax.jit | run time: hlopass / jax.jit | "
             "output sharding | max rel. error |", "|---|---|---|---|---|---|"]
    for r in rows:
        h, j = r["hlopass"], r["jit"]
        lines.append(f"| {r['program']} | {r['n']:,} x {r['m']:,} | {format_size(h['temp'])} / "
                     f"{format_size(j['temp'])} ({r['temp_ratio']:.3f}x) | {h['run_s'] * 1e3:.0f} ms / "
                     f"{j['run_s'] * 1e3:.0f} ms ({r['time_ratio']:.2f}x) | {', '.join(r['shardings'])}"
                     f"{'' if r['same_shardings'] else ' (jax.jit: ' + ', '.join(r['jit_shardings']) + ')'} | "
                     f"{r['relative_error']:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=24_000)
    parser.add_argument("--m", type=int, default=24_000)
    parser.add_argument("--d", type=int, default=3)
    parser.add_argument("--threshold", default="64MB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="n = 2,404, m = 3,001 at 2 MB (a smoke run)")
    parser.add_argument("--json", default=os.path.join(harness.RESULTS, "sharded.json"))
    args = parser.parse_args(argv)
    n, m, threshold = (2_404, 3_001, parse_size("2MB", "--threshold")) if args.tiny else (args.n, args.m,
                                                                          parse_size(args.threshold, "--threshold"))
    rows = run(n, m, args.d, threshold, args.repeats)
    print(table(rows))
    harness.write_json(args.json, dict(command=" ".join(["python", "-m", "tools.bench_sharded", *(argv or sys.argv[1:])]),
                                       note="4 host devices on a shared 2-core CPU machine; temp is XLA's per-device "
                                            "figure", rows=rows), indent=1)
    ok = all(r["same_shardings"] and r["relative_error"] < 2e-5 for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
