"""Profile (issue 14): where a split kNN step spends its time, and what the grouped selection gains.

For kNN L1 (or L2, ``--kind``) at d = 3 (``fixtures/knn.py``), this times, side by side in one process (median process CPU time
and wall time of interleaved calls), the parts of the loop hlopass emits and the alternatives tried:

* ``distances only``: each step's distances (the short reduction unrolled, as the split pass emits
  it) reduced to one number per query, so nothing is selected;
* ``top_k only``: ``lax.top_k`` of an already computed chunk of distances, once per step;
* ``hlopass``: the whole program as ``hlopass.jit`` emits it (distances and, per step, the grouped
  selection of ``passes/split/select.py``);
* ``hlopass, one-level top_k``: the same with ``SplitPass(grouped_top_k=False)`` (XLA's ``top_k`` per row);
* ``grouped, fused``: the hand-written prototype of the grouped selection over the same steps: the points taken
  in groups of ``G``, the best distance of each group computed in the same fusion as the distances
  (the step's distances are never stored), ``top_k`` of the group bests, then the distances of the
  ``k`` chosen groups' points recomputed and selected. The true ``k`` nearest all lie in the ``k``
  groups with the best minima, so it returns the same neighbours as ``lax.top_k`` (checked), ties
  to the lower index;
* ``keops``: ``pykeops`` ``argKmin`` (when installed), as ``tools/bench_knn_speed.py`` runs it.

    python -m tools.profile_knn [--kind l1|l2] [--queries 2000] [--points 100000] [--d 3] [--group 16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import hlopass
from fixtures.knn import knn_l1, knn_l2
from hlopass.passes.split import SplitPass
from tools import harness
from tools.bench_knn_speed import keops_knn

K = 10


def unrolled_dist(q, p, kind: str = "l1"):
    """``sum(|q[:, None] - p[None]|, -1)`` (or its square for L2) with the short last axis unrolled,
    as the split pass emits it."""
    total = None
    for j in range(q.shape[-1]):
        diff = q[:, j, None] - p[None, :, j]
        term = jnp.abs(diff) if kind == "l1" else diff * diff
        total = term if total is None else total + term
    return total


@functools.partial(jax.jit, static_argnums=(2, 3))
def distances_only(q, p, chunk, kind):
    """The steps' distances (``chunk`` queries against all points), each reduced to its minimum."""
    def body(carry, q_chunk):
        return carry, jnp.min(unrolled_dist(q_chunk, p, kind), axis=1)
    return lax.scan(body, 0.0, q.reshape(-1, chunk, q.shape[-1]))[1]


@functools.partial(jax.jit, static_argnums=(1, 2))
def top_k_only(d_chunk, k, n_steps):
    """``top_k`` of one step's distances, ``n_steps`` times (perturbed so no step is hoisted)."""
    def body(carry, i):
        values, _ = lax.top_k(d_chunk + i.astype(d_chunk.dtype), k)
        return carry + values[:, 0], None
    return lax.scan(body, jnp.zeros(d_chunk.shape[0], d_chunk.dtype), jnp.arange(n_steps))[0]


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def grouped_knn(q, p, k, chunk, group, kind):
    """Exact kNN over the same steps (``chunk`` queries each): the best distance of each group of
    ``group`` points reduced in the distances' fusion, ``top_k`` of the group bests, then the chosen
    groups' points gathered, their distances recomputed and selected."""
    n, d = p.shape
    n_groups = n // group
    grouped = p.reshape(n_groups, group, d)

    def step(q_chunk):
        rows = q_chunk.shape[0]
        group_best = jnp.min(unrolled_dist(q_chunk, p, kind).reshape(rows, n_groups, group), -1)
        _, chosen = lax.top_k(-group_best, k)
        chosen = jnp.sort(chosen, axis=-1)  # candidates in index order: ties go to the lower index
        diff = q_chunk[:, None, :] - grouped[chosen].reshape(rows, k * group, d)
        cand = jnp.sum(jnp.abs(diff) if kind == "l1" else diff * diff, -1)
        values, where = lax.top_k(-cand, k)
        return -values, jnp.take_along_axis(chosen, where // group, -1) * group + where % group

    dist, idx = lax.map(step, q.reshape(-1, chunk, d))
    return dist.reshape(-1, k), idx.reshape(-1, k)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kind", choices=("l1", "l2"), default="l1")
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--points", type=int, default=100_000)
    parser.add_argument("--d", type=int, default=3)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args(argv)
    rng = np.random.default_rng(1)
    q = rng.uniform(0, 1, (options.queries, options.d)).astype(np.float32)
    p = rng.uniform(0, 1, (options.points, options.d)).astype(np.float32)
    kind, knn = options.kind, (knn_l1 if options.kind == "l1" else knn_l2)
    hlo = hlopass.jit(knn, static_argnums=2, threshold="100MB")
    one_level = hlopass.jit(knn, static_argnums=2, threshold="100MB",
                            passes=["hvp", "algebraic", "matrix_chain", SplitPass(grouped_top_k=False)])
    report = hlo.trace(q, p, K).report
    split = [r for r in report.rewrites if r.pass_name == "split" and r.kind == "split"]
    chunk = int(split[0].details["chunk"]) if split else options.queries
    if options.queries % chunk:  # whole steps only, to keep the script simple
        chunk = next(c for c in range(chunk, 0, -1) if options.queries % c == 0)
    n_steps = options.queries // chunk
    if options.points % options.group:
        parser.error("--points must be a multiple of --group")
    print(f"kNN {kind.upper()} {options.queries} x {options.points}, d = {options.d}, k = {K}: hlopass splits the "
          f"queries into {n_steps} steps of {chunk} (each against all points); the parts below use the same steps")
    qd, pd = jax.device_put(q), jax.device_put(p)
    d_chunk = jax.device_put(-np.asarray(unrolled_dist(q[:chunk], p, kind)))
    fns = {
        "distances only": lambda: distances_only(qd, pd, chunk, kind),
        "top_k only": lambda: top_k_only(d_chunk, K, n_steps),
        "hlopass": lambda: hlo(qd, pd, K),
        "hlopass, one-level top_k": lambda: one_level(qd, pd, K),
        f"grouped, fused (G = {options.group})": lambda: grouped_knn(qd, pd, K, chunk, options.group, kind),
        "plain jax.jit": lambda: jax.jit(knn, static_argnums=2)(qd, pd, K),
    }
    keops = keops_knn(kind)
    if keops is not None:
        fns["keops argKmin"] = lambda: keops(q, p, K)
    want = np.sort(np.asarray(jax.jit(knn, static_argnums=2)(qd, pd, K)[1]), 1)
    got = np.sort(np.asarray(fns[f"grouped, fused (G = {options.group})"]()[1]), 1)
    same = float(np.mean(got == want))
    print(f"grouped selection: same neighbours as jax.jit for {same:.4%} of the entries")
    timings = harness.time_calls(fns, options.repeats, label="profile_knn")  # a warm-up call each, then in turns
    base = timings["hlopass"].median_cpu
    for name, timing in timings.items():
        wall, cpu = timing.median, timing.median_cpu
        print(f"  {name:28s} {wall:7.3f} s wall {cpu:7.3f} s CPU   CPU / hlopass {cpu / base:5.2f}")
    return 0 if same == 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
