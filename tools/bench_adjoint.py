"""The adjoint pass against plain ``jax.grad``, hand checkpointing and the remat pass (adjoint sharding).

    python -m tools.bench_adjoint [--contexts 32768 131072 524288] [--layers 4] [--width 256] [--state 16]
                                  [--repeat 2] [--cap 4GB] [--capped-from 524288] [--timeout 3600]
                                  [--tiny] [--python-loop] [--json tools/results/adjoint.json]

The gradient of a stack of diagonal selective-SSM layers (Mamba-like: per channel and state entry a
decay ``a_t = exp(-softplus(x_t W_dt) A)``, input ``b_t = x_t W_b``, readout ``c_t = x_t W_c``, a
residual ``tanh``) under a language-model loss (cross-entropy of the last layer's output against
next-token targets over a small vocabulary), float32. Columns, each compiled ahead of time in a child
process of its own (``--timeout`` seconds at most):

- ``plain``: ``jax.jit(jax.grad(loss))`` as written;
- ``ckpt sqrt(T)``: ``jax.checkpoint`` by hand on blocks of about sqrt(T) steps (a nested scan);
- ``remat``: ``hlopass.jit`` with ``passes="remat"`` and a memory limit of a tenth of plain's temp;
- ``adjoint``: ``hlopass.jit`` with ``passes="adjoint"``;
- ``sharded``: the adjoint pass with the time axis split over 4 host devices
  (``AdjointPass(sequence_axis="x")``, its child started with ``--xla_force_host_platform_device_count=4``):
  its temp is one device's, to set beside the ``adjoint`` column's;
- ``sharded2``: the same with two levels of checkpointing in each device's rows
  (``AdjointPass(sequence_axis="x", levels=2)``: a fraction of the boundary states, one more forward pass).

Each row: XLA temp (``compile().memory_analysis()``), compile seconds, and the call's seconds when it
runs: a column runs when its temp fits in a third of the machine's memory, or always under the cap
(where running out of memory is the result, said as ``status: failed`` and the error); from ``--long-from``
tokens on (default 131072) one call is timed without a warm-up (an ahead-of-time compiled program's
first call on the CPU is not slower), below it ``--repeat`` calls after a warm-up, the median. From
``--capped-from`` tokens on (default 524288) ``plain`` and ``adjoint`` run under an address-space cap
(``ulimit -v``, ``--cap``, default 4 GB) and the other columns are only compiled. Gradients are compared
on evenly spaced samples of every leaf against plain's, or the checkpointed column's where plain does
not run (``max_rel_diff_vs_*``, each leaf against its own largest sample).

``--python-loop`` writes each layer's recurrence as a Python loop over the time steps (``ys.append``,
then ``jnp.stack``; hand checkpointing: ``jax.checkpoint`` on each block of steps): a chain of T steps
per layer, no scan, as a user who never learnt ``lax.scan`` writes it. Its results go to
``tools/results/adjoint_loop.json``; tracing T steps per layer limits it to contexts of thousands.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import time

VOCAB = 64
SAMPLES = 256
COLUMNS = ("plain", "ckpt", "remat", "adjoint", "sharded", "sharded2")
SHARDS = 4


def init(key, layers: int, width: int, state: int):
    import jax
    import jax.numpy as jnp
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
    import jax
    import jax.numpy as jnp
    dt = jax.nn.softplus(x @ p["w_dt"])                       # (D,)
    a = jnp.exp(-dt[:, None] * p["a"])                        # (D, N) input-dependent decay
    h = a * h + (dt * x)[:, None] * (x @ p["w_b"])[None, :]
    return h, h @ (x @ p["w_c"])                              # (D,)


def python_loop(step, h, xs):
    """``lax.scan(step, h, xs)`` written as a Python loop (it traces to a chain of T steps)."""
    import jax.numpy as jnp
    ys = []
    for t in range(xs.shape[0]):
        h, y = step(h, xs[t])
        ys.append(y)
    return h, jnp.stack(ys)


def ssm_layer(p, xs, block: int | None = None, loop: bool = False):
    import jax
    import jax.numpy as jnp
    from jax import lax
    h0 = jnp.zeros(p["a"].shape, xs.dtype)
    step = lambda h, x: layer_step(p, h, x)  # noqa: E731
    if loop:            # checkpointing by hand: each block of steps under jax.checkpoint
        if block is None:
            return python_loop(step, h0, xs)[1]
        inner = jax.checkpoint(lambda h, xb: python_loop(step, h, xb))
        h, ys = h0, []
        for i in range(0, xs.shape[0], block):
            h, y = inner(h, xs[i:i + block])
            ys.append(y)
        return jnp.concatenate(ys)
    if block is None:
        return lax.scan(step, h0, xs)[1]
    T = xs.shape[0]
    inner = jax.checkpoint(lambda h, xb: lax.scan(step, h, xb))
    return lax.scan(inner, h0, xs.reshape(T // block, block, -1))[1].reshape(T, -1)


def make_loss(block=None, loop=False):
    import jax
    import jax.numpy as jnp

    def loss(params, emb, tokens):
        x = emb[tokens[:-1]]
        for p in params:
            x = x + jnp.tanh(ssm_layer(p, x, block, loop))
        logits = x @ emb.T
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[1:, None], 1))
    return loss


def _block(T: int) -> int:
    k = 2 ** round(math.log2(math.sqrt(T)))
    while T % k:
        k //= 2
    return max(k, 1)


def column_name(column: str, T: int) -> str:
    return f"ckpt sqrt(T) ({_block(T)} steps)" if column == "ckpt" else column


def build(column: str, T: int, limit: int | None, loop: bool = False):
    """The jitted gradient of ``column`` at context ``T`` (``loop``: layers written as Python loops)."""
    import jax

    import hlopass
    grad = jax.grad(make_loss(loop=loop), argnums=(0, 1))
    if column == "plain":
        return jax.jit(grad)
    if column == "ckpt":
        return jax.jit(jax.grad(make_loss(_block(T), loop), argnums=(0, 1)))
    if column == "remat":
        return hlopass.jit(grad, passes="remat", memory_limit=limit)
    if column == "adjoint":
        return hlopass.jit(grad, passes="adjoint")
    if column in ("sharded", "sharded2"):
        from hlopass.passes.adjoint import AdjointPass
        mesh = jax.make_mesh((SHARDS,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
        levels = 2 if column == "sharded2" else None
        return hlopass.jit(grad, passes=[AdjointPass(sequence_axis="x", mesh=mesh, levels=levels)])
    raise ValueError(column)


def child(column: str, T: int, layers: int, width: int, state: int, repeat: int, run: bool, warmup: bool,
          limit: int | None, loop: bool = False) -> dict:
    """One column at one context (in a child process): temp, compile and call seconds, sampled gradients."""
    import jax

    from hlopass.config import device_memory_bytes
    from hlopass.sizes import format_size
    from tools import harness
    params, emb = init(jax.random.key(0), layers, width, state)
    tokens = jax.random.randint(jax.random.key(1), (T + 1,), 0, VOCAB)
    args = (params, emb, tokens)
    row: dict = dict(column=column_name(column, T), context=T, status="ok")
    fn = build(column, T, limit, loop)
    try:
        _, compiled, compile_s = harness.compile_timed(fn, args)
    except Exception as err:  # noqa: BLE001 - a column that cannot compile is a row that says so
        row.update(status="failed", error=harness.short_error(err))
        return row
    temp = harness.temp_bytes(compiled)
    row.update(temp_bytes=temp, temp=format_size(temp), compile_s=round(compile_s, 3))
    if limit is not None:
        row["memory_limit"] = format_size(limit)
    if column in ("adjoint", "remat", "sharded", "sharded2"):
        row["report"] = [str(r) for r in fn.trace(*args).report.rewrites]
    budget = device_memory_bytes() // 3
    capped = resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY
    if not run or (temp > budget and not capped):   # under a cap the attempt is safe: it is the result
        row.update(seconds=None, note="compiled only" if not run else f"not run: temp over {format_size(budget)}")
        return row
    try:
        if warmup:
            harness.block(compiled(*args))
        times, out = [], None
        for _ in range(max(repeat, 1)):
            out, wall, _ = harness.timed(lambda: compiled(*args))
            times.append(wall)
    except Exception as err:  # noqa: BLE001 - out of memory under the cap is a result
        row.update(status="failed", seconds=None, error=harness.short_error(err))
        return row
    row.update(seconds=sorted(times)[len(times) // 2], calls=len(times), warmup=warmup,
               sample=harness.sample(out, SAMPLES))
    return row


def run(T: int, a, cap: int | None) -> list[dict]:
    """Every column at context ``T``, each in a child process."""
    from tools import harness
    long = T >= a.long_from
    capped = cap is not None and T >= a.capped_from
    rows: dict[str, dict] = {}
    limit = None
    for column in a.columns:
        if column == "remat":
            plain_temp = rows.get("plain", {}).get("temp_bytes")
            limit = max(plain_temp // 10, 1 << 20) if plain_temp else None
        runs = not capped or column in ("plain", "adjoint", "sharded", "sharded2")
        flags = ["--child", column, "--contexts", str(T), "--layers", str(a.layers), "--width", str(a.width),
                 "--state", str(a.state), "--repeat", str(1 if long else a.repeat)]
        flags += ([] if runs else ["--compile-only"]) + ([] if not long else ["--no-warmup"])
        flags += ["--limit", str(limit)] if column == "remat" and limit else []
        flags += ["--python-loop"] if a.python_loop else []
        started = time.perf_counter()
        sharded = column in ("sharded", "sharded2")
        env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={SHARDS}"} if sharded else None
        result = harness.run_capped(harness.module_argv("bench_adjoint", *flags),
                                    cap if capped and runs else None, timeout=a.timeout, env=env)
        result.setdefault("column", column_name(column, T))
        result.setdefault("context", T)
        result["child_seconds"] = round(time.perf_counter() - started, 1)
        if capped and runs:
            result["cap"] = a.cap
        rows[column] = result
        print(f"| {T} | {result['column']} | {result.get('status')} | temp {result.get('temp', '-')} | "
              f"compile {result.get('compile_s', '-')} s | {result.get('seconds') or '-'} s | "
              f"{result.get('error', result.get('note', ''))[:80]} |", flush=True)
    one = rows.get("adjoint", {})
    for many in (rows.get("sharded", {}), rows.get("sharded2", {})):
        if one.get("temp_bytes") and many.get("temp_bytes"):
            many["temp_vs_adjoint"] = round(many["temp_bytes"] / one["temp_bytes"], 3)
            if one.get("seconds") and many.get("seconds"):
                many["seconds_vs_adjoint"] = round(many["seconds"] / one["seconds"], 3)
    ref = next((c for c in ("plain", "ckpt", "adjoint") if rows.get(c, {}).get("sample")), "plain")
    for column, row in rows.items():
        want = rows.get(ref, {}).get("sample")
        row["max_rel_diff_vs_" + ref] = harness.sample_difference(row.get("sample"), want) if want else None
    return [harness.without([row], "sample")[0] for row in rows.values()]


def main(argv=None):
    from hlopass.sizes import parse_size
    from tools import harness
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072, 524288])
    ap.add_argument("--columns", nargs="+", default=list(COLUMNS), choices=COLUMNS)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--state", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--long-from", type=int, default=131072)
    ap.add_argument("--capped-from", type=int, default=524288)
    ap.add_argument("--cap", default="4GB")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--tiny", action="store_true", help="seconds-long smoke run (contexts 256 and 512, width 16)")
    ap.add_argument("--python-loop", action="store_true",
                    help="each layer's recurrence written as a Python loop (a chain of T steps, no scan); "
                         "results to adjoint_loop.json unless --json is given")
    ap.add_argument("--json")
    ap.add_argument("--child", choices=COLUMNS, help=argparse.SUPPRESS)
    ap.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-warmup", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--limit", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        harness.report_result(child(a.child, a.contexts[0], a.layers, a.width, a.state, a.repeat,
                                    not a.compile_only, not a.no_warmup, a.limit, a.python_loop))
        return
    if a.tiny:
        a.contexts, a.layers, a.width, a.state, a.repeat = [256, 512], 2, 16, 4, 1
        a.capped_from, a.long_from = 512, 512
    rows = []
    for T in a.contexts:
        rows += run(T, a, parse_size(a.cap, "--cap"))
    import jax
    default = "adjoint_loop.json" if a.python_loop else "adjoint.json"
    harness.write_json(a.json or os.path.join(harness.RESULTS, default), dict(
        python_loop=a.python_loop, layers=a.layers, width=a.width, state=a.state, device=jax.devices()[0].device_kind,
                                    cores=os.cpu_count(), load_average=list(os.getloadavg()), rows=rows), indent=1)


if __name__ == "__main__":
    main()
