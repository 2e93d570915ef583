"""The adjoint pass against plain ``jax.grad``, hand checkpointing and the remat pass (adjoint sharding).

    python -m tools.bench_adjoint [--contexts 32768 131072] [--layers 4] [--width 256] [--state 16]
                                  [--repeat 3] [--tiny] [--json tools/results/adjoint.json]

The gradient of a stack of diagonal selective-SSM layers (Mamba-like: per channel and state entry a
decay ``a_t = exp(-softplus(x_t W_dt) A)``, input ``b_t = x_t W_b``, readout ``c_t = x_t W_c``, a
residual ``tanh``) under a language-model-like loss (cross-entropy of the last layer's output against
next-token targets over a small vocabulary), float32. Columns, each compiled ahead of time:

- ``plain``: ``jax.jit(jax.grad(loss))`` as written;
- ``ckpt sqrt(T)``: ``jax.checkpoint`` by hand on blocks of about sqrt(T) steps (a nested scan);
- ``remat``: ``hlopass.jit`` with ``passes="remat"`` and a memory limit of a tenth of plain's temp;
- ``adjoint``: ``hlopass.jit`` with ``passes="adjoint"``.

Each: XLA temp (``compile().memory_analysis()``), compile time, median call time after a warm-up
(skipped when the temp would not fit in a third of the machine's memory), and the largest gradient
difference relative to the reference's largest entry (plain's, or the checkpointed column's where plain
does not run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hlopass  # noqa: E402
from hlopass.config import device_memory_bytes  # noqa: E402
from hlopass.sizes import format_size  # noqa: E402

VOCAB = 64


def init(key, layers: int, width: int, state: int):
    ks = jax.random.split(key, 5 * layers + 2)
    params = []
    for i in range(layers):
        k = ks[5 * i:5 * i + 5]
        params.append(dict(w_dt=0.05 * jax.random.normal(k[0], (width, width)),
                           a=jnp.exp(0.5 * jax.random.normal(k[1], (width, state))),
                           w_b=0.1 * jax.random.normal(k[2], (width, state)),
                           w_c=0.1 * jax.random.normal(k[3], (width, state))))
    emb = 0.1 * jax.random.normal(ks[-1], (VOCAB, width))
    return params, emb


def layer_step(p, h, x):
    dt = jax.nn.softplus(x @ p["w_dt"])                       # (D,)
    a = jnp.exp(-dt[:, None] * p["a"])                        # (D, N) input-dependent decay
    h = a * h + (dt * x)[:, None] * (x @ p["w_b"])[None, :]
    return h, h @ (x @ p["w_c"])                              # (D,)


def ssm_layer(p, xs, block: int | None = None):
    h0 = jnp.zeros(p["a"].shape, xs.dtype)
    step = lambda h, x: layer_step(p, h, x)  # noqa: E731
    if block is None:
        return lax.scan(step, h0, xs)[1]
    T = xs.shape[0]
    inner = jax.checkpoint(lambda h, xb: lax.scan(step, h, xb))
    return lax.scan(inner, h0, xs.reshape(T // block, block, -1))[1].reshape(T, -1)


def make_loss(block=None):
    def loss(params, emb, tokens):
        x = emb[tokens[:-1]]
        for p in params:
            x = x + jnp.tanh(ssm_layer(p, x, block))
        logits = x @ emb.T
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[1:, None], 1))
    return loss


def _block(T: int) -> int:
    k = 2 ** round(math.log2(math.sqrt(T)))
    while T % k:
        k //= 2
    return max(k, 1)


def column(name, fn, args, repeat, budget):
    start = time.perf_counter()
    compiled = fn.lower(*args).compile()
    compile_s = time.perf_counter() - start
    temp = int(compiled.memory_analysis().temp_size_in_bytes)
    row = dict(column=name, temp_bytes=temp, temp=format_size(temp), compile_s=round(compile_s, 3))
    if temp > budget:
        row.update(seconds=None, note=f"not run: temp over {format_size(budget)}")
        return row, None
    grads = jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    row["seconds"] = statistics.median(times)
    return row, grads


def _rel(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return max(float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30)) for x, y in zip(la, lb))


def run(T, layers, width, state, repeat):
    params, emb = init(jax.random.key(0), layers, width, state)
    tokens = jax.random.randint(jax.random.key(1), (T + 1,), 0, VOCAB)
    args = (params, emb, tokens)
    budget = device_memory_bytes() // 3
    grad = jax.grad(make_loss(), argnums=(0, 1))
    rows, grads = [], {}
    row, grads["plain"] = column("plain", jax.jit(grad), args, repeat, budget)
    rows.append(row)
    k = _block(T)
    row, grads["ckpt"] = column(f"ckpt sqrt(T) ({k} steps)", jax.jit(jax.grad(make_loss(k), argnums=(0, 1))), args,
                                repeat, budget)
    rows.append(row)
    limit = max(rows[0]["temp_bytes"] // 10, 1 << 20)
    row, grads["remat"] = column("remat", hlopass.jit(grad, passes="remat", memory_limit=limit), args, repeat, budget)
    row["memory_limit"] = format_size(limit)
    rows.append(row)
    adj = hlopass.jit(grad, passes="adjoint")
    row, grads["adjoint"] = column("adjoint", adj, args, repeat, budget)
    row["report"] = [str(r) for r in adj.trace(*args).report.rewrites]
    rows.append(row)
    ref_name = "plain" if grads["plain"] is not None else "ckpt"
    for r, key in zip(rows, ("plain", "ckpt", "remat", "adjoint")):
        r["context"] = T
        r["max_rel_diff_vs_" + ref_name] = (None if grads[key] is None or grads[ref_name] is None
                                            else _rel(grads[key], grads[ref_name]))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072, 524288])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--state", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="seconds-long smoke run (context 256, width 16)")
    ap.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                   "adjoint.json"))
    a = ap.parse_args(argv)
    if a.tiny:
        a.contexts, a.layers, a.width, a.state, a.repeat = [256], 2, 16, 4, 1
    rows = []
    for T in a.contexts:
        for r in run(T, a.layers, a.width, a.state, a.repeat):
            rows.append(r)
            secs = "-" if r["seconds"] is None else f"{r['seconds']:.3f} s"
            diff = {k: v for k, v in r.items() if k.startswith("max_rel_diff")}
            print(f"| {T} | {r['column']} | temp {r['temp']} | compile {r['compile_s']} s | {secs} | {diff} |",
                  flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(dict(layers=a.layers, width=a.width, state=a.state, device=jax.devices()[0].device_kind,
                       rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
