"""``python -m hlopass.inspection.demo``: a program that dies under plain ``jax.jit`` and runs under ``hlopass.jit``.

The example is the squared-exponential kernel matrix-vector product written
the naive way (:func:`kernel_matvec`, below): ``exp(-|x_i - y_j|^2 / 2) @ v``
with a broadcast difference, so ``jax.jit`` builds an ``n x n`` kernel (and an
``n x n x 3`` difference before fusion). Each run happens in a child process
whose address space is capped (``ulimit -v``, i.e. ``RLIMIT_AS``), so the
machine is never at risk:

1. plain ``jax.jit`` under the cap: fails with ``RESOURCE_EXHAUSTED``;
2. the same function under ``hlopass.jit`` (default settings, no code
   change) under the same cap: finishes;
3. its numbers are checked on sampled rows against plain ``jax.jit`` run on
   just those rows and against a float64 NumPy reference.

A short table follows: XLA's memory figure, the child's peak RSS, time, and
what hlopass rewrote where. Options: ``--n``, ``--cap``, ``--json PATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

DEFAULT_N = 40_000
DEFAULT_CAP = "3GB"
DIMENSIONS = 3
SAMPLED_ROWS = 16
RESULT_MARKER = "HLOPASS_DEMO_RESULT "
CHILD_TIMEOUT_S = 600


# -- the example -------------------------------------------------------------------------------

def kernel_matvec(x, y, v):
    """``K(x, y) @ v`` with the squared-exponential kernel, naive broadcast distance."""
    import jax.numpy as jnp
    diff = x[:, None, :] - y[None, :, :]
    return jnp.exp(-0.5 * jnp.sum(diff ** 2, axis=-1)) @ v


def example_function():
    """The demo's program: :func:`kernel_matvec`, as a user would write it."""
    return kernel_matvec


def example_inputs(n: int, seed: int = 0):
    """``x, y`` (n x 3 points in a box) and ``v`` (n weights), float32."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-3.0, 3.0, size=(n, DIMENSIONS)).astype(np.float32)
    y = rng.uniform(-3.0, 3.0, size=(n, DIMENSIONS)).astype(np.float32)
    v = rng.standard_normal(n).astype(np.float32)
    return x, y, v


def reference_rows(x, y, v, rows) -> np.ndarray:
    """``K(x[rows], y) @ v`` in float64 NumPy."""
    diff = x[rows, None, :].astype(np.float64) - y[None, :, :].astype(np.float64)
    return np.exp(-0.5 * np.sum(diff ** 2, axis=-1)) @ v.astype(np.float64)


def relative_error(value, reference) -> float:
    """``max |value - reference| / max |reference|``."""
    value, reference = np.asarray(value, np.float64), np.asarray(reference, np.float64)
    return float(np.max(np.abs(value - reference)) / max(np.max(np.abs(reference)), 1e-300))


# -- running under a cap ---------------------------------------------------------------------

def capped_command(argv: list[str], cap_bytes: int | None) -> list[str]:
    """``python argv...`` behind ``ulimit -v`` (in a shell, so nothing runs in Python between fork and exec)."""
    command = [sys.executable, *argv]
    if cap_bytes is None:
        return command
    return ["/bin/sh", "-c", f'ulimit -v {max(cap_bytes // 1024, 1)} && exec "$@"', "hlopass-capped", *command]


def run_capped(argv: list[str], cap_bytes: int | None, timeout: float = CHILD_TIMEOUT_S,
               env: dict | None = None) -> dict:
    """Run ``python argv...`` in a child under an address-space cap; return the JSON it reports.

    The child prints one line ``RESULT_MARKER + json``. A child that dies without
    one (a crash, a signal, the timeout) gives ``{"status": "crashed", ...}``.
    """
    child_env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    start = time.perf_counter()
    try:
        done = subprocess.run(capped_command(argv, cap_bytes), capture_output=True, text=True, timeout=timeout,
                              env=child_env)
    except subprocess.TimeoutExpired as err:
        said = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) else (err.stderr or "")
        last = " | ".join(said.strip().splitlines()[-3:])
        return {"status": "timeout", "error": f"no result after {timeout:.0f} s" + (f"; last said: {last}" if last else "")}
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            result = json.loads(line[len(RESULT_MARKER):])
            result.setdefault("process_seconds", time.perf_counter() - start)
            return result
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return {"status": "crashed", "returncode": done.returncode,
            "error": " | ".join(tail) or f"exit code {done.returncode}",
            "process_seconds": time.perf_counter() - start}


def peak_rss_bytes() -> int:
    """This process's peak resident memory since it started its program: Linux's ``VmHWM``, which
    starts afresh at ``exec``. (``ru_maxrss`` keeps the peak of the process it was forked from: a
    child of a pytest worker that had grown to 5.9 GB reported 5.9 GB under a 4 GB cap.)"""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024   # bytes on macOS, kB elsewhere


def report_result(result: dict) -> None:
    """Print the child's result line (read by :func:`run_capped`)."""
    result["peak_rss_bytes"] = peak_rss_bytes()
    print(RESULT_MARKER + json.dumps(result, default=str), flush=True)


def short_error(err: BaseException) -> str:
    """The first line of an error that says what ran out (``RESOURCE_EXHAUSTED: ...``)."""
    text = f"{type(err).__name__}: {err}"
    for line in text.splitlines():
        if "RESOURCE_EXHAUSTED" in line or "Out of memory" in line or "MemoryError" in line:
            return line.strip()[:200]
    return text.splitlines()[0][:200]


# -- the child ---------------------------------------------------------------------------------

def child_main(mode: str, n: int, seed: int) -> None:
    """Run the example with ``mode`` ("plain" or "hlopass") and report the result."""
    import jax

    import hlopass

    fun = example_function()
    x, y, v = example_inputs(n, seed)
    rows = np.random.default_rng(seed + 1).choice(n, SAMPLED_ROWS, replace=False)
    result: dict = {"mode": mode, "n": n, "status": "ok"}
    function = jax.jit(fun) if mode == "plain" else hlopass.jit(fun)
    try:
        start = time.perf_counter()
        lowered = function.lower(x, y, v)
        if mode == "hlopass":
            result["rewrites"] = [str(r) for r in lowered.report.rewrites]
            result["passes"] = list(lowered.config.pass_names)
        compiled = lowered.compile()
        result["compile_seconds"] = time.perf_counter() - start
        result["xla_temp_bytes"] = int(compiled.memory_analysis().temp_size_in_bytes)
        start = time.perf_counter()
        out = np.asarray(jax.block_until_ready(compiled(x, y, v)))
        result["run_seconds"] = time.perf_counter() - start
    except Exception as err:  # noqa: BLE001 - the failure is the result
        result.update(status="failed", error=short_error(err))
        report_result(result)
        return
    reference = reference_rows(x, y, v, rows)
    plain_rows = np.asarray(jax.jit(fun)(x[rows], y, v))
    result["error_vs_float64"] = relative_error(out[rows], reference)
    result["error_vs_plain_rows"] = relative_error(out[rows], plain_rows)
    result["plain_rows_error_vs_float64"] = relative_error(plain_rows, reference)
    report_result(result)


# -- the parent --------------------------------------------------------------------------------

def split_pass_available() -> bool:
    """Whether the splitting pass the demo relies on is registered."""
    import hlopass
    return "split" in hlopass.available_passes()


def run_demo(n: int = DEFAULT_N, cap: str = DEFAULT_CAP, seed: int = 0, echo=None) -> dict:
    """Run both children and return ``{"plain": ..., "hlopass": ..., "rescued": bool}``."""
    from hlopass.sizes import format_size, parse_size
    echo = echo or (lambda line: print(line, flush=True))
    cap_bytes = parse_size(cap, "--cap")
    dense, naive = n * n * 4, n * n * DIMENSIONS * 4
    echo(f"hlopass demo: K(x, y) @ v with the squared-exponential kernel, naive broadcast distance "
         f"(hlopass/inspection/demo.py:kernel_matvec), n = {n:,}, d = {DIMENSIONS}, float32.")
    echo(f"  dense kernel {format_size(dense)}, naive (n, n, d) difference {format_size(naive)}; "
         f"each run in a child process capped at {format_size(cap_bytes)} of address space (ulimit -v).")
    results = {}
    for mode, title in (("plain", "plain jax.jit"), ("hlopass", "hlopass.jit")):
        echo(f"  running {title} in a capped child process ...")
        results[mode] = run_capped(["-m", "hlopass.inspection.demo", "--child", mode, "--n", str(n), "--seed", str(seed)],
                                   cap_bytes)
        outcome = results[mode]
        echo(f"    {outcome['status']} after {outcome.get('process_seconds', 0):.1f} s"
             + (f": {outcome['error']}" if outcome.get("error") else ""))
    results["rescued"] = (results["plain"]["status"] != "ok" and results["hlopass"]["status"] == "ok"
                          and results["hlopass"].get("error_vs_float64", 1.0) < 1e-4)
    results.update(n=n, cap_bytes=cap_bytes)
    return results


def format_table(results: dict) -> str:
    """The demo's summary table (markdown)."""
    from hlopass.sizes import format_size

    def cell_time(r, key):
        return f"{r[key]:.2f} s" if key in r else "-"

    lines = ["| | plain jax.jit | hlopass.jit |", "|---|---|---|"]
    plain, ours = results["plain"], results["hlopass"]
    rows = [
        ("outcome", lambda r: "ok" if r["status"] == "ok" else f"{r['status']}: {r.get('error', '')}"),
        ("XLA temp memory", lambda r: format_size(r["xla_temp_bytes"]) if "xla_temp_bytes" in r else "-"),
        ("peak RSS of the process", lambda r: format_size(r.get("peak_rss_bytes")) if r.get("peak_rss_bytes") else "-"),
        ("compile time", lambda r: cell_time(r, "compile_seconds")),
        ("run time", lambda r: cell_time(r, "run_seconds")),
        ("max rel. error vs float64 (sampled rows)", lambda r: f"{r['error_vs_float64']:.1e}" if "error_vs_float64" in r else "-"),
        ("max rel. error vs plain jax.jit on those rows", lambda r: f"{r['error_vs_plain_rows']:.1e}" if "error_vs_plain_rows" in r else "-"),
    ]
    for title, cell in rows:
        lines.append(f"| {title} | {cell(plain)} | {cell(ours)} |")
    lines.append("")
    rewrites = ours.get("rewrites") or []
    lines.append(f"what hlopass rewrote (passes: {', '.join(ours.get('passes', [])) or 'none'}):")
    lines.extend(f"  {r}" for r in rewrites) if rewrites else lines.append("  nothing")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hlopass.inspection.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=DEFAULT_N, help=f"points (default {DEFAULT_N:,})")
    parser.add_argument("--cap", default=DEFAULT_CAP, help=f"address-space cap per child (default {DEFAULT_CAP})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--child", choices=["plain", "hlopass"], help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.child:
        child_main(options.child, options.n, options.seed)
        return 0
    if not split_pass_available():
        print("hlopass demo: the 'split' pass is not registered in this checkout "
              "(hlopass.available_passes() lists what is); the rescue below is expected to fail too.")
    results = run_demo(options.n, options.cap, options.seed)
    print()
    print(format_table(results))
    print()
    print("rescued: plain jax.jit failed and hlopass.jit finished with matching numbers." if results["rescued"]
          else "NOT rescued: see the table above.")
    if options.json:
        with open(options.json, "w") as handle:
            json.dump(results, handle, indent=2, default=str)
    return 0 if results["rescued"] else 1


if __name__ == "__main__":
    sys.exit(main())
