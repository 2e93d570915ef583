"""Matrix-chain reordering against plain ``jax.jit`` and against the chain ordered by hand.

    python -m tools.bench_matrix_chain [--n 3000] [--tiny] [--json PATH]

For each chain of ``fixtures/chains.py`` (``A@B@v``, ``A.T@B.T@C@v``,
``sum(A@B, axis=1)`` at n×n, a batched ``A@B@v`` and ``x@W1@W2`` with a thin
``W2``), plus the gradient of ``sum(x@W1@W2)`` in all three arguments: the
best of five calls (more for fast ones, up to a second; the three columns called in turns) after a warm-up
(inputs already on the device) for ``jax.jit`` of the code as written,
``hlopass.jit`` of the same code (matrix_chain pass only) and ``jax.jit`` of
the hand-ordered twin; XLA's temp memory for each; the largest difference
from ``jax.jit`` relative to the result's largest entry.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import hlopass
from fixtures import chains
from hlopass.sizes import format_size
from tools import harness


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


def measure(name, fun, by_hand, args, repeat, budget) -> dict:
    args = tuple(jax.device_put(a) for a in args)  # time the computation, not host-to-device copies
    plain, ours, hand = jax.jit(fun), hlopass.jit(fun, passes="matrix_chain"), jax.jit(by_hand)
    report = ours.trace(*args).report
    row = {
        "chain": name,
        "shapes": " ".join("x".join(map(str, a.shape)) for a in args),
        **harness.columns_figures({"jax_jit": plain, "hlopass": ours, "by_hand": hand}, args, repeat, budget),
        "max_rel_diff": harness.relative_difference(ours(*args), plain(*args), per_leaf=False),
        "rewrites": [r.summary for r in report.rewrites],
        "flops_before": sum(r.details.get("flops_before", 0) for r in report.rewrites),
        "flops_after": sum(r.details.get("flops_after", 0) for r in report.rewrites),
    }
    row["speedup_vs_jax_jit"] = row["jax_jit_s"] / row["hlopass_s"]
    row["hlopass_vs_by_hand"] = row["hlopass_s"] / row["by_hand_s"]
    return row


def print_table(rows, key: str = "chain", width: int = 30, rewrites: bool = False) -> None:
    """The rows against jax.jit and by hand (``bench_exact_rewrites`` prints its rows with it too)."""
    header = (f"{key:<{width}} {'jax.jit':>9} {'hlopass':>9} {'by hand':>9} {'speedup':>8} {'vs hand':>8} "
              f"{'temp jit':>10} {'temp hlopass':>12} {'rel diff':>9}" + ("  rewrites" if rewrites else ""))
    print(harness.text_table(header, [
        f"{r[key]:<{width}} {r['jax_jit_s']:>8.4f}s {r['hlopass_s']:>8.4f}s {r['by_hand_s']:>8.4f}s "
        f"{r['speedup_vs_jax_jit']:>7.1f}x {r['hlopass_vs_by_hand']:>7.2f}x "
        f"{format_size(r['temp_jax_jit_bytes']):>10} {format_size(r['temp_hlopass_bytes']):>12} "
        f"{r['max_rel_diff']:>9.1e}" + (f"  {', '.join(r['rewrites']) or '-'}" if rewrites else "") for r in rows]))


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
    harness.write_json(options.json, {"n": n, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
