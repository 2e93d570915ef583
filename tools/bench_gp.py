"""Gaussian-process programs at the sizes of issue 13: plain jax.jit against hlopass.jit.

    python -m tools.bench_gp [--programs a,b] [--passes default|split] [--cap 12GB] [--no-run-plain]
                             [--repeats R] [--tiny] [--json PATH]
    python -m tools.bench_gp --sgpr-scale [--n 1000000 --m 1000 --d 8 --cap 4GB]

The six programs of ``fixtures/gp.py`` (SGPR bound and gradient in float64, predictive variance,
CG, kernel class sums, kernel gather, Sinkhorn), each at the issue's size and threshold. Every
measurement runs in its own child process under an address-space cap (``ulimit -v``) and reports
the largest tensor of the lowered StableHLO (loop bodies included, loops' carried state and the
program's arguments and results aside), XLA's temp memory, compile and run time, peak RSS and a
sample of the outputs, checked against plain ``jax.jit`` (float64 programs to 1e-10 relative).
The hlopass column must keep its largest tensor within 1.5 times the threshold and XLA temp within
3 times the threshold plus twice the largest argument or result; the table says which holds.

``--sgpr-scale`` runs the original work's headline: Titsias' SGPR bound and its gradient in
float64 at n = 1,000,000, m = 1,000, d = 8 under a 4 GB address-space cap, plain jax.jit (expected
to fail) and hlopass.jit (default settings) each in its own child: time, XLA temp and peak RSS.
"""

from __future__ import annotations

import argparse
import functools

import numpy as np

from hlopass.sizes import format_size, parse_size
from tools import harness

TINY = {
    "sgpr_bound_grad": (dict(n=5_003, m=31, d=3), "1MB"),
    "predictive_variance": (dict(n_train=203, n_test=5_003), "1MB"),
    "cg": (dict(n=1_009), "1MB"),
    "class_sums": (dict(n_q=501, n_s=1_009), "1MB"),
    "gather": (dict(n_q=501, n_s=1_009), "1MB"),
    "sinkhorn": (dict(n=601, m=503), "256kB"),
}
SAMPLE = 64
FLOAT64 = {"sgpr_bound_grad"}


def program(name: str, tiny: bool):
    """``(function, inputs, threshold, float64)`` of ``name`` at the issue's (or tiny) size."""
    import jax
    from fixtures import gp
    fn, make, sizes, threshold = gp.PROGRAMS[name]
    if tiny:
        sizes, threshold = TINY[name]
    x64 = name in FLOAT64
    jax.config.update("jax_enable_x64", x64)
    return fn, make(**sizes), threshold, x64, sizes


def measure(name: str, column: str, passes: str, tiny: bool, repeats: int, run: bool = True) -> dict:
    """Lower, compile (and run) one program in this process."""
    import jax

    import hlopass
    from hlopass import stablehlo
    fn, args, threshold, _, sizes = program(name, tiny)
    result = {"program": name, "column": column, "status": "ok", "threshold": parse_size(threshold, "threshold"),
              "sizes": sizes}
    try:
        if column == "plain":
            jitted = jax.jit(fn)
        else:
            jitted = hlopass.jit(fn, threshold=threshold, **({} if passes == "default" else {"passes": passes}))
        with harness.stopwatch() as clock:
            lowered = jitted.lower(*args)
            module = lowered.compiler_ir("stablehlo")
            compiled = lowered.compile()
        result["compile_seconds"] = clock.seconds
        result["xla_temp_bytes"] = harness.temp_bytes(compiled)
        result["largest_tensor_bytes"] = stablehlo.max_tensor_bytes(module, outside_loops=False, loop_results=False)
        out_avals = jax.tree_util.tree_leaves(jax.eval_shape(fn, *args))
        result["largest_io_bytes"] = max([int(np.asarray(a).nbytes) for a in jax.tree_util.tree_leaves(args)]
                                         + [int(np.prod(a.shape)) * a.dtype.itemsize for a in out_avals])
        if column == "hlopass":
            result["rewrites"] = [str(r) for r in lowered.report.rewrites]
            result["skipped"] = [str(s) for s in lowered.report.skipped]
        if run:
            timing = harness.time_call(functools.partial(compiled, *args), repeats)
            result["median_seconds"] = timing.median if timing.wall else None
            result["sample"] = harness.sample(timing.out, SAMPLE)
    except Exception as err:  # noqa: BLE001 - running out of memory is a result
        result.update(status="failed", error=harness.short_error(err))
    return result


def bounds(row: dict) -> tuple[bool, bool]:
    """(largest tensor within 1.5x the threshold, XLA temp within 3x threshold + 2x largest argument/result)."""
    threshold, io = row["threshold"], row["largest_io_bytes"]
    largest_ok = row["largest_tensor_bytes"] <= max(1.5 * threshold, io)
    temp_ok = row["xla_temp_bytes"] <= 3 * threshold + 2 * io
    return largest_ok, temp_ok


def table(rows: list[dict]) -> str:
    by = {}
    for row in rows:
        by.setdefault(row["program"], {})[row["column"]] = row

    def cell(row):
        if row is None:
            return "-"
        if row.get("status") != "ok":
            return "OOM" if "RESOURCE_EXHAUSTED" in row.get("error", "") else f"failed: {row.get('error', '')[:60]}"
        parts = [f"largest {format_size(row['largest_tensor_bytes'])}", f"temp {format_size(row['xla_temp_bytes'])}"]
        if row.get("median_seconds") is not None:
            parts.append(f"{row['median_seconds']:.3g} s")
        return ", ".join(parts)

    lines = ["| program | threshold | plain jax.jit | hlopass | largest ≤ 1.5× threshold | temp ≤ 3× threshold + 2× I/O "
             "| max rel. diff |", "|---|---|---|---|---|---|---|"]
    for name, columns in by.items():
        plain, ours = columns.get("plain"), columns.get("hlopass")
        ok = ours is not None and ours.get("status") == "ok"
        largest_ok, temp_ok = bounds(ours) if ok else (False, False)
        diff = (harness.sample_difference(ours.get("sample"), plain.get("sample"), floor=1e-300)
                if ok and plain else None)
        threshold = format_size((ours or plain)["threshold"])
        lines.append(f"| {name} | {threshold} | {cell(plain)} | {cell(ours)} | {'yes' if largest_ok else 'NO'} "
                     f"| {'yes' if temp_ok else 'NO'} | {'-' if diff is None else f'{diff:.1e}'} |")
    return "\n".join(lines)


# -- the SGPR at the original work's scale ------------------------------------------------------------

def sgpr_scale_child(column: str, n: int, m: int, d: int) -> dict:
    import jax
    jax.config.update("jax_enable_x64", True)

    import hlopass
    from fixtures import gp
    result = {"column": column, "status": "ok", "n": n, "m": m, "d": d}
    try:
        args = gp.make_sgpr(n, m, d)
        jitted = jax.jit(gp.sgpr_value_and_grad) if column == "plain" else hlopass.jit(gp.sgpr_value_and_grad)
        lowered, compiled, result["compile_seconds"] = harness.compile_timed(jitted, args)
        result["xla_temp_bytes"] = harness.temp_bytes(compiled)
        if column == "hlopass":
            result["rewrites"] = [str(r) for r in lowered.report.rewrites]
        (value, (grad_z, grad_params)), result["run_seconds"], _ = harness.timed(functools.partial(compiled, *args))
        result["value"] = float(value)
        result["grad_params"] = np.asarray(grad_params).tolist()
        result["finite"] = bool(np.isfinite(np.asarray(grad_z)).all() and np.isfinite(float(value)))
    except Exception as err:  # noqa: BLE001
        result.update(status="failed", error=harness.short_error(err))
    return result


def sgpr_scale(n: int, m: int, d: int, cap: int) -> list[dict]:
    rows = []
    for column in harness.progress(("plain", "hlopass"), "sgpr-scale"):
        print(f"[sgpr-scale] {column}: n = {n:,}, m = {m:,}, d = {d}, float64, ulimit -v {format_size(cap)} ...",
              flush=True)
        argv = harness.module_argv("bench_gp", "--sgpr-child", column, "--n", str(n), "--m", str(m), "--d", str(d))
        row = harness.run_capped(argv, cap, timeout=6 * 3600)
        row.setdefault("column", column)
        rows.append(row)
        if row.get("status") == "ok":
            print(f"    ok: compile {row['compile_seconds']:.1f} s, run {row['run_seconds']:.1f} s, "
                  f"XLA temp {format_size(row['xla_temp_bytes'])}, peak RSS {format_size(row['peak_rss_bytes'])}, "
                  f"bound {row['value']:.6e}", flush=True)
        else:
            print(f"    {row.get('status')}: {row.get('error')}", flush=True)
    return rows


def main(argv=None) -> int:
    from fixtures import gp
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", help=f"comma-separated subset of: {', '.join(gp.PROGRAMS)}")
    parser.add_argument("--passes", default="default", help="hlopass passes: default, or e.g. split")
    parser.add_argument("--cap", default=None, help="address-space cap per child (default 12GB; 4GB with --sgpr-scale)")
    parser.add_argument("--repeats", type=int, default=1, help="timed calls after the warm-up")
    parser.add_argument("--no-run-plain", action="store_true", help="compile plain jax.jit but do not run it")
    parser.add_argument("--tiny", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--json", help="write the rows to this path")
    parser.add_argument("--sgpr-scale", action="store_true", help="the SGPR bound and gradient at n = 1,000,000")
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--m", type=int, default=1_000)
    parser.add_argument("--d", type=int, default=8)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--sgpr-child", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.sgpr_child:
        harness.report_result(sgpr_scale_child(options.sgpr_child, options.n, options.m, options.d))
        return 0
    if options.child:
        name, column, run = options.child.split(":")
        harness.report_result(measure(name, column, options.passes, options.tiny, options.repeats, run == "run"))
        return 0
    if options.sgpr_scale:
        rows = sgpr_scale(options.n, options.m, options.d, parse_size(options.cap or "4GB", "--cap"))
        harness.write_json(options.json, rows, default=str)
        plain, ours = rows
        return 0 if ours.get("status") == "ok" else 1
    names = options.programs.split(",") if options.programs else list(gp.PROGRAMS)
    cap = parse_size(options.cap or "12GB", "--cap")
    rows = []
    for name, column in harness.progress([(n, c) for n in names for c in ("plain", "hlopass")], "bench_gp"):
        run = "norun" if column == "plain" and options.no_run_plain else "run"
        print(f"[{name}] {column} ...", flush=True)
        argv = harness.module_argv("bench_gp", "--child", f"{name}:{column}:{run}", "--passes", options.passes,
                                   "--repeats", str(options.repeats), *(["--tiny"] if options.tiny else []))
        row = harness.run_capped(argv, cap, timeout=3 * 3600)
        row.setdefault("program", name)
        row.setdefault("column", column)
        rows.append(row)
        if row.get("status") == "ok":
            print(f"    largest {format_size(row['largest_tensor_bytes'])}, temp {format_size(row['xla_temp_bytes'])}"
                  f", compile {row['compile_seconds']:.1f} s"
                  + (f", run {row['median_seconds']:.2f} s" if row.get("median_seconds") is not None else "")
                  + f", peak RSS {format_size(row.get('peak_rss_bytes'))}", flush=True)
        else:
            print(f"    {row.get('status')}: {row.get('error')}", flush=True)
    print()
    print(table(rows))
    harness.write_json(options.json, harness.without(rows, "sample"), default=str)
    failed = [r for r in rows if r["column"] == "hlopass" and (r.get("status") != "ok" or not all(bounds(r)))]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
