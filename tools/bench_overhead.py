"""What hlopass costs on top of jax.jit: trace, passes against XLA's compile, first call, and the cost
of a repeated call; on a 1,000-equation forward program and a gradient of about the same size.

    python -m tools.bench_overhead [--equations 1000] [--tiny] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import timeit

import jax
import jax.numpy as jnp

import hlopass
from hlopass.jaxpr_utils import count_equations
from hlopass.pipeline import run_pipeline
from tools import harness


def long_program(equations: int):
    """An elementwise/matmul program with about ``equations`` equations."""
    def f(x, w):
        for i in range(equations // 4):
            x = jnp.tanh(x @ w) * 0.5 + x
        return x.sum()
    return f


def mlp_gradient(equations: int):
    """The gradient of a residual tanh MLP, about ``equations`` equations (11 per layer)."""
    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w) + x
        return jnp.mean(x ** 2)
    return jax.grad(loss)


def best_of(fn, repeat: int = 3) -> float:
    """The best of ``repeat`` calls of ``fn()`` (no separate warm-up: each call makes its own function)."""
    return harness.time_call(fn, repeat, warmup=False).best


def measure(make, n_eqns: int, args, config) -> dict:
    """Trace, passes and XLA compile times (best of 3; fresh functions each time, as jax caches
    traces per function object) and each tool's first call."""
    closed = jax.make_jaxpr(make(n_eqns))(*args)
    trace_s = best_of(lambda: jax.make_jaxpr(make(n_eqns))(*args))
    pass_s = max(best_of(lambda: run_pipeline(jax.make_jaxpr(make(n_eqns))(*args), config)) - trace_s, 0.0)
    lower_s = best_of(lambda: jax.jit(make(n_eqns)).lower(*args))
    compile_s = max(best_of(lambda: jax.jit(make(n_eqns)).lower(*args).compile()) - lower_s, 1e-9)
    first_jax = best_of(lambda: jax.block_until_ready(jax.jit(make(n_eqns))(*args)), 1)
    first_hlo = best_of(lambda: jax.block_until_ready(hlopass.jit(make(n_eqns))(*args)), 1)
    return {"equations": count_equations(closed), "trace_s": trace_s, "passes_s": pass_s,
            "xla_compile_s": compile_s, "passes_over_xla_compile": pass_s / compile_s,
            "first_call_jax_jit_s": first_jax, "first_call_hlopass_s": first_hlo}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--equations", type=int, default=1000)
    parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke run")
    parser.add_argument("--json", help="write the figures here")
    options = parser.parse_args(argv)
    n_eqns = 40 if options.tiny else options.equations
    config = hlopass.resolve_config()
    layers = max(n_eqns // 11, 1)
    programs = {
        "forward": (long_program, (jnp.ones((8, 16)), jnp.eye(16) * 0.1)),
        "gradient": (mlp_gradient, ([jnp.eye(32) * 0.1] * layers, jnp.ones((16, 32)))),
    }
    figures = {"default_passes": list(config.pass_names), "programs": {}}
    print(f"passes: {', '.join(config.pass_names) or 'none'}")
    for name, (make, args) in programs.items():
        row = measure(make, n_eqns, args, config)
        figures["programs"][name] = row
        print(f"{name} program, {row['equations']} equations")
        print(f"  trace to jaxpr          {row['trace_s'] * 1e3:8.1f} ms")
        print(f"  all passes              {row['passes_s'] * 1e3:8.1f} ms")
        print(f"  XLA compile (jax.jit)   {row['xla_compile_s'] * 1e3:8.1f} ms   "
              f"passes / compile {row['passes_over_xla_compile']:.0%}")
        print(f"  first call, jax.jit     {row['first_call_jax_jit_s'] * 1e3:8.1f} ms")
        print(f"  first call, hlopass.jit {row['first_call_hlopass_s'] * 1e3:8.1f} ms   "
              f"ratio {row['first_call_hlopass_s'] / row['first_call_jax_jit_s']:.2f}")

    small = lambda a: a * 2 + 1  # noqa: E731
    a = jnp.ones(16)
    plain, ours = jax.jit(small), hlopass.jit(small)
    plain(a), ours(a)
    number = 200 if options.tiny else 5000
    recall_jax = statistics.median(timeit.repeat(lambda: plain(a), number=number, repeat=5)) / number
    recall_hlo = statistics.median(timeit.repeat(lambda: ours(a), number=number, repeat=5)) / number

    figures["recall_jax_jit_us"] = recall_jax * 1e6
    figures["recall_hlopass_us"] = recall_hlo * 1e6
    print(f"  repeated call, jax.jit     {figures['recall_jax_jit_us']:6.1f} us")
    print(f"  repeated call, hlopass.jit {figures['recall_hlopass_us']:6.1f} us   ratio {recall_hlo / recall_jax:.2f}")
    harness.write_json(options.json, figures)
    return figures


if __name__ == "__main__":
    main()
