"""Never worse than plain: a program no pass can bound, plain ``jax.jit`` and ``hlopass.jit`` side by side.

    python -m tools.bench_never_worse [--n 3000] [--threshold 32MB] [--tiny] [--json PATH]

Writes its figures to ``tools/results/never_worse.json`` (``--json`` elsewhere; a ``--tiny`` run
writes only where ``--json`` says).

The exact GP negative log marginal likelihood and its gradient (``fixtures/exact_gp.py``: the
Cholesky factor of an n x n float64 kernel, which no split can bound), three ways:

- ``hlopass.jit(jax.value_and_grad(f))``: the checked call compiles the rewritten program and, as the
  passes could not bound it, the original too, and keeps the better by XLA's figures;
- ``jax.jit(jax.value_and_grad(hlopass.jit(f)))``: the same decision made in the lowering rule (each
  program compiled alone), for the forward and the backward program;
- eager ``jax.value_and_grad(hlopass.jit(f))``: forward and backward programs compiled separately.

For each: XLA temp memory of what runs, first-call time (trace, passes, compiles, run), the compile
time of the program kept, and the steady run time (best of five); plain ``jax.jit`` of the same
code next to it, each on a fresh function object. The machine is shared: compare ratios in one run.
"""

from __future__ import annotations

import argparse
import os

import jax

jax.config.update("jax_enable_x64", True)

import hlopass  # noqa: E402
from fixtures import exact_gp  # noqa: E402
from hlopass.sizes import format_size  # noqa: E402
from tools import harness  # noqa: E402

RESULTS = os.path.join(harness.RESULTS, "never_worse.json")


def timed(fn):
    """``(output, seconds)`` of one call."""
    out, seconds, _ = harness.timed(fn)
    return out, seconds


def steady(fn, repeat: int = 5) -> float:
    """The best of ``repeat`` calls (no separate warm-up)."""
    return harness.time_call(fn, repeat, warmup=False).best


def temp_of(jitted, args) -> tuple[int, float]:
    """XLA temp bytes and compile seconds of ``jitted`` at ``args`` (compiled ahead of time)."""
    _, compiled, seconds = harness.compile_timed(jitted, args)
    return harness.temp_bytes(compiled), seconds


def plain_row(make, args) -> dict:
    fun = make()
    temp, compile_s = temp_of(jax.jit(make()), args)  # a fresh function object: nothing cached
    _, first = timed(lambda: fun(*args))
    return {"temp": temp, "compile_s": compile_s, "first_call_s": first, "run_s": steady(lambda: fun(*args))}


def comparison_of(reports) -> list[dict]:
    return [{"program": r.label, "kept": r.comparison.kept, "rewritten_bytes": r.comparison.rewritten_bytes,
             "original_bytes": r.comparison.original_bytes, "rewritten_compile_s": r.comparison.rewritten_compile_s,
             "original_compile_s": r.comparison.original_compile_s} for r in reports if r.comparison is not None]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--threshold", default="32MB")
    parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (n = 200)")
    parser.add_argument("--json", help="write the figures here (default: tools/results/never_worse.json, "
                        "none for --tiny)")
    options = parser.parse_args(argv)
    n = 200 if options.tiny else options.n
    threshold = "64kB" if options.tiny else options.threshold
    args = exact_gp.inputs(n)
    f = exact_gp.negative_log_likelihood
    rows = {}

    # 1. hlopass.jit of the whole value-and-gradient
    vg = jax.value_and_grad(f)
    rows["plain jax.jit(value_and_grad(f))"] = plain_row(lambda: jax.jit(lambda *a: vg(*a)), args)
    h = hlopass.jit(lambda *a: vg(*a), threshold=threshold, never_worse=True)
    _, first = timed(lambda: h(*args))
    [check] = h.memory_checks()
    report = h.trace(*args).report
    kept = comparison_of([report])
    rows["hlopass.jit(value_and_grad(f))"] = {
        "temp": check.temp_bytes, "first_call_s": first, "run_s": steady(lambda: h(*args)),
        "compile_s": (kept[0]["original_compile_s"] if kept and kept[0]["kept"] == "original" else
                      kept[0]["rewritten_compile_s"] if kept else None),
        "comparisons": kept}

    # 2. jax.jit of the gradient of a hlopass function (the lowering rule decides)
    inner = hlopass.jit(lambda *a: f(*a), threshold=threshold, never_worse=True)
    outer = jax.jit(jax.value_and_grad(inner))
    _, first = timed(lambda: outer(*args))
    temp, _ = temp_of(outer, args)
    rows["jax.jit(value_and_grad(hlopass.jit(f)))"] = {
        "temp": temp, "first_call_s": first, "run_s": steady(lambda: outer(*args)),
        "comparisons": comparison_of(hlopass.reports(jax.value_and_grad(inner), *args))}

    # 3. eager gradient: forward and backward programs compiled and checked separately
    plain_eager = jax.value_and_grad(jax.jit(lambda *a: f(*a)))
    _, first_plain = timed(lambda: plain_eager(*args))
    rows["plain eager value_and_grad(jax.jit(f))"] = {"first_call_s": first_plain,
                                                      "run_s": steady(lambda: plain_eager(*args))}
    eager = jax.value_and_grad(hlopass.jit(lambda *a: f(*a), threshold=threshold, never_worse=True))
    _, first = timed(lambda: eager(*args))
    rows["eager value_and_grad(hlopass.jit(f))"] = {"first_call_s": first, "run_s": steady(lambda: eager(*args))}

    print(f"exact GP marginal likelihood and gradient, n = {n:,}, float64, threshold {threshold} "
          f"(kernel {format_size(n * n * 8)}); shared machine: compare within this run")
    print(f"  {'':44s} {'XLA temp':>11} {'first call':>11} {'compile':>9} {'run':>8}")
    for name, row in rows.items():
        temp = format_size(row["temp"]) if row.get("temp") is not None else "-"
        compile_s = f"{row['compile_s']:.2f} s" if row.get("compile_s") is not None else "-"
        print(f"  {name:44s} {temp:>11} {row['first_call_s']:>9.2f} s {compile_s:>9} {row['run_s']:>6.2f} s")
        for c in row.get("comparisons", ()):
            print(f"      {c['program']}: kept the {c['kept']} program (rewritten {format_size(c['rewritten_bytes'])}, "
                  f"original {format_size(c['original_bytes'])}; compile {c['rewritten_compile_s']:.2f} s / "
                  f"{c['original_compile_s']:.2f} s)")
    base = rows["plain jax.jit(value_and_grad(f))"]
    ours = rows["hlopass.jit(value_and_grad(f))"]
    kept_compile = (f", compile of the kept program {ours['compile_s'] / base['compile_s']:.2f}x"
                    if ours["compile_s"] else "")
    print(f"  ratios hlopass/plain: temp {ours['temp'] / max(base['temp'], 1):.2f}x, "
          f"run {ours['run_s'] / base['run_s']:.2f}x, first call {ours['first_call_s'] / base['first_call_s']:.2f}x"
          + kept_compile)
    figures = {"n": n, "threshold": threshold, "rows": rows}
    path = options.json or (None if options.tiny else RESULTS)
    harness.write_json(path, figures)
    return figures


if __name__ == "__main__":
    main()
