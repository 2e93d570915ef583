"""Scaling of the kernel matrix-vector product under hlopass, up to n = 200,000 (a 160 GB dense kernel).

    python -m tools.scaling [--sizes 10000,20000,...] [--cap 4GB] [--tiny] [--out DIR]

For each n, ``hlopass.jit(kernel_matvec)`` (``fixtures/kernels.py``, naive
broadcast distance, d = 3, float32, default settings) runs in a child process
capped at ``--cap`` of address space; plain ``jax.jit`` runs too, at each n
until it first fails. Each child reports XLA's temp memory, its peak RSS, the
compile time, the time of one call, and the error against a float64
reference on sampled rows (the children of ``python -m hlopass.inspection.demo``).

Writes ``scaling.json``, ``scaling.csv`` and ``scaling.png`` (memory against
n; time against n² with a least-squares fit ``t = a·n²``, as in the seed's
Figure 2) to ``--out`` (default ``tools/results/``).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from hlopass.sizes import format_size, parse_size
from tools import harness

DEFAULT_SIZES = (10_000, 20_000, 40_000, 60_000, 100_000, 140_000, 200_000)
TINY_SIZES = (1_000, 2_000, 4_000)
DEFAULT_CAP = "4GB"


def measure(mode: str, n: int, cap_bytes: int) -> dict:
    """One run of the demo's child for ``mode`` ("plain" or "hlopass") at ``n``."""
    result = harness.run_capped(["-m", "hlopass.inspection.demo", "--child", mode, "--n", str(n)], cap_bytes,
                                timeout=1800)
    return {"mode": mode, "n": n, "dense_kernel_bytes": n * n * 4, **result}


def run(sizes, cap_bytes: int, echo=print) -> list[dict]:
    """hlopass at every size; plain jax.jit at every size until its first failure."""
    rows, plain_failed = [], False
    for n, mode in harness.progress([(n, mode) for n in sizes for mode in ("plain", "hlopass")], "scaling"):
        if mode == "plain" and plain_failed:
            continue
        echo(f"  n = {n:,} ({format_size(n * n * 4)} dense kernel), {mode} ...")
        row = measure(mode, n, cap_bytes)
        rows.append(row)
        echo(f"    {describe(row)}")
        plain_failed |= mode == "plain" and row["status"] != "ok"
    return rows


def describe(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['status']}: {row.get('error', '')}"
    return (f"ok, {row['run_seconds']:.2f} s (compile {row['compile_seconds']:.2f} s), "
            f"temp {format_size(row['xla_temp_bytes'])}, peak RSS {format_size(row['peak_rss_bytes'])}, "
            f"error vs float64 {row['error_vs_float64']:.1e}")


def fit_quadratic(rows: list[dict]) -> tuple[float, float] | None:
    """Least-squares ``t = a·n²`` over the successful hlopass runs: ``(a, R²)``."""
    ok = [r for r in rows if r["mode"] == "hlopass" and r["status"] == "ok"]
    if len(ok) < 2:
        return None
    n2 = np.array([float(r["n"]) ** 2 for r in ok])
    t = np.array([r["run_seconds"] for r in ok])
    a = float(n2 @ t / (n2 @ n2))
    residual = float(np.sum((t - a * n2) ** 2))
    total = float(np.sum((t - t.mean()) ** 2)) or 1.0
    return a, 1.0 - residual / total


def plot(rows: list[dict], path: str, cap_bytes: int) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, (memory_axis, time_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    sizes = sorted({r["n"] for r in rows})
    memory_axis.plot(sizes, [n * n * 4 for n in sizes], "k:", label="dense kernel n²·4 B")
    for mode, color in (("plain", "#c0392b"), ("hlopass", "#2471a3")):
        ok = [r for r in rows if r["mode"] == mode and r["status"] == "ok"]
        failed = [r for r in rows if r["mode"] == mode and r["status"] != "ok"]
        name = "plain jax.jit" if mode == "plain" else "hlopass.jit"
        if ok:
            memory_axis.plot([r["n"] for r in ok], [r["xla_temp_bytes"] for r in ok], "o-", color=color,
                             label=f"{name}: XLA temp")
            memory_axis.plot([r["n"] for r in ok], [r["peak_rss_bytes"] for r in ok], "s--", color=color, alpha=0.6,
                             label=f"{name}: peak RSS")
            time_axis.plot([float(r["n"]) ** 2 for r in ok], [r["run_seconds"] for r in ok], "o-", color=color,
                           label=name)
        for r in failed:
            memory_axis.axvline(r["n"], color=color, alpha=0.4)
            memory_axis.annotate(f"{name} fails\n(n = {r['n']:,})", xy=(r["n"], cap_bytes), fontsize=7, color=color)
    memory_axis.axhline(cap_bytes, color="grey", linestyle="--", linewidth=1, label=f"cap {format_size(cap_bytes)}")
    memory_axis.set_yscale("log")
    memory_axis.set_xlabel("n")
    memory_axis.set_ylabel("bytes")
    memory_axis.set_title("memory")
    memory_axis.legend(fontsize=7)
    fit = fit_quadratic(rows)
    if fit:
        a, r2 = fit
        xs = np.linspace(0, max(float(n) ** 2 for n in sizes), 50)
        time_axis.plot(xs, a * xs, "k:", label=f"fit t = {a:.2e}·n² (R² = {r2:.3f})")
    time_axis.set_xlabel("n²")
    time_axis.set_ylabel("seconds per call")
    time_axis.set_title("time against n²")
    time_axis.legend(fontsize=7)
    for axis in (memory_axis, time_axis):
        axis.grid(alpha=0.3)
    figure.suptitle("kernel mat-vec exp(-|x_i - y_j|²/2) @ v, naive broadcast distance, d = 3, float32")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def write(rows: list[dict], out_dir: str, cap_bytes: int) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    fit = fit_quadratic(rows)
    paths = [os.path.join(out_dir, name) for name in ("scaling.json", "scaling.csv")]
    harness.write_json(paths[0], {"cap_bytes": cap_bytes, "fit": fit, "rows": rows}, default=str)
    harness.write_csv(paths[1], rows, ["mode", "n", "status", "xla_temp_bytes", "peak_rss_bytes", "compile_seconds",
                                       "run_seconds", "error_vs_float64", "error"])
    picture = plot(rows, os.path.join(out_dir, "scaling.png"), cap_bytes)
    return paths + ([picture] if picture else [])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", help="comma-separated n values (default: 10k ... 200k)")
    parser.add_argument("--tiny", action="store_true", help=f"sizes {TINY_SIZES} (seconds)")
    parser.add_argument("--cap", default=DEFAULT_CAP, help=f"address-space cap per child (default {DEFAULT_CAP})")
    parser.add_argument("--out", default=harness.RESULTS)
    options = parser.parse_args(argv)
    sizes = ([int(s) for s in options.sizes.split(",")] if options.sizes
             else list(TINY_SIZES if options.tiny else DEFAULT_SIZES))
    cap_bytes = parse_size(options.cap, "--cap")
    print(f"kernel mat-vec scaling: n in {sizes}, each run in a child capped at {format_size(cap_bytes)}", flush=True)
    rows = run(sizes, cap_bytes, echo=lambda line: print(line, flush=True))
    written = write(rows, options.out, cap_bytes)
    fit = fit_quadratic(rows)
    print()
    lines = []
    for n in sizes:
        plain = next((r for r in rows if r["n"] == n and r["mode"] == "plain"), None)
        ours = next(r for r in rows if r["n"] == n and r["mode"] == "hlopass")
        plain_cell = "not run" if plain is None else (f"{plain['run_seconds']:.2f} s" if plain["status"] == "ok"
                                                      else "OOM" if "RESOURCE" in plain.get("error", "") else plain["status"])
        lines.append([f"{n:,}", format_size(n * n * 4), plain_cell] + (
            [f"{ours['run_seconds']:.2f} s", format_size(ours['xla_temp_bytes']), format_size(ours['peak_rss_bytes']),
             f"{ours['error_vs_float64']:.1e}"] if ours["status"] == "ok" else [ours["status"], "-", "-", "-"]))
    print(harness.markdown_table(["n", "dense kernel", "plain jax.jit", "hlopass time", "hlopass XLA temp",
                                  "hlopass peak RSS", "error vs float64"], lines))
    if fit:
        print(f"\nfit: t = {fit[0]:.3e} s · n²  (R² = {fit[1]:.4f})")
    print("written: " + ", ".join(written))
    return 0 if all(r["status"] == "ok" for r in rows if r["mode"] == "hlopass") else 1


if __name__ == "__main__":
    sys.exit(main())
