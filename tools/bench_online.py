"""Carried-state splits (issue 16): online logsumexp/softmax along keys, prefix sums along a sequence.

    python -m tools.bench_online [--rows a,b] [--repeats R] [--cap 12GB] [--tiny] [--json PATH]
    python -m tools.bench_online --side-by-side [--rows a,b] [--repeats R] [--tiny] [--json PATH]

Each row of the issue's table at full size (``--tiny``: small sizes, a smoke run), each column in its
own child process under an address-space cap:

* ``plain``: ``jax.jit`` of the program as written;
* ``hlopass``: ``hlopass.jit(passes="split")`` at the row's threshold (split size = threshold);
* ``hand``: a hand-written loop (``lax.fori_loop`` over key chunks carrying a running maximum and
  rescaled sums, two loops for the gradient; a chunked scan carrying the d x d state for linear
  attention; ``jax.grad`` of it for its gradient).

The ``decoding`` row (``jax.nn.dot_product_attention``, 1 query against 4,000,000 keys) is not in the
issue's table but in its benchmark list; attention at sequence 16,384 with 8 heads is
``python -m tools.bench_attention``.

Reported per column: the largest tensor the program builds for itself (lowered StableHLO, loop bodies
included, loops' carried state and tensors with an argument's or result's dimensions aside), XLA temp,
compile and median run time, and the largest difference from ``plain`` relative to its largest
magnitude; the JSON also holds each column's median process CPU time (all threads; steadier than the
wall clock on a loaded machine). The hlopass column must keep its own largest tensor within 1.5x the
split size and XLA temp within 3x the split size plus twice the largest argument or result; the script
exits non-zero otherwise. Writes JSON rows (``tools/results/online.json`` by default).

``--side-by-side`` compiles hlopass and the hand loop of each row in one process and calls them in
turns (the order rotating; no cap, no plain column): the per-step cost of the two loops compared under the same load.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import numpy as np

from hlopass.sizes import format_size, parse_size
from tools import harness

#: row -> (description, full sizes, tiny sizes, threshold at full size, at tiny size)
ROWS = {
    "contrastive": ("contrastive loss `logsumexp(a @ b.T, axis=1)`, 32 anchors x 2,000,000 keys (d = 16), value",
                    dict(n=32, m=2_000_000, d=16), dict(n=4, m=20_000, d=8), "2MB", "64kB"),
    "contrastive_grad": ("the same, gradient w.r.t. both", dict(n=32, m=2_000_000, d=16), dict(n=4, m=20_000, d=8),
                         "2MB", "64kB"),
    "nadaraya_watson": ("Nadaraya-Watson `softmax(-sqdist(q, xs), axis=1) @ ys`, 16 x 1,000,000 (3-d points)",
                        dict(n=16, m=1_000_000, d=3), dict(n=4, m=20_000, d=3), "2MB", "64kB"),
    "linear_attention": ("causal linear attention with `cumsum(k[:, :, None] * v[:, None, :], axis=0)`, "
                         "L = 32,768, d = 64, value", dict(L=32_768, d=64), dict(L=2_048, d=16), "16MB", "256kB"),
    "linear_attention_grad": ("the same, gradient", dict(L=32_768, d=64), dict(L=2_048, d=16), "16MB", "256kB"),
    "decoding": ("decoding-style `jax.nn.dot_product_attention`, 1 query x 4,000,000 keys, head dim 64",
                 dict(S=4_000_000, H=64), dict(S=20_000, H=16), "2MB", "64kB"),
}
COLUMNS = ("plain", "hlopass", "hand")
SAMPLE = 64


# -- the programs as written ---------------------------------------------------------------------

def contrastive(a, b):
    import jax
    return jax.nn.logsumexp(a @ b.T, axis=1)


def contrastive_loss(a, b):
    import jax.numpy as jnp
    return jnp.sum(contrastive(a, b) * jnp.cos(jnp.arange(a.shape[0], dtype=a.dtype)))


def contrastive_grad(a, b):
    import jax
    return jax.grad(contrastive_loss, argnums=(0, 1))(a, b)


def nadaraya_watson(q, xs, ys):
    import jax
    import jax.numpy as jnp
    d = jnp.sum((q[:, None, :] - xs[None, :, :]) ** 2, axis=-1)
    return jax.nn.softmax(-d, axis=1) @ ys


def linear_attention(q, k, v):
    import jax.numpy as jnp
    s = jnp.cumsum(k[:, :, None] * v[:, None, :], axis=0)
    return jnp.sum(q[:, :, None] * s, axis=1)


def linear_attention_grad(q, k, v):
    import jax
    import jax.numpy as jnp
    return jax.grad(lambda *a: jnp.sum(linear_attention(*a) ** 2), argnums=(0, 1, 2))(q, k, v)


# -- by hand ---------------------------------------------------------------------------------------

def _chunk(total: int, per_unit: int, budget: int) -> int:
    """The largest divisor of ``total`` whose slice (``per_unit`` bytes a unit) fits ``budget``."""
    best = 1
    for c in range(1, total + 1):
        if total % c == 0 and c * per_unit <= budget:
            best = c
    return best


def hand_lse(a, b, chunk):
    import jax.numpy as jnp
    from jax import lax
    steps = b.shape[0] // chunk

    def body(i, state):
        m, s = state
        x = a @ lax.dynamic_slice_in_dim(b, i * chunk, chunk).T
        m_new = jnp.maximum(m, jnp.max(x, axis=1))
        shift = jnp.where(jnp.isfinite(m_new), m_new, 0)
        old = jnp.where(jnp.isfinite(m), m, 0)
        s = s * jnp.exp(old - shift) + jnp.sum(jnp.exp(x - shift[:, None]), axis=1)
        return m_new, s

    m0 = jnp.full(a.shape[:1], -jnp.inf, a.dtype)
    m, s = lax.fori_loop(0, steps, body, (m0, jnp.zeros(a.shape[:1], a.dtype)))
    return jnp.log(s) + jnp.where(jnp.isfinite(m), m, 0)


def hand_contrastive_grad(a, b, chunk):
    import jax.numpy as jnp
    from jax import lax
    lse = hand_lse(a, b, chunk)
    g = jnp.cos(jnp.arange(a.shape[0], dtype=a.dtype))
    steps = b.shape[0] // chunk

    def body(i, state):
        da, db = state
        bc = lax.dynamic_slice_in_dim(b, i * chunk, chunk)
        p = jnp.exp(a @ bc.T - lse[:, None]) * g[:, None]
        return da + p @ bc, lax.dynamic_update_slice_in_dim(db, p.T @ a, i * chunk, 0)

    return lax.fori_loop(0, steps, body, (jnp.zeros_like(a), jnp.zeros_like(b)))


def hand_nadaraya_watson(q, xs, ys, chunk):
    import jax.numpy as jnp
    from jax import lax
    steps = xs.shape[0] // chunk

    def body(i, state):
        m, s, acc = state
        xc, yc = lax.dynamic_slice_in_dim(xs, i * chunk, chunk), lax.dynamic_slice_in_dim(ys, i * chunk, chunk)
        x = -jnp.sum((q[:, None, :] - xc[None, :, :]) ** 2, axis=-1)
        m_new = jnp.maximum(m, jnp.max(x, axis=1))
        scale = jnp.exp(m - m_new)
        e = jnp.exp(x - m_new[:, None])
        return m_new, s * scale + jnp.sum(e, axis=1), acc * scale[:, None] + e @ yc

    n = q.shape[0]
    init = (jnp.full((n,), -jnp.inf, q.dtype), jnp.zeros((n,), q.dtype), jnp.zeros((n, ys.shape[1]), q.dtype))
    _, s, acc = lax.fori_loop(0, steps, body, init)
    return acc / s[:, None]


def hand_linear_attention(q, k, v, chunk):
    import jax.numpy as jnp
    from jax import lax
    L, d = q.shape
    qs, ks, vs = (t.reshape(L // chunk, chunk, d) for t in (q, k, v))

    def step(state, qkv):
        qc, kc, vc = qkv
        s = state[None] + jnp.cumsum(kc[:, :, None] * vc[:, None, :], axis=0)
        return s[-1], jnp.sum(qc[:, :, None] * s, axis=1)

    _, out = lax.scan(step, jnp.zeros((d, d), q.dtype), (qs, ks, vs))
    return out.reshape(L, d)


def hand_linear_attention_grad(q, k, v, chunk):
    import jax
    import jax.numpy as jnp
    return jax.grad(lambda *a: jnp.sum(hand_linear_attention(*a, chunk) ** 2), argnums=(0, 1, 2))(q, k, v)


def decoding(q, k, v):
    import jax
    return jax.nn.dot_product_attention(q, k, v)


def hand_decoding(q, k, v, chunk):
    import jax.numpy as jnp
    from jax import lax
    scale = 1.0 / float(q.shape[-1]) ** 0.5
    qv = q[0, 0, 0] * scale
    steps = k.shape[1] // chunk

    def body(i, state):
        m, s, acc = state
        kc = lax.dynamic_slice_in_dim(k[0, :, 0], i * chunk, chunk)
        vc = lax.dynamic_slice_in_dim(v[0, :, 0], i * chunk, chunk)
        x = kc @ qv
        m_new = jnp.maximum(m, jnp.max(x))
        rescale = jnp.exp(m - m_new)
        e = jnp.exp(x - m_new)
        return m_new, s * rescale + jnp.sum(e), acc * rescale + e @ vc

    init = (jnp.float32(-jnp.inf), jnp.float32(0), jnp.zeros(v.shape[-1], v.dtype))
    _, s, acc = lax.fori_loop(0, steps, body, init)
    return (acc / s).reshape(q.shape)


def program(row: str, tiny: bool):
    """``(plain function, hand function, inputs, threshold)`` of ``row``."""
    import functools

    import jax
    import jax.numpy as jnp
    _, full, small, threshold, tiny_threshold = ROWS[row]
    sizes, threshold = (small, tiny_threshold) if tiny else (full, threshold)
    budget = parse_size(threshold, "threshold")
    keys = [jax.random.PRNGKey(i) for i in range(3)]
    if row.startswith("contrastive") or row == "nadaraya_watson":
        n, m, d = sizes["n"], sizes["m"], sizes["d"]
        a, b = jax.random.normal(keys[0], (n, d)), jax.random.normal(keys[1], (m, d))
        chunk = _chunk(m, 4 * n * max(1, d if row == "nadaraya_watson" else 1), budget)
        if row == "contrastive":
            return contrastive, functools.partial(hand_lse, chunk=chunk), (a, b), threshold
        if row == "contrastive_grad":
            return contrastive_grad, functools.partial(hand_contrastive_grad, chunk=chunk), (a, b), threshold
        ys = jax.random.normal(keys[2], (m, 2))
        return nadaraya_watson, functools.partial(hand_nadaraya_watson, chunk=chunk), (a, b, ys), threshold
    if row == "decoding":
        S, H = sizes["S"], sizes["H"]
        q = jax.random.normal(keys[0], (1, 1, 1, H))
        k, v = (jax.random.normal(key, (1, S, 1, H)) for key in keys[1:])
        chunk = _chunk(S, 4 * H, budget)
        return decoding, functools.partial(hand_decoding, chunk=chunk), (q, k, v), threshold
    L, d = sizes["L"], sizes["d"]
    q, k, v = (0.1 * jax.random.normal(key, (L, d)) for key in keys)
    chunk = _chunk(L, 4 * d * d * 2, budget)
    if row == "linear_attention":
        return linear_attention, functools.partial(hand_linear_attention, chunk=chunk), (q, k, v), threshold
    return linear_attention_grad, functools.partial(hand_linear_attention_grad, chunk=chunk), (q, k, v), threshold


def own_largest(module, args, outs) -> int:
    """The largest op result (loop bodies included, loops' carried state aside) that does not have the
    dimensions of an argument or a result (their transposes, converts, the buffers they are written to)."""
    import jax

    from hlopass import stablehlo

    def key(dims):
        return tuple(sorted(int(d) for d in dims if int(d) != 1))

    shapes = {key(np.shape(a)) for a in jax.tree_util.tree_leaves((args, outs))}
    sizes = [t.nbytes for t in stablehlo.all_tensors(module)
             if not t.loop_result and key(t.type[len("tensor<"):].split("x")[:-1]) not in shapes]
    return max(sizes, default=0)


def measure(row: str, column: str, tiny: bool, repeats: int) -> dict:
    """Lower, compile and run one column of one row in this process."""
    import jax

    import hlopass
    plain, hand, args, threshold = program(row, tiny)
    result = {"row": row, "column": column, "status": "ok", "threshold": parse_size(threshold, "threshold")}
    try:
        with harness.stopwatch() as clock:
            if column == "hlopass":
                f = hlopass.jit(plain, passes="split", threshold=threshold, split_size=threshold)
                lowered = f.lower(*args)
                result["splits"] = [r.summary for r in lowered.report.rewrites if r.kind == "split"]
            else:
                lowered = jax.jit(plain if column == "plain" else hand).lower(*args)
            module = lowered.compiler_ir("stablehlo")
            compiled = lowered.compile()
        result["compile_seconds"] = clock.seconds
        result["xla_temp_bytes"] = harness.temp_bytes(compiled)
        timing = harness.time_call(functools.partial(compiled, *args), repeats)
        out = timing.out
        result["median_seconds"] = timing.median
        result["median_cpu_seconds"] = timing.median_cpu  # every thread's CPU time: steadier under load
        result["own_largest_bytes"] = own_largest(module, args, out)
        result["io_bytes"] = max(int(np.asarray(x).nbytes) for x in jax.tree_util.tree_leaves((args, out)))
        result["sample"] = harness.sample(out, SAMPLE)
    except Exception as err:  # noqa: BLE001 - reported, the parent decides
        result.update(status="failed", error=harness.short_error(err))
    return result


def side_by_side(names: list[str], tiny: bool, repeats: int) -> list[dict]:
    """hlopass and the hand loop of each row compiled in this process and called in turns, ``repeats``
    times each: median process CPU time (every thread) and wall time, and their ratio."""
    import jax

    import hlopass
    rows = []
    for name in names:
        plain, hand, args, threshold = program(name, tiny)
        compiled = {"hlopass": hlopass.jit(plain, passes="split", threshold=threshold, split_size=threshold)
                    .lower(*args).compile(), "hand": jax.jit(hand).lower(*args).compile()}
        timings = harness.time_calls({k: functools.partial(fn, *args) for k, fn in compiled.items()}, repeats,
                                     label=name)
        row = {"row": name, **{f"{k}_cpu_seconds": t.median_cpu for k, t in timings.items()},
               **{f"{k}_wall_seconds": t.median for k, t in timings.items()}}
        row["hlopass_over_hand_cpu"] = row["hlopass_cpu_seconds"] / row["hand_cpu_seconds"]
        print(f"{name:24s} CPU hlopass {row['hlopass_cpu_seconds']:.3g} s, hand {row['hand_cpu_seconds']:.3g} s, "
              f"ratio {row['hlopass_over_hand_cpu']:.2f} (wall {row['hlopass_wall_seconds']:.3g} s, "
              f"{row['hand_wall_seconds']:.3g} s)", flush=True)
        rows.append(row)
    return rows


def bounds(row: dict) -> tuple[bool, bool]:
    """(own largest within 1.5x the split size, temp within 3x split + 2x io)."""
    split = row["threshold"]
    return (row["own_largest_bytes"] <= 1.5 * split,
            row["xla_temp_bytes"] <= 3 * split + 2 * row["io_bytes"])


def table(rows: list[dict]) -> str:
    by = {(r["row"], r["column"]): r for r in rows}
    lines = ["| program | threshold | plain `jax.jit`: largest, temp, time | hlopass: largest, temp, time | "
             "by hand: largest, temp, time | hlopass / plain time | hlopass / hand time | max rel. diff |",
             "|---|---|---|---|---|---|---|---|"]

    def cell(r):
        if r is None:
            return "-"
        if r["status"] != "ok":
            return r.get("error", r["status"])[:60]
        return (f"{format_size(r['own_largest_bytes'])}, {format_size(r['xla_temp_bytes'])}, "
                f"{r['median_seconds']:.3g} s")

    for name in dict.fromkeys(r["row"] for r in rows):
        plain, ours, hand = (by.get((name, c)) for c in COLUMNS)
        ok = all(x is not None and x["status"] == "ok" for x in (plain, ours))
        ratio = f"{ours['median_seconds'] / plain['median_seconds']:.2f}" if ok else "-"
        ratio_hand = (f"{ours['median_seconds'] / hand['median_seconds']:.2f}"
                      if ok and hand is not None and hand["status"] == "ok" else "-")
        diff = harness.sample_difference(ours.get("sample"), plain.get("sample"), finite=True) if ok else None
        lines.append(f"| {ROWS[name][0]} | {format_size(ours['threshold']) if ours else '-'} | {cell(plain)} | "
                     f"{cell(ours)} | {cell(hand)} | {ratio} | {ratio_hand} | "
                     f"{'-' if diff is None else f'{diff:.1e}'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", help=f"comma-separated subset of: {', '.join(ROWS)}")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls after the warm-up")
    parser.add_argument("--cap", default="12GB", help="address-space cap per child")
    parser.add_argument("--tiny", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--json", help="write the rows here (default tools/results/online.json; tiny: none)")
    parser.add_argument("--side-by-side", action="store_true",
                        help="hlopass and the hand loop in one process, called in turns: CPU time and its ratio")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        row, column = args.child.split(":")
        harness.report_result(measure(row, column, args.tiny, args.repeats))
        return 0
    names = args.rows.split(",") if args.rows else list(ROWS)
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; accepted: {', '.join(ROWS)}")
    if args.side_by_side:
        rows = side_by_side(names, args.tiny, args.repeats)
        harness.write_json(args.json, {"side_by_side": rows}, indent=1)
        return 0
    rows = []
    for name, column in harness.progress([(n, c) for n in names for c in COLUMNS], "bench_online"):
        argv_child = harness.module_argv("bench_online", "--child", f"{name}:{column}", "--repeats",
                                         str(args.repeats), *(["--tiny"] if args.tiny else []))
        result = harness.run_capped(argv_child, parse_size(args.cap, "cap"))
        result.setdefault("row", name)
        result.setdefault("column", column)
        result.setdefault("threshold", parse_size(ROWS[name][4 if args.tiny else 3], "threshold"))
        rows.append(result)
        print(f"{name:24s} {column:8s} {result.get('status')} "
              f"own largest {format_size(result.get('own_largest_bytes', 0))} "
              f"temp {format_size(result.get('xla_temp_bytes', 0))} "
              f"time {result.get('median_seconds', float('nan')):.3g} s "
              f"(CPU {result.get('median_cpu_seconds', float('nan')):.3g} s) {result.get('error', '')}", flush=True)
    print(table(rows))
    failures = []
    for r in rows:
        if r["column"] == "hlopass":
            if r["status"] != "ok":
                failures.append(f"{r['row']}: {r.get('error', r['status'])}")
                continue
            largest_ok, temp_ok = bounds(r)
            if not (largest_ok and temp_ok):
                failures.append(f"{r['row']}: own largest {format_size(r['own_largest_bytes'])}, "
                                f"temp {format_size(r['xla_temp_bytes'])} over the bounds")
    path = args.json or (None if args.tiny else os.path.join(harness.RESULTS, "online.json"))
    harness.write_json(path, {"rows": harness.without(rows, "sample"), "table": table(rows), "failures": failures},
                       indent=1)
    for line in failures:
        print("BOUND FAILED:", line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
