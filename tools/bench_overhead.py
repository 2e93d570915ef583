"""What hlopass costs on top of jax.jit: trace, passes, first call, and the cost of a repeated call.

    python tools/bench_overhead.py [--equations 1000] [--tiny] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import timeit

import jax
import jax.numpy as jnp

import hlopass
from hlopass.jaxpr_utils import count_equations
from hlopass.pipeline import run_pipeline


def long_program(equations: int):
    """An elementwise/matmul program with about ``equations`` equations."""
    def f(x, w):
        for i in range(equations // 4):
            x = jnp.tanh(x @ w) * 0.5 + x
        return x.sum()
    return f


def best_of(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--equations", type=int, default=1000)
    parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke run")
    parser.add_argument("--json", help="write the figures here")
    options = parser.parse_args(argv)
    n_eqns = 40 if options.tiny else options.equations
    f = long_program(n_eqns)
    x, w = jnp.ones((8, 16)), jnp.eye(16) * 0.1

    closed = jax.make_jaxpr(f)(x, w)
    # Fresh functions each time: jax caches traces per function object.
    trace_s = best_of(lambda: jax.make_jaxpr(long_program(n_eqns))(x, w))
    config = hlopass.resolve_config()
    pass_s = best_of(lambda: run_pipeline(jax.make_jaxpr(long_program(n_eqns))(x, w), config)) - trace_s
    first_jax = best_of(lambda: jax.jit(long_program(n_eqns))(x, w).block_until_ready(), 1)
    first_hlo = best_of(lambda: hlopass.jit(long_program(n_eqns))(x, w).block_until_ready(), 1)

    small = lambda a: a * 2 + 1  # noqa: E731
    a = jnp.ones(16)
    plain, ours = jax.jit(small), hlopass.jit(small)
    plain(a), ours(a)
    number = 200 if options.tiny else 5000
    recall_jax = statistics.median(timeit.repeat(lambda: plain(a), number=number, repeat=5)) / number
    recall_hlo = statistics.median(timeit.repeat(lambda: ours(a), number=number, repeat=5)) / number

    figures = {
        "equations": count_equations(closed),
        "default_passes": list(config.pass_names),
        "trace_s": trace_s,
        "passes_s": max(pass_s, 0.0),
        "first_call_jax_jit_s": first_jax,
        "first_call_hlopass_s": first_hlo,
        "recall_jax_jit_us": recall_jax * 1e6,
        "recall_hlopass_us": recall_hlo * 1e6,
    }
    print(f"program with {figures['equations']} equations; passes: {', '.join(config.pass_names) or 'none'}")
    print(f"  trace to jaxpr          {trace_s * 1e3:8.1f} ms")
    print(f"  all passes              {figures['passes_s'] * 1e3:8.1f} ms")
    print(f"  first call, jax.jit     {first_jax * 1e3:8.1f} ms")
    print(f"  first call, hlopass.jit {first_hlo * 1e3:8.1f} ms   ratio {first_hlo / first_jax:.2f}")
    print(f"  repeated call, jax.jit     {figures['recall_jax_jit_us']:6.1f} us")
    print(f"  repeated call, hlopass.jit {figures['recall_hlopass_us']:6.1f} us   ratio {recall_hlo / recall_jax:.2f}")
    if options.json:
        with open(options.json, "w") as handle:
            json.dump(figures, handle, indent=2)
    return figures


if __name__ == "__main__":
    main()
