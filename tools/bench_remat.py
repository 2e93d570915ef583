"""The remat pass against plain ``jax.jit`` and ``jax.checkpoint`` by hand (issue 17).

    python -m tools.bench_remat [--layers 64] [--width 512] [--batch 2048] [--limit 300MB]
                                [--programs loop,scan] [--repeat 5] [--tiny] [--json PATH]
    python -m tools.bench_remat --programs transformer --layers 4 --width 256 --batch 2048 --limit auto

``jax.grad`` of a deep tanh MLP (``x = tanh(x @ w)`` per layer, loss ``sum(x ** 2)``, float32, no
``jax.checkpoint`` in the code), with its layers in a Python loop (``loop``) and in ``lax.scan``
(``scan``); or of pre-norm single-head Transformer blocks in a Python loop (``transformer``:
``--width`` is the model width, ``--batch`` the sequence length). Side by side in one process, for
each program: the gradient under

- ``plain``: ``jax.jit`` of the code as written;
- ``hlopass``: ``hlopass.jit`` of the same code with ``memory_limit`` (the remat pass chooses what
  to recompute; its compile time includes the closed loop's compilations);
- ``ckpt every layer``: ``jax.jit`` with ``jax.checkpoint`` on every layer by hand (on the scan
  body for the scan);
- ``ckpt every sqrt(n)``: ``jax.checkpoint`` on blocks of ``round(sqrt(n))`` layers by hand (a scan
  of checkpointed inner scans for the scan).

Each column: XLA's footprint (``memory_analysis``: temporaries + arguments + outputs), whether it
is within the limit, the first call of a fresh function object (trace, passes, compile and one run,
what a user waits for; under ``hlopass.jit`` that compile is also the memory check) and that less the
best call, the compile time (``trace``, ``lower``, ``compile`` ahead of time, where hlopass's passes
check their programs themselves), the best of several calls (after a warm-up, inputs on the
device; the columns' calls interleaved round by round, the order rotating, so a shared machine's load
hits them alike),
the time relative to plain, and the largest difference from plain's gradient relative to that
gradient's largest entry. The table is printed; ``--json`` writes the rows. For the hlopass column a
line says where its compile went (:func:`compile_stages`: each pass, and XLA compiling the rewritten
program and the program as written, each alone).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import hlopass
from hlopass import internals as jx
from hlopass.memory import measure
from hlopass.sizes import format_size, parse_size
from tools import harness


def layer(x, w):
    return jnp.tanh(x @ w)


def loop_loss(ws, x):
    for w in ws:
        x = layer(x, w)
    return jnp.sum(x ** 2)


def scan_loss(ws, x):
    x, _ = lax.scan(lambda x, w: (layer(x, w), None), x, ws)
    return jnp.sum(x ** 2)


def loop_every(ws, x):
    for w in ws:
        x = jax.checkpoint(layer)(x, w)
    return jnp.sum(x ** 2)


def scan_every(ws, x):
    x, _ = lax.scan(jax.checkpoint(lambda x, w: (layer(x, w), None)), x, ws)
    return jnp.sum(x ** 2)


def block_size(n: int) -> int:
    return max(1, round(math.sqrt(n)))


def loop_sqrt(ws, x):
    k = block_size(len(ws))

    @jax.checkpoint
    def block(x, group):
        for w in group:
            x = layer(x, w)
        return x

    for start in range(0, len(ws), k):
        x = block(x, ws[start:start + k])
    return jnp.sum(x ** 2)


def scan_sqrt(ws, x):
    n = ws.shape[0]
    k = block_size(n)
    whole, rest = divmod(n, k)

    @jax.checkpoint
    def block(x, group):
        x, _ = lax.scan(lambda x, w: (layer(x, w), None), x, group)
        return x, None

    x, _ = lax.scan(block, x, ws[:whole * k].reshape(whole, k, *ws.shape[1:]))
    if rest:
        x, _ = block(x, ws[whole * k:])
    return jnp.sum(x ** 2)


def layer_norm(x):
    x = x - jnp.mean(x, axis=-1, keepdims=True)
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5)


def block(x, p):
    """A pre-norm Transformer block: single-head attention and an MLP, residual stream ``[seq, d]``."""
    wq, wk, wv, wo, w1, w2 = p
    h = layer_norm(x)
    q, k, v = h @ wq, h @ wk, h @ wv
    a = jax.nn.softmax(q @ k.T / np.sqrt(q.shape[-1]), axis=-1)
    x = x + (a @ v) @ wo
    return x + jax.nn.gelu(layer_norm(x) @ w1) @ w2


def transformer_loss(params, x):
    for p in params:
        x = block(x, p)
    return jnp.mean(layer_norm(x) * x)


def transformer_every(params, x):
    for p in params:
        x = jax.checkpoint(block)(x, p)
    return jnp.mean(layer_norm(x) * x)


def transformer_sqrt(params, x):
    k = block_size(len(params))

    @jax.checkpoint
    def group(x, ps):
        for p in ps:
            x = block(x, p)
        return x

    for start in range(0, len(params), k):
        x = group(x, params[start:start + k])
    return jnp.mean(layer_norm(x) * x)


def mlp_inputs(layers: int, width: int, batch: int):
    rng = np.random.default_rng(0)
    ws = (1.5 / np.sqrt(width) * rng.standard_normal((layers, width, width))).astype(np.float32)
    x = rng.standard_normal((batch, width)).astype(np.float32)
    return jax.device_put(ws), jax.device_put(x)


def transformer_inputs(layers: int, width: int, seq: int):
    rng = np.random.default_rng(0)
    s, out = 1 / np.sqrt(width), 1 / np.sqrt(width) / np.sqrt(2 * layers)
    shapes = [((width, width), s)] * 3 + [((width, width), out), ((width, 2 * width), s), ((2 * width, width), out)]
    params = [tuple(jax.device_put((scale * rng.standard_normal(shape)).astype(np.float32)) for shape, scale in shapes)
              for _ in range(layers)]
    return params, jax.device_put(rng.standard_normal((seq, width)).astype(np.float32))


#: key: (title, loss, checkpoint on every layer, on every sqrt(n)-th, inputs(layers, width, batch))
PROGRAMS = {
    "loop": ("layers in a Python loop", loop_loss, loop_every, loop_sqrt,
             lambda *a: (lambda ws, x: (list(ws), x))(*mlp_inputs(*a))),
    "scan": ("layers in lax.scan", scan_loss, scan_every, scan_sqrt, mlp_inputs),
    "transformer": ("Transformer blocks", transformer_loss, transformer_every, transformer_sqrt, transformer_inputs),
}


def run_program(key: str, layers: int, width: int, batch: int, limit: int | None, repeat: int,
                threshold: str | None = None) -> list[dict]:
    """The four columns of one program; ``limit=None``: arguments, outputs and 60% of plain's temporaries;
    ``threshold``: hlopass's split threshold (``None``: its default; ``"off"``: no splitting)."""
    title, loss, every, sqrt_n, inputs = PROGRAMS[key]
    params, x = inputs(layers, width, batch)
    if limit is None:
        before = measure(jax.jit(jax.grad(loss)).lower(params, x).compile())
        limit = before.argument_bytes + before.output_bytes + int(0.6 * before.temp_bytes)
    columns = [
        ("plain", lambda: jax.jit(jax.grad(loss))),
        ("hlopass", lambda: hlopass.jit(jax.grad(loss), memory_limit=limit,
                                        **({} if threshold is None else {"threshold": threshold}))),
        ("ckpt every layer", lambda: jax.jit(jax.grad(every))),
        (f"ckpt every {block_size(layers)}", lambda: jax.jit(jax.grad(sqrt_n))),
    ]
    # the first call of a fresh function object (trace, passes, compile, run: what a user waits for;
    # under hlopass.jit its compile is also the memory check), before the stages below
    first_calls = {}
    for name, make in columns:
        fn = make()
        with harness.stopwatch() as clock:
            jax.block_until_ready(fn(params, x))
        first_calls[name] = clock.seconds
    built = []
    for name, make in columns:
        fn = make()
        with harness.stopwatch() as clock:
            traced = fn.trace(params, x)
            lowered = traced.lower()
            compiled = lowered.compile()
        stages = None
        if name == "hlopass":
            check = lowered.memory_check
            notes = [str(r) for p in traced.report.passes for r in (*p.rewrites, *p.skipped)]
            stages = compile_stages(traced)
            print(f"  {key:5s} hlopass compile: passes " + ", ".join(f"{k} {v:.2f} s" for k, v in stages["passes"].items()
                                                                    if v >= 0.005)
                  + f"; XLA alone: the rewritten program {stages['rewritten_alone_s']:.2f} s, the program as written "
                    f"{stages['original_alone_s']:.2f} s", flush=True)
        else:
            check, notes = measure(compiled), []
        built.append((name, compiled, check, notes, clock.seconds, stages))
    # a warm-up call each, then calls interleaved round by round, best of each column
    timings = harness.time_calls({name: functools.partial(compiled, params, x) for name, compiled, *_ in built},
                                 repeat)
    best = {name: timing.best for name, timing in timings.items()}
    rows, want = [], timings["plain"].out
    for name, compiled, check, notes, compile_seconds, stages in built:
        seconds, got = best[name], timings[name].out
        rows.append(dict(program=key, title=title, column=name, layers=layers, width=width, batch=batch,
                         limit_bytes=limit, footprint_bytes=check.footprint, temp_bytes=check.temp_bytes,
                         threshold=threshold, fits=check.footprint <= limit, compile_seconds=compile_seconds,
                         first_call_seconds=first_calls[name], first_call_less_run=first_calls[name] - seconds,
                         seconds=seconds,
                         ratio_to_plain=seconds / best["plain"], max_rel_diff=harness.relative_difference(got, want), notes=notes,
                         compile_stages=stages))
        print(f"  {key:5s} {name:18s} footprint {format_size(check.footprint):>10s} "
              f"{'fits' if check.footprint <= limit else 'OVER'}  compile {compile_seconds:6.1f} s  "
              f"first call {first_calls[name]:6.2f} s (less a call {first_calls[name] - seconds:5.2f} s)  "
              f"best {seconds:8.4f} s  x{seconds / best['plain']:5.2f}  diff {rows[-1]['max_rel_diff']:.1e}",
              flush=True)
    return rows


def compile_stages(traced) -> dict:
    """Where the hlopass column's compile goes: each pass's seconds (``passes``; the split's includes
    compiling its program once to check it against the limit), and XLA compiling the rewritten program
    and the program as written, each alone (``rewritten_alone_s``, ``original_alone_s``): the floor
    under hlopass's compile, which compiles the rewritten program once to check it and once to run."""
    def alone(closed) -> float:
        lowered = jax.jit(jx.jaxpr_as_fun(closed)).lower(*closed.in_avals)
        with harness.stopwatch() as clock:
            lowered.compile()
        return clock.seconds

    return dict(passes={p.name: p.seconds for p in traced.report.passes},
                rewritten_alone_s=alone(traced.rewritten_jaxpr), original_alone_s=alone(traced.original_jaxpr))


def markdown(rows: list[dict]) -> str:
    out = ["| program | column | footprint / limit | compile | first call (less a call) | best call | vs plain "
           "| max rel. diff |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fits = "" if r["fits"] else " (over)"
        out.append(f"| {r['title']} | {r['column']} | {format_size(r['footprint_bytes'])} / "
                   f"{format_size(r['limit_bytes'])}{fits} | "
                   f"{r['compile_seconds']:.1f} s | {r['first_call_seconds']:.2f} s ({r['first_call_less_run']:.2f} s) | "
                   f"{r['seconds']:.3g} s | {r['ratio_to_plain']:.2f}x | "
                   f"{r['max_rel_diff']:.1e} |")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--limit", default="300MB",
                        help="memory limit (hlopass's size forms), or 'auto': arguments, outputs and 60%% of "
                             "plain's temporaries")
    parser.add_argument("--programs", default="loop,scan")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threshold", help="hlopass's split threshold (default: its own; 'off': no splitting)")
    parser.add_argument("--tiny", action="store_true", help="8 layers, width 32, batch 256, limit auto, 2 rounds")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if args.tiny:
        args.layers, args.width, args.batch, args.limit, args.repeat = 8, 32, 256, "auto", 2
    limit = None if args.limit == "auto" else parse_size(args.limit, "--limit")
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} cores; "
          f"{args.layers} layers, width {args.width}, batch {args.batch}, limit {format_size(limit) if limit else 'auto'}", flush=True)
    rows = []
    for key in args.programs.split(","):
        rows += run_program(key.strip(), args.layers, args.width, args.batch, limit, args.repeat, args.threshold)
    print(markdown(rows))
    if args.json:
        meta = dict(jax=jax.__version__, platform=jax.devices()[0].platform, cores=os.cpu_count(),
                    machine=platform.machine(),
                    command=" ".join(["python", "-m", "tools.bench_remat", *(argv or sys.argv[1:])]))
        harness.write_json(args.json, dict(meta=meta, rows=rows), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
