"""Attention forward + backward at long sequence (issue 16): hlopass against plain jax.jit and hand chunking.

    python -m tools.bench_attention [--seq 16384] [--heads 8] [--head-dim 64] [--causal] [--threshold 32MB]
                                    [--repeats R] [--cap 16GB] [--run-limit 6GB] [--tiny] [--json PATH]

The program is ``jax.vjp`` of ``jax.nn.dot_product_attention(q, k, v)`` (batch 1, its XLA implementation)
applied to a fixed cotangent: the attention output and the gradients w.r.t. ``q``, ``k`` and ``v`` in one
program. Columns, each in its own child process under an address-space cap:

* ``plain``: ``jax.jit`` of the program as written. Its XLA temp comes from
  ``.lower().compile().memory_analysis()``; it is run only when that temp is at most ``--run-limit``
  (at sequence 16,384 one score tensor is 8.6 GB: it is compiled and measured, not run);
* ``hlopass``: ``hlopass.jit(passes="split")`` of the same program, split size = threshold;
* ``flash``: by hand, a ``custom_vjp`` online-softmax loop over key blocks (``fori_loop`` carrying the
  running maximum, sum and weighted sum; the backward a second loop over key blocks recomputing the
  probabilities from the saved logsumexp, as in FlashAttention);
* ``map``: by hand, ``lax.map`` over query blocks of ``jax.checkpoint(dot_product_attention)`` against
  all keys (the backward recomputes each block's scores).

Both hand columns use blocks whose scores fit the threshold (the hlopass split size). Reported per column:
the largest tensor the program builds for itself (as in ``tools.bench_online``), XLA temp, compile
time and median run time (wall clock, and process CPU time), ratios against the plain and hand columns,
and the largest difference relative to the largest magnitude: against ``plain`` when it ran, else
against ``flash``. The hlopass column must keep its own largest tensor within 1.5x the split size and XLA
temp within 3x the split size plus the bytes of all arguments and results (four inputs and four results
of one size here; the hand columns need as much) (exit status 1 otherwise).
Writes JSON (``tools/results/attention.json`` by default; ``--tiny``: none unless ``--json``).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

from hlopass.sizes import format_size, parse_size
from tools import harness
from tools.bench_online import SAMPLE, own_largest

COLUMNS = ("plain", "hlopass", "flash", "map")
TITLES = {"plain": "plain `jax.jit`", "hlopass": "hlopass", "flash": "by hand: online loop (custom_vjp)",
          "map": "by hand: `lax.map` + `jax.checkpoint`"}
FULL = dict(seq=16_384, heads=8, head_dim=64, threshold="32MB")
TINY = dict(seq=1_024, heads=2, head_dim=8, threshold="64kB")


# -- the program as written --------------------------------------------------------------------

def attention(q, k, v, causal=False):
    import jax
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal)


def forward_backward(q, k, v, ct, causal=False):
    """The attention output and the gradients w.r.t. ``q``, ``k``, ``v`` for the cotangent ``ct``."""
    import jax
    out, vjp = jax.vjp(functools.partial(attention, causal=causal), q, k, v)
    return out, vjp(ct)


# -- by hand: an online-softmax loop over key blocks (FlashAttention's forward and backward) -----

def _flash_attention(causal: bool, chunk: int):
    import jax
    import jax.numpy as jnp
    from jax import lax

    def scores(q, kb, start):
        s = jnp.einsum("bqnh,bknh->bnqk", q, kb)
        if causal:
            rows = lax.broadcasted_iota(jnp.int32, s.shape[-2:], 0)
            cols = lax.broadcasted_iota(jnp.int32, s.shape[-2:], 1) + start
            s = jnp.where(cols <= rows, s, -jnp.inf)
        return s

    def forward(q, k, v):
        b, t, n, h = q.shape
        q = q * (1.0 / h ** 0.5)
        steps = k.shape[1] // chunk

        def body(i, state):
            m, l, acc = state
            kb, vb = (lax.dynamic_slice_in_dim(x, i * chunk, chunk, 1) for x in (k, v))
            s = scores(q, kb, i * chunk)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            shift = jnp.where(jnp.isfinite(m_new), m_new, 0)
            p = jnp.exp(s - shift[..., None])
            scale = jnp.exp(jnp.where(jnp.isfinite(m), m, 0) - shift)
            return m_new, l * scale + jnp.sum(p, -1), acc * scale[..., None] + jnp.einsum("bnqk,bknh->bnqh", p, vb)

        init = (jnp.full((b, n, t), -jnp.inf, q.dtype), jnp.zeros((b, n, t), q.dtype), jnp.zeros((b, n, t, h), q.dtype))
        m, l, acc = lax.fori_loop(0, steps, body, init)
        out = jnp.einsum("bnqh->bqnh", acc / l[..., None])
        return out, jnp.where(jnp.isfinite(m), m, 0) + jnp.log(l)

    @jax.custom_vjp
    def flash(q, k, v):
        return forward(q, k, v)[0]

    def fwd(q, k, v):
        out, lse = forward(q, k, v)
        return out, (q, k, v, out, lse)

    def bwd(res, g):
        q, k, v, out, lse = res
        h = q.shape[-1]
        scale = 1.0 / h ** 0.5
        qs = q * scale
        delta = jnp.einsum("bqnh,bqnh->bnq", g, out)
        steps = k.shape[1] // chunk

        def body(i, state):
            dq, dk, dv = state
            kb, vb = (lax.dynamic_slice_in_dim(x, i * chunk, chunk, 1) for x in (k, v))
            p = jnp.exp(scores(qs, kb, i * chunk) - lse[..., None])
            dv = lax.dynamic_update_slice_in_dim(dv, jnp.einsum("bnqk,bqnh->bknh", p, g), i * chunk, 1)
            ds = p * (jnp.einsum("bqnh,bknh->bnqk", g, vb) - delta[..., None])
            dq = dq + jnp.einsum("bnqk,bknh->bqnh", ds, kb) * scale
            dk = lax.dynamic_update_slice_in_dim(dk, jnp.einsum("bnqk,bqnh->bknh", ds, qs), i * chunk, 1)
            return dq, dk, dv

        return lax.fori_loop(0, steps, body, (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)))

    flash.defvjp(fwd, bwd)
    return flash


def hand_flash(q, k, v, ct, causal=False, chunk=64):
    import jax
    out, vjp = jax.vjp(_flash_attention(causal, chunk), q, k, v)
    return out, vjp(ct)


# -- by hand: lax.map over query blocks, each block checkpointed ----------------------------------

def hand_map(q, k, v, ct, causal=False, chunk=64):
    import jax
    import jax.numpy as jnp
    from jax import lax

    def blocked(q, k, v):
        b, t, n, h = q.shape
        blocks = jnp.moveaxis(q.reshape(b, t // chunk, chunk, n, h), 1, 0)

        @jax.checkpoint
        def block(args):
            start, qb = args
            if not causal:
                return jax.nn.dot_product_attention(qb, k, v)
            rows = start + lax.broadcasted_iota(jnp.int32, (chunk, k.shape[1]), 0)
            cols = lax.broadcasted_iota(jnp.int32, (chunk, k.shape[1]), 1)
            return jax.nn.dot_product_attention(qb, k, v, mask=(cols <= rows)[None, None])

        outs = lax.map(block, (jnp.arange(t // chunk, dtype=jnp.int32) * chunk, blocks))
        return jnp.moveaxis(outs, 0, 1).reshape(b, t, n, h)

    out, vjp = jax.vjp(blocked, q, k, v)
    return out, vjp(ct)


# -- measuring --------------------------------------------------------------------------------------

def _chunk(total: int, per_unit: int, budget: int) -> int:
    """The largest divisor of ``total`` whose block (``per_unit`` bytes a unit) fits ``budget``."""
    return max((c for c in range(1, total + 1) if total % c == 0 and c * per_unit <= budget), default=1)


def inputs(seq: int, heads: int, head_dim: int):
    import jax
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    return tuple(jax.random.normal(key, (1, seq, heads, head_dim)) for key in keys)


def measure(column: str, sizes: dict, causal: bool, repeats: int, run_limit: int) -> dict:
    """Lower, compile (and, unless plain would not fit, run) one column in this process."""
    import jax
    import numpy as np

    import hlopass
    args = inputs(sizes["seq"], sizes["heads"], sizes["head_dim"])
    threshold = sizes["threshold"]
    budget = parse_size(threshold, "threshold")
    chunk = _chunk(sizes["seq"], 4 * sizes["heads"] * sizes["seq"], budget)
    result = {"column": column, "status": "ok", "threshold": budget, "chunk": chunk}
    program = functools.partial(forward_backward, causal=causal)
    try:
        with harness.stopwatch() as clock:
            if column == "hlopass":
                lowered = hlopass.jit(program, passes="split", threshold=threshold, split_size=threshold).lower(*args)
                result["splits"] = [r.summary for r in lowered.report.rewrites if r.kind == "split"]
            else:
                fn = {"plain": program, "flash": functools.partial(hand_flash, causal=causal, chunk=chunk),
                      "map": functools.partial(hand_map, causal=causal, chunk=chunk)}[column]
                lowered = jax.jit(fn).lower(*args)
            module = lowered.compiler_ir("stablehlo")
            compiled = lowered.compile()
        result["compile_seconds"] = clock.seconds
        result["xla_temp_bytes"] = harness.temp_bytes(compiled)
        out_shapes = jax.eval_shape(program, *args)
        result["io_bytes"] = max(int(np.prod(x.shape)) * x.dtype.itemsize
                                 for x in jax.tree_util.tree_leaves((args, out_shapes)))
        result["all_io_bytes"] = sum(int(np.prod(x.shape)) * x.dtype.itemsize
                                     for x in jax.tree_util.tree_leaves((args, out_shapes)))
        result["own_largest_bytes"] = own_largest(module, args, out_shapes)
        if result["xla_temp_bytes"] > run_limit:
            result["status"] = "not run"
            result["error"] = (f"not run: XLA temp {format_size(result['xla_temp_bytes'])} over the run limit "
                               f"{format_size(run_limit)}")
            return result
        timing = harness.time_call(functools.partial(compiled, *args), repeats)
        result["median_seconds"] = timing.median
        result["median_cpu_seconds"] = timing.median_cpu
        result["sample"] = harness.sample(timing.out, SAMPLE)
    except Exception as err:  # noqa: BLE001 - reported, the parent decides
        result.update(status="failed", error=harness.short_error(err))
    return result


def attention_bounds(row: dict) -> tuple[bool, bool]:
    """(own largest within 1.5x the split size, XLA temp within 3x the split size plus the bytes of every
    argument and result: the loops hold a transposed copy of an input or a result's buffer each)."""
    split = row["threshold"]
    return (row["own_largest_bytes"] <= 1.5 * split, row["xla_temp_bytes"] <= 3 * split + row["all_io_bytes"])


def table(rows: list[dict], title: str) -> str:
    """One line per column: largest, temp, time, ratios and the difference from the reference."""
    by = {r["column"]: r for r in rows}
    ours = by.get("hlopass")
    reference = next((c for c in ("plain", "flash") if by.get(c, {}).get("status") == "ok"), None)
    lines = [f"{title}", "",
             "| column | largest own tensor | XLA temp | compile | time (wall) | time (CPU) | hlopass / this (wall) "
             f"| max rel. diff from {reference or '-'} |",
             "|---|---|---|---|---|---|---|---|"]
    for column in COLUMNS:
        r = by.get(column)
        if r is None:
            continue
        if "xla_temp_bytes" not in r:
            lines.append(f"| {TITLES[column]} | {r.get('error', r['status'])[:80]} | | | | | | |")
            continue
        ran = r["status"] == "ok"
        ratio = (f"{ours['median_seconds'] / r['median_seconds']:.2f}"
                 if ran and ours is not None and ours.get("status") == "ok" else "-")
        diff = (harness.sample_difference(r.get("sample"), by[reference].get("sample"), finite=True)
                if ran and reference and column != reference else None)
        time_cell = f"{r['median_seconds']:.3g} s" if ran else r.get("error", r["status"])
        cpu_cell = f"{r['median_cpu_seconds']:.3g} s" if ran else "-"
        lines.append(f"| {TITLES[column]} | {format_size(r['own_largest_bytes'])} | {format_size(r['xla_temp_bytes'])} "
                     f"| {r['compile_seconds']:.3g} s | {time_cell} | "
                     f"{cpu_cell} | {ratio} | "
                     f"{'-' if diff is None else f'{diff:.1e}'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, help=f"sequence length (default {FULL['seq']})")
    parser.add_argument("--heads", type=int, help=f"heads (default {FULL['heads']})")
    parser.add_argument("--head-dim", type=int, help=f"head dimension (default {FULL['head_dim']})")
    parser.add_argument("--threshold", help=f"threshold and split size (default {FULL['threshold']})")
    parser.add_argument("--causal", action="store_true", help="is_causal=True")
    parser.add_argument("--columns", help=f"comma-separated subset of: {', '.join(COLUMNS)}")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls after the warm-up")
    parser.add_argument("--cap", default="16GB", help="address-space cap per child")
    parser.add_argument("--run-limit", default="6GB", help="plain runs only when its XLA temp is at most this")
    parser.add_argument("--tiny", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--json", help="write the rows here (default tools/results/attention.json; tiny: none)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = dict(TINY if args.tiny else FULL)
    for name in ("seq", "heads", "head_dim", "threshold"):
        if getattr(args, name) is not None:
            sizes[name] = getattr(args, name)
    parse_size(sizes["threshold"], "--threshold")
    run_limit = parse_size(args.run_limit, "--run-limit")
    if args.child:
        harness.report_result(measure(args.child, sizes, args.causal, args.repeats, run_limit))
        return 0
    columns = args.columns.split(",") if args.columns else list(COLUMNS)
    unknown = [c for c in columns if c not in COLUMNS]
    if unknown:
        parser.error(f"unknown columns {unknown}; accepted: {', '.join(COLUMNS)}")
    title = (f"attention forward + backward, batch 1, sequence {sizes['seq']:,}, {sizes['heads']} heads, head dim "
             f"{sizes['head_dim']}{', causal' if args.causal else ''}; threshold = split size {sizes['threshold']}")
    print(title, flush=True)
    flags = ["--seq", str(sizes["seq"]), "--heads", str(sizes["heads"]), "--head-dim", str(sizes["head_dim"]),
             "--threshold", str(sizes["threshold"]), "--repeats", str(args.repeats), "--run-limit", args.run_limit]
    rows = []
    for column in harness.progress(columns, "bench_attention"):
        argv_child = harness.module_argv("bench_attention", "--child", column, *flags,
                                         *(["--causal"] if args.causal else []))
        result = harness.run_capped(argv_child, parse_size(args.cap, "--cap"), timeout=3600)
        result.setdefault("column", column)
        result.setdefault("threshold", parse_size(sizes["threshold"], "threshold"))
        rows.append(result)
        print(f"{column:8s} {result.get('status')} own largest {format_size(result.get('own_largest_bytes', 0))} "
              f"temp {format_size(result.get('xla_temp_bytes', 0))} compile {result.get('compile_seconds', 0):.3g} s "
              f"time {result.get('median_seconds', float('nan')):.3g} s "
              f"(CPU {result.get('median_cpu_seconds', float('nan')):.3g} s) {result.get('error', '')}", flush=True)
    text = table(rows, title)
    print(text)
    failures = []
    ours = next((r for r in rows if r["column"] == "hlopass"), None)
    if ours is not None:
        if ours["status"] != "ok":
            failures.append(f"hlopass: {ours.get('error', ours['status'])}")
        elif not all(attention_bounds(ours)):
            failures.append(f"hlopass: own largest {format_size(ours['own_largest_bytes'])}, "
                            f"temp {format_size(ours['xla_temp_bytes'])} over the bounds")
    path = args.json or (None if args.tiny else os.path.join(harness.RESULTS, "attention.json"))
    harness.write_json(path, {"sizes": sizes, "causal": args.causal, "rows": harness.without(rows, "sample"),
                              "table": text, "failures": failures}, indent=1)
    for line in failures:
        print("BOUND FAILED:", line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
