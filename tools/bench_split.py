"""Benchmark the split pass against plain ``jax.jit`` and hand-written chunking (``lax.map``).

On sizes where plain ``jax.jit`` still fits, for each workload: the median
call time (the three called in turns) and XLA's temporary memory of

* ``jax.jit`` of the naive program,
* ``hlopass.jit(passes="split")`` of the same program,
* a hand-chunked version with ``lax.map(..., batch_size=...)`` (same chunk rows),

with the ratios hlopass / jax.jit and lax.map / jax.jit. The process caps its
own address space (``--cap``, default 8 GB) before JAX starts.

    python -m tools.bench_split                 # full sizes (about a minute)
    python -m tools.bench_split --tiny          # seconds-long smoke run
    python -m tools.bench_split --json out.json
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys

from tools import harness


def _workloads(tiny: bool):
    """name -> (naive fn, hand-chunked fn, args, threshold)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from fixtures.attention import attention
    from fixtures.kernels import kernel_matvec, sq_exp_kernel
    from fixtures.knn import knn_l2
    from fixtures.sgpr import cross_covariance, sgpr_statistics

    keys = iter(jax.random.split(jax.random.PRNGKey(0), 16))
    normal = lambda *shape: jax.random.normal(next(keys), shape, jnp.float32)  # noqa: E731
    out = {}

    n = 600 if tiny else 10_000
    rows = 100 if tiny else 1_000
    x, y, v = normal(n, 3), normal(n, 3), normal(n)
    out[f"kernel matvec n={n}"] = (
        kernel_matvec,
        lambda x, y, v: lax.map(lambda xi: sq_exp_kernel(xi[None], y)[0] @ v, x, batch_size=rows),
        (x, y, v), "40MB" if not tiny else "400kB")

    nq, npts = (200, 1_000) if tiny else (2_000, 30_000)
    q, p = normal(nq, 3), normal(npts, 3)
    out[f"knn L2 {nq}x{npts} k=10"] = (
        lambda q, p: knn_l2(q, p, 10),
        lambda q, p: lax.map(lambda qi: tuple(a[0] for a in knn_l2(qi[None], p, 10)), q, batch_size=40),
        (q, p), "16MB" if not tiny else "200kB")

    s = 256 if tiny else 2_048
    qa, ka, va = normal(1, 4, s, 32), normal(1, 4, s, 32), normal(1, 4, s, 32)

    def attention_blocks(q, k, v):
        blocks = jnp.moveaxis(q, 2, 0)  # (s, b, h, d): one query per map step, batched by lax.map
        outs = lax.map(lambda qi: attention(qi[:, :, None], k, v)[:, :, 0], blocks, batch_size=128)
        return jnp.moveaxis(outs, 0, 2)
    out[f"attention s={s}"] = (attention, attention_blocks, (qa, ka, va), "8MB" if not tiny else "200kB")

    ns = 2_000 if tiny else 100_000
    xs, zs, ys = normal(ns, 3) * 3, normal(300, 3) * 3, normal(ns)

    def sgpr_blocks(x, z, y, block=4_000 if not tiny else 400):
        xb, yb = x.reshape(-1, block, x.shape[1]), y.reshape(-1, block)

        def part(args):
            k = cross_covariance(args[0], z)
            return k.T @ k, k.T @ args[1]
        ktk, kty = lax.map(part, (xb, yb))
        return ktk.sum(0), kty.sum(0)
    out[f"sgpr KtK n={ns}"] = (sgpr_statistics, sgpr_blocks, (xs, zs, ys), "16MB" if not tiny else "200kB")
    return out


def _measure(columns: dict, args, repeats: int) -> dict[str, dict]:
    """Each column (name -> function, jitted here unless it is) compiled, then called in turns: the median
    seconds, XLA temp bytes and the result of each."""
    import jax
    compiled = {name: (fn if hasattr(fn, "lower") else jax.jit(fn)).lower(*args).compile()
                for name, fn in columns.items()}
    timings = harness.time_calls({name: functools.partial(c, *args) for name, c in compiled.items()}, repeats)
    return {name: {"seconds": timings[name].median, "temp": harness.temp_bytes(compiled[name]),
                   "result": timings[name].out} for name in columns}


def run(tiny: bool, repeats: int) -> list[dict]:
    import hlopass
    rows = []
    for name, (naive, chunked, args, threshold) in _workloads(tiny).items():
        figures = _measure({"plain": naive, "split": hlopass.jit(naive, passes="split", threshold=threshold),
                            "mapped": chunked}, args, repeats)
        plain, split, mapped = figures["plain"], figures["split"], figures["mapped"]
        rows.append({
            "workload": name, "threshold": threshold,
            "jit_s": plain["seconds"], "split_s": split["seconds"], "map_s": mapped["seconds"],
            "jit_temp": plain["temp"], "split_temp": split["temp"], "map_temp": mapped["temp"],
            "time_ratio": split["seconds"] / plain["seconds"], "map_time_ratio": mapped["seconds"] / plain["seconds"],
            # XLA:CPU reports 0 temp bytes for some plain programs (attention): no ratio then
            "mem_ratio": split["temp"] / plain["temp"] if plain["temp"] else None,
            "map_mem_ratio": mapped["temp"] / plain["temp"] if plain["temp"] else None,
            "split_err": harness.relative_difference(split["result"], plain["result"]),
            "map_err": harness.relative_difference(mapped["result"], plain["result"]),
        })
    return rows


def _ratio(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _table(rows: list[dict]) -> str:
    from hlopass.sizes import format_size
    head = ("| workload | jax.jit s | split s | split/jit | lax.map s | map/jit | jit temp | split temp | "
            "split/jit mem | lax.map temp | split err |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['jit_s']:.4f} | {r['split_s']:.4f} | {r['time_ratio']:.2f} | "
                     f"{r['map_s']:.4f} | {r['map_time_ratio']:.2f} | {format_size(r['jit_temp'])} | "
                     f"{format_size(r['split_temp'])} | {_ratio(r['mem_ratio'])} | {format_size(r['map_temp'])} | "
                     f"{r['split_err']:.1e} |")
    ratios = [r["time_ratio"] for r in rows]
    lines.append(f"\nmedian time ratio split/jax.jit: {statistics.median(ratios):.2f} "
                 f"(lax.map/jax.jit: {statistics.median(r['map_time_ratio'] for r in rows):.2f}); "
                 f"median memory ratio split/jax.jit: "
                 f"{_ratio(statistics.median(r['mem_ratio'] for r in rows if r['mem_ratio'] is not None))}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small sizes, seconds-long")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per variant (median)")
    parser.add_argument("--cap", type=float, default=8.0, help="address-space cap in GB for this process")
    args = parser.parse_args(argv)
    harness.cap_address_space(int(args.cap * 1e9))
    rows = run(args.tiny, args.repeats or (2 if args.tiny else 5))
    print(_table(rows))
    harness.write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
