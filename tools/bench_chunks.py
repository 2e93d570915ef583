"""Benchmark (issue 14): what each of the split pass's chunk-shape choices costs or gains in time.

The split pass picks, for each region, the axis to loop over, the chunk length along it (the largest
whose one-step live set fits the split size), an even divisor of the axis when one is close to that
(``even_chunk_fraction``), and unrolls short reductions inside the step (``unroll_max_length``). This
script runs the same programs with each choice varied, one at a time, side by side in one process
(each program in its own process, variants' calls interleaved, median wall and process CPU time, XLA temp), and prints each against the default:

* the split size (the chunk length follows it): 1 MB, 4 MB, 16 MB and the default (= the threshold);
* no cap of a step's live set for the cache (``step_cache_bytes=0``: the largest chunk that fits);
* no preference for an even chunk (a remainder step instead);
* no unrolling of short reductions;
* the hand-written alternative (``lax.map`` over blocks) for reference.

Programs: kNN L1 and L2 (``fixtures/knn.py``, 2,000 queries x 100,000 points, d = 3, k = 10) and the
kernel mat-vec (``fixtures/kernels.py``, n = 20,000, d = 3), threshold 100 MB.

    python tools/bench_chunks.py [--tiny] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

import hlopass  # noqa: E402
from hlopass.sizes import format_size  # noqa: E402
from fixtures.kernels import kernel_matvec  # noqa: E402
from fixtures.knn import knn_l1, knn_l2  # noqa: E402
from hlopass.passes.split import SplitPass  # noqa: E402

OTHER_PASSES = ["hvp", "algebraic", "matrix_chain"]
RESULT = "RESULT "


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
    out["no unroll"] = hlopass.jit(fn, static_argnums=static, threshold=threshold,
                                   passes=[*OTHER_PASSES, SplitPass(unroll_max_length=0)])
    out["hand (lax.map)"] = jax.jit(hand, static_argnums=static)
    return out


def timed(fn, args) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - wall, time.process_time() - cpu


def temp_bytes(fn, args) -> int | None:
    try:
        return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes
    except Exception:  # noqa: BLE001 - a figure we can do without
        return None


def measure(name, fn, args, static, hand, threshold, repeats, tiny) -> dict:
    fns = variants(fn, static, hand, threshold, tiny)
    device_args = tuple(a if i in static else jax.device_put(a) for i, a in enumerate(args))
    outputs = {label: jax.tree.leaves(f(*device_args)) for label, f in fns.items()}
    times = {label: [] for label in fns}
    labels = list(fns)
    for rep in range(repeats):  # interleaved, and rotated so that no variant always follows the same one
        for label in labels[rep % len(labels):] + labels[:rep % len(labels)]:
            times[label].append(timed(fns[label], device_args))
    want = outputs["default"]
    row = {"program": name, "variants": {}}
    for label, f in fns.items():
        walls, cpus = zip(*times[label])
        same = all(np.allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)  # indices may swap at near-ties
                   for a, b in zip(outputs[label], want) if np.issubdtype(np.asarray(a).dtype, np.floating))
        row["variants"][label] = {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus),
                                  "temp_bytes": temp_bytes(f, device_args), "same_as_default": bool(same)}
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
        print(RESULT + json.dumps(row))
        return 0
    rows = []
    for name in table:  # each program in its own process: one program's runs slowed the next one's
        cmd = [sys.executable, os.path.abspath(__file__), "--program", name, "--repeats", str(repeats)]
        done = subprocess.run(cmd + (["--tiny"] if options.tiny else []), capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
        if done.returncode or not lines:
            print(f"{name}: the measurement failed\n{done.stderr[-3000:]}")
            return 1
        rows.append(json.loads(lines[-1][len(RESULT):]))
        print_row(rows[-1])
    out = options.json or (None if options.tiny else os.path.join(ROOT, "tools", "results", "chunks.json"))
    if out:
        with open(out, "w") as handle:
            json.dump({"rows": rows, "machine": f"{os.cpu_count()} CPUs", "jax": jax.__version__}, handle, indent=1)
    differ = [(r["program"], v) for r in rows for v, c in r["variants"].items() if not c["same_as_default"]]
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
