"""Benchmark the HVP rewrite on the Mix Flow-MG toy task across M (the paper's Figure 1).

For each M-step depth and variant of the inner model, compares XLA temp
memory and wall time of:

- ``default``: ``jax.jit`` of the program written with plain ``jax.grad``
  (reverse-over-reverse);
- ``handwritten``: ``jax.jit`` with the paper's hand-written forward-over-reverse
  ``custom_vjp`` (listing A.4);
- ``hlopass``: ``@hlopass.jit`` (passes="hvp") on the default program (form 1);
- ``hlopass_grad``: ``jax.jit(jax.grad(hlopass.jit(meta_loss)))`` (form 2).

Usage: ``python tools/bench_hvp.py [--tiny] [--M 2 4 8 16] [--variant loop scan] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import hlopass  # noqa: E402
from fixtures import mixflow as mf  # noqa: E402

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


def measure(method: str, M: int, variant: str, args, repeats: int) -> dict:
    """Temp bytes, best-of-``repeats`` seconds and the result for one program."""
    fn = build(method, M, variant)
    start = time.perf_counter()
    compiled = fn.lower(*args).compile()
    compile_s = time.perf_counter() - start
    out = compiled(*args)
    out.block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        compiled(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return {"method": method, "M": M, "variant": variant, "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
            "seconds": min(times), "compile_seconds": compile_s, "result": np.asarray(out)}


def run(Ms, variants, B: int, D: int, T: int, repeats: int) -> list[dict]:
    args = mf.toy_inputs(B, D, T)
    rows = []
    for variant in variants:
        for M in Ms:
            results = {m: measure(m, M, variant, args, repeats) for m in METHODS}
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
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['variant']:8} {r['M']:>3} {r['method']:13} {r['temp_bytes'] / 1e6:>9.2f} "
                     f"{r['temp_ratio_vs_default']:>9.3f} {r['temp_ratio_vs_handwritten']:>9.3f} "
                     f"{r['seconds']:>8.4f} {r['time_ratio_vs_default']:>9.3f} {r['rel_err_vs_default']:>9.1e}")
    return "\n".join(lines)


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
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
