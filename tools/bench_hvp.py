"""Benchmark the HVP rewrite on the Mix Flow-MG toy task across M (the paper's Figure 1).

For each M-step depth and variant of the inner model, compares XLA temp
memory and wall time (best call; the four programs called in turns) of:

- ``default``: ``jax.jit`` of the program written with plain ``jax.grad``
  (reverse-over-reverse);
- ``handwritten``: ``jax.jit`` with the paper's hand-written forward-over-reverse
  ``custom_vjp`` (listing A.4);
- ``hlopass``: ``@hlopass.jit`` (passes="hvp") on the default program (form 1);
- ``hlopass_grad``: ``jax.jit(jax.grad(hlopass.jit(meta_loss)))`` (form 2).

Usage: ``python -m tools.bench_hvp [--tiny] [--M 2 4 8 16] [--variant loop scan] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import numpy as np

import hlopass
from fixtures import mixflow as mf
from tools import harness

METHODS = ("default", "handwritten", "hlopass", "hlopass_grad")


def build(method: str, M: int, variant: str):
    """The jitted program for ``method``."""
    if method == "default":
        return jax.jit(mf.toy_task(M, variant))
    if method == "handwritten":
        return jax.jit(mf.toy_task(M, variant, "fwdrev"))
    if method == "hlopass":
        return hlopass.jit(mf.toy_task(M, variant), passes="hvp")
    if method == "hlopass_grad":
        return jax.jit(jax.grad(hlopass.jit(mf.toy_meta_loss(M, variant), passes="hvp")))
    raise ValueError(method)


def measure(M: int, variant: str, args, repeats: int) -> dict[str, dict]:
    """Per method: temp bytes, best-of-``repeats`` seconds (the methods called in turns) and the result."""
    compiled, compile_s = {}, {}
    for method in METHODS:
        _, compiled[method], compile_s[method] = harness.compile_timed(build(method, M, variant), args)
    timings = harness.time_calls({m: functools.partial(c, *args) for m, c in compiled.items()}, repeats)
    return {m: {"method": m, "M": M, "variant": variant, "temp_bytes": harness.temp_bytes(compiled[m]),
                "seconds": timings[m].best, "compile_seconds": compile_s[m], "result": np.asarray(timings[m].out)}
            for m in METHODS}


def run(Ms, variants, B: int, D: int, T: int, repeats: int) -> list[dict]:
    args = mf.toy_inputs(B, D, T)
    rows = []
    for variant in variants:
        for M in Ms:
            results = measure(M, variant, args, repeats)
            default = results["default"]
            for m, r in results.items():
                diff = np.linalg.norm(r["result"] - default["result"]) / np.linalg.norm(default["result"])
                rows.append({k: v for k, v in r.items() if k != "result"} | {
                    "rel_err_vs_default": float(diff),
                    "temp_ratio_vs_default": r["temp_bytes"] / max(default["temp_bytes"], 1),
                    "temp_ratio_vs_handwritten": r["temp_bytes"] / max(results["handwritten"]["temp_bytes"], 1),
                    "time_ratio_vs_default": r["seconds"] / default["seconds"],
                    "B": B, "D": D, "T": T})
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'variant':8} {'M':>3} {'method':13} {'temp MB':>9} {'x default':>9} {'x handwr.':>9} "
            f"{'time s':>8} {'x default':>9} {'rel err':>9}")
    return harness.text_table(head, [
        f"{r['variant']:8} {r['M']:>3} {r['method']:13} {r['temp_bytes'] / 1e6:>9.2f} "
        f"{r['temp_ratio_vs_default']:>9.3f} {r['temp_ratio_vs_handwritten']:>9.3f} "
        f"{r['seconds']:>8.4f} {r['time_ratio_vs_default']:>9.3f} {r['rel_err_vs_default']:>9.1e}" for r in rows])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke run")
    parser.add_argument("--M", type=int, nargs="+", default=None, help="M-step depths (default 2 4 8 16)")
    parser.add_argument("--variant", nargs="+", default=["loop", "scan"], choices=["loop", "scan"])
    parser.add_argument("--B", type=int, default=128)
    parser.add_argument("--D", type=int, default=256)
    parser.add_argument("--T", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the rows to this file")
    opts = parser.parse_args(argv)
    if opts.tiny:
        Ms, B, D, repeats = opts.M or [1], 8, 16, 1
    else:
        Ms, B, D, repeats = opts.M or [2, 4, 8, 16], opts.B, opts.D, opts.repeats
    rows = run(Ms, opts.variant, B, D, opts.T, repeats)
    print(f"Mix Flow-MG toy: B={B} D={D} T={opts.T}, jax {jax.__version__}, {jax.devices()[0].platform}")
    print(table(rows))
    harness.write_json(opts.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
