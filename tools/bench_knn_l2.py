"""Benchmark: k-nearest neighbours with the naive squared L2 distance (issue 4).

Compares, on the same inputs, in separate child processes (each under an
address-space cap, ``--memory-cap``):

* ``jax.jit``      of ``fixtures.knn.knn_l2`` (the naive broadcast form),
* ``hlopass.jit``  of the same function with the ``algebraic`` pass,
* ``jax.jit``      of ``fixtures.knn.knn_l2_expanded`` (written by hand).

For each it reports compile time, run time (median of ``--repeat`` runs after
a warm-up), the largest tensor in the lowered StableHLO (what the program
asks for), XLA's temporary-buffer estimate (``memory_analysis()``, what the
compiler allocates after fusion) and the child's peak resident memory, plus
how many queries get the same k neighbours as the hlopass run.

    python -m tools.bench_knn_l2                # 10,000 queries x 100,000 points, d = 100
    python -m tools.bench_knn_l2 --tiny         # seconds-long smoke run
    python -m tools.bench_knn_l2 --json out.json
    python -m tools.bench_knn_l2 --accuracy     # error of the rewrite vs the naive form
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile

from tools import harness

VARIANTS = ("jax.jit naive", "hlopass.jit naive", "jax.jit expanded")
FULL = dict(queries=10_000, points=100_000, dim=100, k=10)
TINY = dict(queries=64, points=1_000, dim=16, k=5)


# -- the child: one variant -----------------------------------------------------------------------

def run_variant(variant: str, queries: int, points: int, dim: int, k: int, repeat: int, threshold: str,
                indices_path: str) -> dict:
    """Compile and time one variant in this process; returns its measurements."""
    import jax
    import numpy as np

    import hlopass
    from fixtures.knn import knn_l2, knn_l2_expanded
    from hlopass.stablehlo import max_tensor_bytes

    rng = np.random.default_rng(0)
    q = jax.device_put(rng.standard_normal((queries, dim), dtype=np.float32))
    p = jax.device_put(rng.standard_normal((points, dim), dtype=np.float32))
    if variant == "hlopass.jit naive":
        fun = hlopass.jit(knn_l2, passes="algebraic", threshold=threshold, static_argnums=2)
    else:
        fun = jax.jit(knn_l2 if variant == "jax.jit naive" else knn_l2_expanded, static_argnums=2)

    result = {"variant": variant}
    with harness.stopwatch() as clock:
        lowered = fun.lower(q, p, k)
        result["stablehlo_max_bytes"] = max_tensor_bytes(lowered.compiler_ir("stablehlo"))
        if variant == "hlopass.jit naive":
            result["rewrites"] = [r.kind for r in lowered.report.rewrites]
        compiled = lowered.compile()
    result["compile_s"] = clock.seconds
    result["xla_temp_bytes"] = harness.temp_bytes(compiled) or 0
    timing = harness.time_call(functools.partial(compiled, q, p), repeat)  # after a warm-up call
    result["run_s"] = timing.median
    np.save(indices_path, np.asarray(timing.out[1]))
    return result  # the peak RSS is added by harness.report_result


# -- accuracy of the expanded form ----------------------------------------------------------------

def accuracy(queries: int = 500, points: int = 2000, dim: int = 100, offsets=(0.0, 10.0)) -> list[dict]:
    """Error of the rewritten distance against the naive one, in float32 and float64.

    Data: standard normal points shifted by ``offset`` (a shift makes the
    expanded form cancel more). Errors are relative: the largest error over
    the largest naive distance, and the median of per-entry relative errors.
    """
    import jax
    import numpy as np

    import hlopass
    from fixtures.knn import pairwise_sq_l2

    rows = []
    rng = np.random.default_rng(0)
    for offset in offsets:
        q64 = rng.standard_normal((queries, dim)) + offset
        p64 = rng.standard_normal((points, dim)) + offset
        exact = ((q64[:, None, :] - p64[None]) ** 2).sum(-1)
        for dtype in ("float32", "float64"):
            with jax.enable_x64(dtype == "float64"):
                q, p = jax.numpy.asarray(q64, dtype), jax.numpy.asarray(p64, dtype)
                naive = np.asarray(jax.jit(pairwise_sq_l2)(q, p), np.float64)
                rewritten_fn = hlopass.jit(pairwise_sq_l2, passes="algebraic", threshold="off")
                assert [r.kind for r in rewritten_fn.trace(q, p).report.rewrites] == ["squared_distance"]
                rewritten = np.asarray(rewritten_fn(q, p), np.float64)
            diff = np.abs(rewritten - naive)
            rows.append({"dtype": dtype, "offset": offset,
                         "max_error_over_max_distance": float(diff.max() / naive.max()),
                         "median_relative_error": float(np.median(diff / np.maximum(naive, 1e-300))),
                         "naive_vs_exact_median_relative_error": float(np.median(np.abs(naive - exact) / exact)),
                         "min_rewritten": float(rewritten.min())})
    return rows


def format_accuracy(rows: list[dict]) -> str:
    header = f"{'dtype':<9}{'offset':>7}{'max err / max dist':>20}{'median rel err':>16}{'naive vs exact':>16}"
    lines = [f"{r['dtype']:<9}{r['offset']:>7.1f}{r['max_error_over_max_distance']:>20.2e}"
             f"{r['median_relative_error']:>16.2e}{r['naive_vs_exact_median_relative_error']:>16.2e}" for r in rows]
    lines.append("(rewritten vs naive in the same dtype; 'naive vs exact': the naive form's own error, for scale)")
    return harness.text_table(header, lines)


# -- the parent: every variant in a capped child --------------------------------------------------

def measure(variant: str, sizes: dict, repeat: int, threshold: str, cap: int, timeout: float, workdir: str) -> dict:
    """Run ``variant`` in a child process under the memory cap; failures become a ``status``."""
    indices_path = os.path.join(workdir, variant.replace(" ", "_").replace(".", "_") + ".npy")
    argv = harness.module_argv("bench_knn_l2", "--worker", variant, "--repeat", str(repeat), "--threshold", threshold,
                               "--indices", indices_path,
                               *[arg for key, value in sizes.items() for arg in (f"--{key}", str(value))])
    result = harness.run_capped(argv, cap, timeout=timeout, platforms=None, keep=("peak_rss_bytes",))
    if result.get("status") == "timeout":
        return {"variant": variant, "status": f"timed out after {timeout:.0f} s"}
    if result.get("status") == "crashed":
        error = result.get("error", "")
        status = "out of memory" if "RESOURCE_EXHAUSTED" in error or "MemoryError" in error \
            or "bad_alloc" in error else f"failed: {error.split(' | ')[-1][:120]}"
        return {"variant": variant, "status": status}
    result["status"] = "ok"
    result["indices_path"] = indices_path
    return result


def agreement(results: list[dict], reference: str = "hlopass.jit naive") -> None:
    """Fraction of queries whose k neighbours (as a set) equal the reference run's."""
    import numpy as np
    ref = next((r for r in results if r["variant"] == reference and r["status"] == "ok"), None)
    if ref is None:
        return
    ref_idx = np.sort(np.load(ref["indices_path"]), axis=-1)
    for r in results:
        if r["status"] == "ok":
            idx = np.sort(np.load(r["indices_path"]), axis=-1)
            r["same_neighbours"] = float(np.mean(np.all(idx == ref_idx, axis=-1)))


def format_table(results: list[dict]) -> str:
    from hlopass.sizes import format_size
    base = next((r for r in results if r["variant"] == "jax.jit naive" and r["status"] == "ok"), None)
    expanded = next((r for r in results if r["variant"] == "jax.jit expanded" and r["status"] == "ok"), None)
    header = (f"{'variant':<20}{'status':<16}{'compile s':>10}{'run s':>10}{'vs naive':>10}{'vs expanded':>12}"
              f"{'StableHLO max':>15}{'XLA temp':>12}{'peak RSS':>12}{'same kNN':>10}")
    rows = []
    for r in results:
        if r["status"] != "ok":
            rows.append(f"{r['variant']:<20}{r['status']:<16}")
            continue
        vs_naive = f"{base['run_s'] / r['run_s']:.2f}x" if base else "-"
        vs_expanded = f"{expanded['run_s'] / r['run_s']:.2f}x" if expanded else "-"
        rows.append(f"{r['variant']:<20}{'ok':<16}{r['compile_s']:>10.2f}{r['run_s']:>10.3f}{vs_naive:>10}"
                    f"{vs_expanded:>12}{format_size(r['stablehlo_max_bytes']):>15}"
                    f"{format_size(r['xla_temp_bytes']):>12}{format_size(r['peak_rss_bytes']):>12}"
                    f"{r.get('same_neighbours', float('nan')):>10.4f}")
    rows.append("(vs naive / vs expanded: speed-up, higher is faster; same kNN: fraction of queries whose "
                "neighbour sets equal the hlopass run's)")
    return harness.text_table(header, rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="seconds-long smoke run")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--queries", type=int)
    parser.add_argument("--points", type=int)
    parser.add_argument("--dim", type=int)
    parser.add_argument("--k", type=int)
    parser.add_argument("--repeat", type=int, default=None, help="timed runs per variant (default 3, 1 at full size)")
    parser.add_argument("--threshold", default="1MB", help="hlopass size threshold (default 1MB)")
    parser.add_argument("--memory-cap", default="12GiB", help="address-space cap of each child (default 12GiB)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per variant")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS))
    parser.add_argument("--accuracy", action="store_true",
                        help="measure the rewritten distance's error against the naive one instead (float32, float64)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--indices", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    sizes = dict(TINY if args.tiny else FULL)
    for key in sizes:
        if getattr(args, key) is not None:
            sizes[key] = getattr(args, key)
    repeat = args.repeat if args.repeat is not None else (1 if sizes == FULL else 3)

    if args.accuracy:
        rows = accuracy(**({"queries": 50, "points": 200, "dim": 16} if args.tiny else {}))
        print(format_accuracy(rows))
        harness.write_json(args.json, {"accuracy": rows})
        return 0

    if args.worker:
        harness.report_result(run_variant(args.worker, repeat=repeat, threshold=args.threshold,
                                          indices_path=args.indices, **sizes))
        return 0

    from hlopass.sizes import parse_size
    cap = parse_size(args.memory_cap, "--memory-cap")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    print(f"kNN, squared L2: {sizes['queries']} queries x {sizes['points']} points, d = {sizes['dim']}, "
          f"k = {sizes['k']}, float32; naive n x m x d tensor = "
          f"{sizes['queries'] * sizes['points'] * sizes['dim'] * 4 / 1e9:.3g} GB; child memory cap {args.memory_cap}")
    with tempfile.TemporaryDirectory() as workdir:
        results = []
        for variant in harness.progress(variants, "bench_knn_l2"):
            results.append(measure(variant, sizes, repeat, args.threshold, cap, args.timeout, workdir))
            print(f"  {variant}: {results[-1]['status']}", flush=True)
        agreement(results)
        for r in results:
            r.pop("indices_path", None)
    print(format_table(results))
    harness.write_json(args.json, {"sizes": sizes, "repeat": repeat, "threshold": args.threshold,
                                   "memory_cap": args.memory_cap, "results": results})
    return 0 if all(r["status"] == "ok" for r in results if r["variant"] != "jax.jit naive") else 1


if __name__ == "__main__":
    sys.exit(main())
