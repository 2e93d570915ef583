"""Benchmark (issue 14): kNN speed, hlopass against plain ``jax.jit``, hand-written chunking and KeOps.

The naive spelling ``lax.top_k(-sum((q[:, None] - p[None]) ** 2, -1), k)`` (and ``|.|`` for L1) from
``fixtures/knn.py``, at 2,000 and 5,000 queries x 100,000 points, d = 3 and 16, k = 10, side by side in
one process, calls interleaved in an order that rotates each round (a call right after plain's runs up
to 2x slower), median wall time and median process CPU time (the CPU time counts every thread, and moves
less than wall time on a shared machine). Columns:

* ``plain``: ``jax.jit`` of the naive spelling (XLA fuses the broadcast into the reduction; it builds
  the ``queries x points`` distances);
* ``hlopass``: ``hlopass.jit`` of the same, threshold 100 MB (algebraic rewrite for L2, split loop,
  short reductions unrolled in the step);
* ``hlopass, no unroll``: the same pipeline with the split pass's unrolling off (``unroll_max_length=0``),
  what it gains;
* ``hlopass, one-level top_k``: the same with XLA's ``top_k`` over each whole row instead of the
  grouped selection (``SplitPass(grouped_top_k=False)``), what the grouping gains;
* ``hand``: ``lax.map`` over blocks of 500 queries (the hand-written chunking);
* ``keops``: ``pykeops`` ``argKmin`` on a ``LazyTensor`` (when installed: ``pip install -e '.[bench]'``),
  distances gathered afterwards.

    python -m tools.bench_knn_speed               # the issue's sizes; JSON to tools/results/knn_speed.json
    python -m tools.bench_knn_speed --tiny --json /tmp/k.json
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import numpy as np
from jax import lax

import hlopass
from fixtures.knn import knn_l1, knn_l2
from hlopass.passes.split import SplitPass
from tools import harness

FULL = [(q, 100_000, d) for q in (2_000, 5_000) for d in (3, 16)]
TINY = [(64, 3_001, 3), (64, 3_001, 16)]
K, BLOCK, THRESHOLD = 10, 500, "100MB"


def keops_knn(kind: str):
    try:
        from pykeops.numpy import LazyTensor
    except Exception:  # noqa: BLE001 - optional, needs a compiler
        return None

    def run(q, p, k):
        diff = LazyTensor(q[:, None, :]) - LazyTensor(p[None, :, :])
        dist = (diff ** 2).sum(-1) if kind == "l2" else diff.abs().sum(-1)
        idx = dist.argKmin(k, dim=1)
        sel = p[idx]
        d = ((q[:, None, :] - sel) ** 2).sum(-1) if kind == "l2" else np.abs(q[:, None, :] - sel).sum(-1)
        return d, idx
    return run


def variants(kind: str, threshold: str, block: int):
    knn = knn_l2 if kind == "l2" else knn_l1
    no_unroll = ["hvp", "algebraic", "matrix_chain", SplitPass(unroll_max_length=0)]
    one_level = ["hvp", "algebraic", "matrix_chain", SplitPass(grouped_top_k=False)]
    out = {
        "plain": jax.jit(knn, static_argnums=2),
        "hlopass": hlopass.jit(knn, static_argnums=2, threshold=threshold),
        "hlopass, no unroll": hlopass.jit(knn, static_argnums=2, threshold=threshold, passes=no_unroll),
        "hlopass, one-level top_k": hlopass.jit(knn, static_argnums=2, threshold=threshold, passes=one_level),
        "hand": jax.jit(lambda q, p, k: lax.map(lambda row: tuple(a[0] for a in knn(row[None], p, k)), q,
                                                batch_size=block), static_argnums=2),
    }
    keops = keops_knn(kind)
    if keops is not None:
        out["keops"] = keops
    return out


def measure(kind, queries, points, d, repeats, threshold, block) -> dict:
    rng = np.random.default_rng(1)
    q = rng.uniform(0, 1, (queries, d)).astype(np.float32)
    p = rng.uniform(0, 1, (points, d)).astype(np.float32)
    fns = variants(kind, threshold, block)
    args = {name: (q, p, K) if name == "keops" else (jax.device_put(q), jax.device_put(p), K) for name in fns}
    # the order rotates: a call right after plain's 1 GB one runs up to 2x slower
    timings = harness.time_calls({name: functools.partial(fn, *args[name]) for name, fn in fns.items()}, repeats,
                                 label=f"{kind} {queries}x{points} d={d}")
    want = np.asarray(timings["plain"].out[1])
    row = {"kind": kind, "queries": queries, "points": points, "d": d, "k": K, "threshold": threshold}
    for name, timing in timings.items():
        row[name] = {"wall_s": timing.median, "cpu_s": timing.median_cpu, "first_call_s": timing.first,
                     "same_neighbours": float(np.mean(np.sort(np.asarray(timing.out[1]), 1) == np.sort(want, 1)))}
    report = fns["hlopass"].trace(*args["hlopass"]).report
    row["rewrites"] = [f"{r.pass_name}:{r.kind}" for r in report.rewrites]
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    sizes = TINY if args.tiny else FULL
    repeats = args.repeats or (1 if args.tiny else 5)
    threshold, block = ("200kB", 16) if args.tiny else (THRESHOLD, BLOCK)
    rows = []
    for kind in ("l2", "l1"):
        for queries, points, d in sizes:
            row = measure(kind, queries, points, d, repeats, threshold, block)
            rows.append(row)
            names = [n for n in row if isinstance(row[n], dict)]
            cells = "  ".join(f"{n} {row[n]['wall_s']:.3f}s/{row[n]['cpu_s']:.3f}cpu" for n in names)
            ratios = "  ".join(f"{n}/hlopass {row[n]['wall_s'] / row['hlopass']['wall_s']:.2f}x"
                               for n in names if n != "hlopass")
            print(f"kNN {kind.upper()} {queries}x{points} d={d}: {cells}\n    speedup (wall): {ratios}", flush=True)
    out = args.json or (None if args.tiny else os.path.join(harness.RESULTS, "knn_speed.json"))
    harness.write_json(out, {"rows": rows, "machine": f"{os.cpu_count()} CPUs", "jax": jax.__version__}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
