"""Matrix-chain reordering against plain ``jax.jit`` and against the chain ordered by hand.

    python tools/bench_matrix_chain.py [--n 3000] [--tiny] [--json PATH]

For each chain of ``fixtures/chains.py`` (``A@B@v``, ``A.T@B.T@C@v``,
``sum(A@B, axis=1)`` at n×n, a batched ``A@B@v`` and ``x@W1@W2`` with a thin
``W2``), plus the gradient of ``sum(x@W1@W2)`` in all three arguments: the
best of five calls (more for fast ones, up to a second) after a warm-up (inputs already on the device) for ``jax.jit`` of the code as written,
``hlopass.jit`` of the same code (matrix_chain pass only) and ``jax.jit`` of
the hand-ordered twin; XLA's temp memory for each; the largest difference
from ``jax.jit`` relative to the result's largest entry.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hlopass  # noqa: E402
from fixtures import chains  # noqa: E402
from hlopass.sizes import format_size  # noqa: E402


def grad_thin_mlp(x, W1, W2):
    """Gradient of sum(x @ W1 @ W2) in x, W1 and W2: the backward pass holds the chains
    g @ (W1 @ W2).T, x.T @ (g @ W2.T) and (x @ W1).T @ g, sharing g @ W2.T."""
    return jax.grad(lambda *a: jnp.sum(chains.thin_mlp(*a)), argnums=(0, 1, 2))(x, W1, W2)


def grad_thin_mlp_by_hand(x, W1, W2):
    column_sums = jnp.sum(x, axis=0)[:, None]
    return (jnp.ones((x.shape[0], 1), x.dtype) @ (W1 @ W2).T, column_sums @ W2.T, W1.T @ column_sums)


def workloads(n: int, tiny: bool):
    """(name, chain, hand-ordered twin, inputs) for each benchmarked chain."""
    batch, batch_n = (2, max(n // 4, 8)) if tiny else (16, n // 6)
    mlp_n = max(n // 3, 8)
    rows = {}
    for name, (fun, by_hand, make) in chains.CHAINS.items():
        if name.startswith("batched"):
            args = make(batch_n, np.float32, 0, batch)
        elif name.startswith("x@W1@W2"):
            args = make(mlp_n)
        else:
            args = make(n)
        rows[name] = (fun, by_hand, args)
    rows["grad of sum(x@W1@W2)"] = (grad_thin_mlp, grad_thin_mlp_by_hand, chains.CHAINS["x@W1@W2 (thin W2)"][2](mlp_n))
    return rows


def best_of(fn, args, repeat: int = 5, budget_s: float = 1.0) -> float:
    """Best time of at least ``repeat`` calls after a warm-up; fast calls repeat until ``budget_s``."""
    jax.block_until_ready(fn(*args))  # warm-up (compiles)
    times: list[float] = []
    while len(times) < repeat or (sum(times) < budget_s and len(times) < 100):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def temp_bytes(jitted, args) -> int:
    return int(jitted.lower(*args).compile().memory_analysis().temp_size_in_bytes)


def measure(name, fun, by_hand, args, repeat, budget) -> dict:
    args = tuple(jax.device_put(a) for a in args)  # time the computation, not host-to-device copies
    plain, ours, hand = jax.jit(fun), hlopass.jit(fun, passes="matrix_chain"), jax.jit(by_hand)
    report = ours.trace(*args).report
    want = np.concatenate([np.ravel(a) for a in jax.tree_util.tree_leaves(plain(*args))]).astype(np.float64)
    got = np.concatenate([np.ravel(a) for a in jax.tree_util.tree_leaves(ours(*args))]).astype(np.float64)
    row = {
        "chain": name,
        "shapes": " ".join("x".join(map(str, a.shape)) for a in args),
        "jax_jit_s": best_of(plain, args, repeat, budget),
        "hlopass_s": best_of(ours, args, repeat, budget),
        "by_hand_s": best_of(hand, args, repeat, budget),
        "temp_jax_jit_bytes": temp_bytes(plain, args),
        "temp_hlopass_bytes": temp_bytes(ours, args),
        "temp_by_hand_bytes": temp_bytes(hand, args),
        "max_rel_diff": float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)),
        "rewrites": [r.summary for r in report.rewrites],
        "flops_before": sum(r.details.get("flops_before", 0) for r in report.rewrites),
        "flops_after": sum(r.details.get("flops_after", 0) for r in report.rewrites),
    }
    row["speedup_vs_jax_jit"] = row["jax_jit_s"] / row["hlopass_s"]
    row["hlopass_vs_by_hand"] = row["hlopass_s"] / row["by_hand_s"]
    return row


def print_table(rows) -> None:
    header = (f"{'chain':<30} {'jax.jit':>9} {'hlopass':>9} {'by hand':>9} {'speedup':>8} {'vs hand':>8} "
              f"{'temp jit':>10} {'temp hlopass':>12} {'rel diff':>9}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['chain']:<30} {r['jax_jit_s']:>8.4f}s {r['hlopass_s']:>8.4f}s {r['by_hand_s']:>8.4f}s "
              f"{r['speedup_vs_jax_jit']:>7.1f}x {r['hlopass_vs_by_hand']:>7.2f}x "
              f"{format_size(r['temp_jax_jit_bytes']):>10} {format_size(r['temp_hlopass_bytes']):>12} "
              f"{r['max_rel_diff']:>9.1e}")


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=3000, help="matrix size of the square chains")
    parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (n = 48)")
    parser.add_argument("--json", help="write the rows here")
    options = parser.parse_args(argv)
    n = 48 if options.tiny else options.n
    repeat = 1 if options.tiny else 5
    budget = 0.0 if options.tiny else 1.0
    rows = [measure(name, *spec, repeat=repeat, budget=budget) for name, spec in workloads(n, options.tiny).items()]
    print(f"matrix_chain on {jax.devices()[0].device_kind}, float32, best of {repeat}+ calls after a warm-up; "
          f"speedup = jax.jit time / hlopass time; vs hand = hlopass time / hand-ordered time")
    print_table(rows)
    for r in rows:
        print(f"  {r['chain']}: {r['shapes']}; " + "; ".join(r["rewrites"]))
    if options.json:
        with open(options.json, "w") as f:
            json.dump({"n": n, "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
