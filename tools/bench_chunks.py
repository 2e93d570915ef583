"""Benchmark (issue 14): what each of the split pass's chunk-shape choices costs or gains in time.

The split pass picks, for each region, the axis to loop over, the chunk length along it (the largest
whose one-step live set fits the split size), an even divisor of the axis when one is close to that
(``even_chunk_fraction``), and unrolls short reductions inside the step (``unroll_max_length``). This
script runs the same programs with each choice varied, one at a time, side by side in one process
(each program in its own process, variants' calls interleaved, median wall and process CPU time, XLA temp), and prints each against the default:

* the split size (the chunk length follows it): 1 MB, 4 MB, 16 MB and the default (= the threshold);
* no cap of a step's live set for the cache (``step_cache_bytes=0``: the largest chunk that fits);
* no preference for an even chunk (a remainder step instead);
* a short last step instead of an overlapping whole one (``overlap_last_step=False``);
* no unrolling of short reductions;
* the hand-written alternative (``lax.map`` over blocks) for reference.

Programs: kNN L1 and L2 (``fixtures/knn.py``, 2,000 queries x 100,000 points, d = 3, k = 10) and the
kernel mat-vec (``fixtures/kernels.py``, n = 20,000, d = 3), threshold 100 MB.

    python -m tools.bench_chunks [--tiny] [--repeats 5] [--json PATH]
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
from fixtures.kernels import kernel_matvec
from fixtures.knn import knn_l1, knn_l2
from hlopass.passes.split import SplitPass
from hlopass.sizes import format_size
from tools import harness

OTHER_PASSES = ["hvp", "algebraic", "matrix_chain"]


def programs(tiny: bool) -> dict:
    """name -> (function, inputs, static argnums, hand-written version, threshold)."""
    rng = np.random.default_rng(0)
    queries, points, n = (64, 3_001, 1_009) if tiny else (2_000, 100_000, 20_000)
    q = rng.uniform(0, 1, (queries, 3)).astype(np.float32)
    p = rng.uniform(0, 1, (points, 3)).astype(np.float32)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    v = rng.normal(size=(n,)).astype(np.float32)
    block = 16 if tiny else 500

    def hand_knn(knn):
        return lambda q, p, k: lax.map(lambda row: tuple(a[0] for a in knn(row[None], p, k)), q, batch_size=block)

    def hand_matvec(x, y, v):
        return lax.map(lambda row: kernel_matvec(row[None], y, v)[0], x, batch_size=block)

    threshold = "200kB" if tiny else "100MB"
    return {
        "kNN L1": (knn_l1, (q, p, 10), (2,), hand_knn(knn_l1), threshold),
        "kNN L2": (knn_l2, (q, p, 10), (2,), hand_knn(knn_l2), threshold),
        "kernel mat-vec": (kernel_matvec, (x, x, v), (), hand_matvec, threshold),
    }


def variants(fn, static, hand, threshold: str, tiny: bool) -> dict:
    """The default pipeline and each choice varied alone."""
    sizes = ["4kB", "16kB", "64kB"] if tiny else ["1MB", "4MB", "16MB"]
    out = {"default": hlopass.jit(fn, static_argnums=static, threshold=threshold)}
    for size in sizes:
        out[f"split size {size}"] = hlopass.jit(fn, static_argnums=static, threshold=threshold, split_size=size)
    out["no cache cap"] = hlopass.jit(fn, static_argnums=static, threshold=threshold,
                                      passes=[*OTHER_PASSES, SplitPass(step_cache_bytes=0)])
    out["no even chunk"] = hlopass.jit(fn, static_argnums=static, threshold=threshold,
                                       passes=[*OTHER_PASSES, SplitPass(even_chunk_fraction=1.01)])
    out["short last step"] = hlopass.jit(fn, static_argnums=static, threshold=threshold,
                                         passes=[*OTHER_PASSES, SplitPass(overlap_last_step=False)])
    out["no unroll"] = hlopass.jit(fn, static_argnums=static, threshold=threshold,
                                   passes=[*OTHER_PASSES, SplitPass(unroll_max_length=0)])
    out["hand (lax.map)"] = jax.jit(hand, static_argnums=static)
    return out


def measure(name, fn, args, static, hand, threshold, repeats, tiny) -> dict:
    fns = variants(fn, static, hand, threshold, tiny)
    device_args = tuple(a if i in static else jax.device_put(a) for i, a in enumerate(args))
    # a warm-up call each, then interleaved and rotated so that no variant always follows the same one
    timings = harness.time_calls({label: functools.partial(f, *device_args) for label, f in fns.items()}, repeats,
                                 label=name)
    outputs = {label: jax.tree.leaves(t.out) for label, t in timings.items()}
    want = outputs["default"]
    row = {"program": name, "variants": {}}
    for label, f in fns.items():
        same = all(np.allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)  # indices may swap at near-ties
                   for a, b in zip(outputs[label], want) if np.issubdtype(np.asarray(a).dtype, np.floating))
        row["variants"][label] = {"wall_s": timings[label].median, "cpu_s": timings[label].median_cpu,
                                  "temp_bytes": harness.temp_bytes(f, device_args, quiet=True),
                                  "same_as_default": bool(same)}
    return row


def print_row(row: dict) -> None:
    base = row["variants"]["default"]
    print(f"{row['program']} (threshold {row['threshold']})")
    for label, cell in row["variants"].items():
        temp = "-" if cell["temp_bytes"] is None else format_size(cell["temp_bytes"])
        print(f"  {label:18s} {cell['wall_s']:7.3f} s wall {cell['cpu_s']:7.3f} s CPU  temp {temp:>9s}  "
              f"time / default {cell['wall_s'] / base['wall_s']:5.2f}x"
              + ("" if cell["same_as_default"] else "  RESULTS DIFFER"), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--program", default=None, help=argparse.SUPPRESS)  # a child runs one program
    options = parser.parse_args(argv)
    repeats = options.repeats or (1 if options.tiny else 5)
    table = programs(options.tiny)
    if options.program:
        fn, args, static, hand, threshold = table[options.program]
        row = measure(options.program, fn, args, static, hand, threshold, repeats, options.tiny)
        row["threshold"] = threshold
        harness.report_result(row)
        return 0
    rows = []
    for name in harness.progress(table, "bench_chunks"):  # each program in its own process: one program's runs
        argv = harness.module_argv("bench_chunks", "--program", name, "--repeats", str(repeats),  # slowed the next's
                                   *(["--tiny"] if options.tiny else []))
        row = harness.run_capped(argv, None, timeout=24 * 3600, platforms=None, keep=())
        if row.get("status") in ("crashed", "timeout"):
            print(f"{name}: the measurement failed\n{row.get('error')}")
            return 1
        rows.append(row)
        print_row(rows[-1])
    out = options.json or (None if options.tiny else os.path.join(harness.RESULTS, "chunks.json"))
    harness.write_json(out, {"rows": rows, "machine": f"{os.cpu_count()} CPUs", "jax": jax.__version__}, indent=1)
    differ = [(r["program"], v) for r in rows for v, c in r["variants"].items() if not c["same_as_default"]]
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
