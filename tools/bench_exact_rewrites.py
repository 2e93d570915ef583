"""Exact rewrites at default settings against plain ``jax.jit`` and the hand-written form.

    python -m tools.bench_exact_rewrites [--n 3000] [--tiny] [--json PATH]

The algebraic pass's exact rewrites (the same products summed in another order) fire with nothing
set, whatever the threshold. For each workload, side by side in one process: the best of several
calls (after a warm-up, inputs on the device, the columns called in turns) of ``jax.jit`` of the code as written, ``hlopass.jit``
of the same code with no settings, and ``jax.jit`` of the form written by hand; XLA's temp memory
of each; the largest difference from ``jax.jit`` relative to the result's largest entry; and the
ratios plain / hlopass and hlopass / by hand.

- ``diag(A@B)``, ``trace(A@B)``, ``sum(eye * (A@B))``: n x n float32 (n = 3,000); by hand
  ``einsum('ik,ki->i')`` and ``einsum('ik,ki->')``.
- broadcast-multiply-sum ``(x[:,None,:] * y[None]).sum(-1)``: n x 64 against n x 64 (one
  ``dot_general``, ``x @ y.T`` by hand), its batched form (8 batches of n/4 x 32), and the gradient
  of ``sum(w * tanh(...))`` in x and y at n/3 points (JAX's backward pass of the written form builds
  n/3 x n/3 x 64 products; the rewritten one two ``dot_general`` s).
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

import hlopass
from tools import harness
from tools.bench_matrix_chain import print_table


def workloads(n: int):
    """(name, as written, by hand, inputs) for each workload."""
    rng = np.random.default_rng(0)

    def normal(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    A, B = normal(n, n), normal(n, n)
    x, y = normal(n, 64), normal(n, 64)
    quarter, third = max(n // 4, 4), max(n // 3, 4)
    xb, yb = normal(8, quarter, 32), normal(8, quarter, 32)
    return [
        ("diag(A@B)", lambda A, B: jnp.diag(A @ B), lambda A, B: jnp.einsum("ik,ki->i", A, B), (A, B)),
        ("trace(A@B)", lambda A, B: jnp.trace(A @ B), lambda A, B: jnp.einsum("ik,ki->", A, B), (A, B)),
        ("sum(eye*(A@B))", lambda A, B: jnp.sum(jnp.eye(A.shape[0], dtype=A.dtype) * (A @ B)),
         lambda A, B: jnp.einsum("ik,ki->", A, B), (A, B)),
        ("(x[:,None]*y[None]).sum(-1)", lambda x, y: (x[:, None, :] * y[None, :, :]).sum(-1),
         lambda x, y: x @ y.T, (x, y)),
        ("batched broadcast-multiply-sum", lambda x, y: (x[:, :, None, :] * y[:, None, :, :]).sum(-1),
         lambda x, y: jnp.einsum("bnd,bmd->bnm", x, y), (xb, yb)),
        ("grad of broadcast-multiply-sum", jax.grad(_bms_loss, (0, 1)), jax.grad(_bms_loss_by_hand, (0, 1)),
         (x[:third], y[:third], normal(third, third))),
    ]


def _bms_loss(x, y, w):
    """A loss of a broadcast-multiply-sum: JAX's backward pass builds n x n x d products."""
    return jnp.sum(w * jnp.tanh((x[:, None, :] * y[None, :, :]).sum(-1)))


def _bms_loss_by_hand(x, y, w):
    return jnp.sum(w * jnp.tanh(x @ y.T))


def measure(name, fun, by_hand, args, repeat, budget) -> dict:
    args = tuple(jax.device_put(a) for a in args)
    plain, ours, hand = jax.jit(fun), hlopass.jit(fun), jax.jit(by_hand)  # hlopass: nothing set
    reports = hlopass.reports(ours, *args)  # the backward programs too, for a gradient
    row = {
        "workload": name,
        "shapes": " ".join("x".join(map(str, a.shape)) for a in args),
        "threshold": ours.config().threshold,
        **harness.columns_figures({"jax_jit": plain, "hlopass": ours, "by_hand": hand}, args, repeat, budget),
        "max_rel_diff": harness.relative_difference(ours(*args), plain(*args), per_leaf=False),
        "rewrites": [f"{r.pass_name}:{r.kind}" for report in reports for r in report.rewrites],
    }
    row["speedup_vs_jax_jit"] = row["jax_jit_s"] / row["hlopass_s"]
    row["hlopass_vs_by_hand"] = row["hlopass_s"] / row["by_hand_s"]
    return row


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=3000, help="matrix size (and number of points)")
    parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (n = 48)")
    parser.add_argument("--json", help="write the rows here")
    options = parser.parse_args(argv)
    n = 48 if options.tiny else options.n
    repeat, budget = (1, 0.0) if options.tiny else (5, 1.0)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, n = {n}, hlopass with no settings "
          f"(HLOPASS_* unset: {not any(k.startswith('HLOPASS_') for k in os.environ)})")
    rows = [measure(name, fun, by_hand, args, repeat, budget) for name, fun, by_hand, args in workloads(n)]
    print_table(rows, key="workload", width=32, rewrites=True)
    harness.write_json(options.json, {"n": n, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
