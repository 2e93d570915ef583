"""The benchmark suite: plain jax.jit against hand-written alternatives, KeOps and hlopass.

    python -m tools.bench_suite [--tiny] [--workloads a,b] [--out DIR] [--repeats R] [--cap SIZE]

Workloads come from ``fixtures/`` (kernel mat-vec, kNN L2 and L1, matrix
chain, the Mix Flow-MG toy, attention forward+backward, the sparse-GP
collapsed bound with its gradient). Columns: plain ``jax.jit``; the best
hand-written alternative (``lax.map`` with ``batch_size``, the hand-ordered
chain, the hand-written forward-over-reverse HVP); KeOps (``pykeops``, when
installed) for kNN and the kernel product; ``hlopass.jit``.

Every measurement runs in its own child process under an address-space cap
(``--cap``), which reports XLA's temp memory (``memory_analysis()``), the
process's peak RSS, the compile time and the median time of ``--repeats``
calls after a warm-up, plus a sample of the outputs so that every column is
checked against plain ``jax.jit`` (or the hand-written version where plain
fails). ``--tiny`` runs small sizes with all columns of a workload in one
child (seconds; peak RSS is then not per column and is left out).

Writes ``results.json``, ``results.csv``, ``results.md`` (the README's table,
with the machine described) and ``bench.png`` (memory and time per workload)
to ``--out`` (default ``tools/results/``); ``--update-readme README.md`` also
writes the table between the README's ``<!-- bench_suite:start -->`` and
``<!-- bench_suite:end -->`` markers.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib
import importlib.util
import os
import platform
import sys
from typing import Any, Callable

import numpy as np

from hlopass.sizes import format_size, parse_size
from tools import harness

COLUMNS = ("plain", "hand", "keops", "hlopass")
COLUMN_TITLES = {"plain": "plain jax.jit", "hand": "hand-written", "keops": "KeOps", "hlopass": "hlopass"}
SAMPLE = 32
DEFAULT_CAP = "12GB"


@dataclasses.dataclass
class Workload:
    """One program at one size, with the functions each column runs.

    ``build(tiny)`` returns ``(inputs, functions, hlopass_settings, description)``
    where ``functions`` maps a column name to a plain function of the inputs
    (``None`` or missing: the column does not apply).
    """

    name: str
    fixture: str
    build: Callable[[bool], tuple]
    columns: tuple[str, ...] = ("plain", "hand", "hlopass")


# -- fixtures -----------------------------------------------------------------------------------

def fixture(module: str, *names: str):
    """The first of ``names`` found in ``fixtures.<module>`` (``None`` when the fixture is absent)."""
    try:
        mod = importlib.import_module(f"fixtures.{module}")
    except ImportError:
        return None
    for name in names:
        if hasattr(mod, name):
            return getattr(mod, name)
    return None


def _rng(seed=0):
    return np.random.default_rng(seed)


def _keops_lazy():
    try:
        from pykeops.numpy import LazyTensor
    except Exception:  # noqa: BLE001 - pykeops is optional and may fail to import without a compiler
        return None
    return LazyTensor


def build_kernel_matvec(tiny: bool):
    from jax import lax

    from fixtures.kernels import kernel_matvec
    n, d, block = (600, 3, 100) if tiny else (10_000, 3, 1_000)
    rng = _rng()
    x, y = (rng.uniform(-3, 3, (n, d)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal(n).astype(np.float32)

    def hand(x, y, v):
        return lax.map(lambda row: kernel_matvec(row[None], y, v)[0], x, batch_size=block)

    functions = {"plain": kernel_matvec, "hand": hand, "hlopass": kernel_matvec}
    lazy = _keops_lazy()
    if lazy is not None:
        def keops(x, y, v):
            sq = ((lazy(x[:, None, :]) - lazy(y[None, :, :])) ** 2).sum(-1)
            return ((-0.5 * sq).exp() @ v[:, None])[:, 0]
        functions["keops"] = keops
    return (x, y, v), functions, _settings(tiny), f"n = {n:,}, d = {d}; hand: lax.map, batch_size={block}"


def _knn_builder(kind: str):
    def build(tiny: bool):
        from jax import lax
        knn = fixture("knn", f"knn_{kind}")
        queries, points, d, k, block = (200, 1_000, 3, 5, 50) if tiny else (5_000, 100_000, 3, 10, 500)
        rng = _rng(1)
        q = rng.uniform(0, 1, (queries, d)).astype(np.float32)
        p = rng.uniform(0, 1, (points, d)).astype(np.float32)

        def plain(q, p):
            return knn(q, p, k)

        def hand(q, p):
            return lax.map(lambda row: tuple(a[0] for a in knn(row[None], p, k)), q, batch_size=block)

        functions = {"plain": plain, "hand": hand, "hlopass": plain}
        lazy = _keops_lazy()
        if lazy is not None:
            def keops(q, p):
                diff = lazy(q[:, None, :]) - lazy(p[None, :, :])
                dist = (diff ** 2).sum(-1) if kind == "l2" else diff.abs().sum(-1)
                values, indices = dist.Kmin_argKmin(k, dim=1)
                return values, indices
            functions["keops"] = keops
        desc = f"{queries:,} queries x {points:,} points, d = {d}, k = {k}; hand: lax.map, batch_size={block}"
        return (q, p), functions, _settings(tiny), desc
    return build


def build_matrix_chain(tiny: bool):
    plain, hand, make = fixture("chains", "CHAINS")["A@B@v"]
    n = 200 if tiny else 3_000
    return make(n), {"plain": plain, "hand": hand, "hlopass": plain}, _settings(tiny), \
        f"A @ B @ v, n = {n:,}; hand: A @ (B @ v)"


def build_mixflow(tiny: bool):
    mixflow = importlib.import_module("fixtures.mixflow")
    B, D, T, M = (16, 32, 2, 2) if tiny else (256, 512, 2, 8)
    inputs = tuple(np.asarray(a) for a in mixflow.toy_inputs(B, D, T))
    functions = {"plain": mixflow.toy_task(M), "hand": mixflow.toy_task(M, mode="fwdrev"),
                 "hlopass": mixflow.toy_task(M)}
    return inputs, functions, _settings(tiny), f"B = {B}, D = {D}, T = {T}, M = {M}; hand: forward-over-reverse"


def build_attention(tiny: bool):
    import jax
    from jax import lax
    from fixtures.attention import attention
    b, h, s, d, block = (1, 2, 128, 16, 32) if tiny else (1, 4, 4096, 64, 512)
    rng = _rng(2)
    q, k, v, ct = (rng.standard_normal((b, h, s, d)).astype(np.float32) for _ in range(4))

    def forward_backward(q, k, v, ct):
        out, vjp = jax.vjp(attention, q, k, v)
        return (out, *vjp(ct))

    def hand_attention(q, k, v):
        # queries in blocks, each block's scores recomputed in the backward pass
        blocks = q.reshape(b, h, s // block, block, d).transpose(2, 0, 1, 3, 4)
        out = lax.map(jax.checkpoint(lambda qb: attention(qb, k, v)), blocks)
        return out.transpose(1, 2, 0, 3, 4).reshape(b, h, s, d)

    def hand(q, k, v, ct):
        out, vjp = jax.vjp(hand_attention, q, k, v)
        return (out, *vjp(ct))

    return (q, k, v, ct), {"plain": forward_backward, "hand": hand, "hlopass": forward_backward}, \
        _settings(tiny), f"b = {b}, heads = {h}, s = {s:,}, head dim {d}, forward+backward; " \
                         f"hand: lax.map over query blocks of {block} with jax.checkpoint"


def _sgpr_bound(X, y, Z, log_params):
    """Titsias's collapsed SGPR bound on ``fixtures/sgpr.py``'s naive cross-covariance."""
    import jax.numpy as jnp
    from jax.scipy.linalg import cholesky, solve_triangular
    from fixtures.sgpr import cross_covariance
    lengthscale, variance, noise = jnp.exp(log_params)
    n, m = X.shape[0], Z.shape[0]
    kuf = cross_covariance(X, Z, lengthscale, variance).T
    kuu = cross_covariance(Z, Z, lengthscale, variance) + 1e-5 * jnp.eye(m, dtype=X.dtype)
    L = cholesky(kuu, lower=True)
    A = solve_triangular(L, kuf, lower=True) / jnp.sqrt(noise)
    AAT = A @ A.T
    LB = cholesky(jnp.eye(m, dtype=X.dtype) + AAT, lower=True)
    c = solve_triangular(LB, A @ y, lower=True) / jnp.sqrt(noise)
    return (-0.5 * n * jnp.log(2 * jnp.pi * noise) - jnp.sum(jnp.log(jnp.diag(LB)))
            - 0.5 * jnp.dot(y, y) / noise + 0.5 * jnp.dot(c, c)
            - 0.5 * n * variance / noise + 0.5 * jnp.trace(AAT))


def build_sgpr(tiny: bool):
    import jax
    n, m, d = (2_000, 20, 3) if tiny else (100_000, 300, 3)
    rng = _rng(3)
    X = rng.uniform(-3, 3, (n, d)).astype(np.float32)
    y = (np.sin(X).sum(-1) + 0.1 * rng.standard_normal(n)).astype(np.float32)
    Z = X[rng.choice(n, m, replace=False)]
    log_params = np.log(np.array([1.0, 1.0, 0.1], np.float32))

    def value_and_grad(X, y, Z, log_params):
        return jax.value_and_grad(_sgpr_bound, argnums=(2, 3))(X, y, Z, log_params)

    return (X, y, Z, log_params), {"plain": value_and_grad, "hlopass": value_and_grad}, _settings(tiny), \
        f"n = {n:,}, m = {m} inducing points, d = {d}; Titsias's collapsed bound and its gradient " \
        f"(inducing points, hyperparameters) on fixtures/sgpr.py:cross_covariance"


def _settings(tiny: bool) -> dict:
    """hlopass settings: a threshold well under the big tensors at each size."""
    return dict(threshold="256kB", split_size="128kB") if tiny else dict(threshold="100MB", split_size="40MB")


WORKLOADS = {
    "kernel_matvec": Workload("kernel_matvec", "kernels", build_kernel_matvec, COLUMNS),
    "knn_l2": Workload("knn_l2", "knn", _knn_builder("l2"), COLUMNS),
    "knn_l1": Workload("knn_l1", "knn", _knn_builder("l1"), COLUMNS),
    "matrix_chain": Workload("matrix_chain", "chains", build_matrix_chain),
    "mixflow_toy": Workload("mixflow_toy", "mixflow", build_mixflow),
    "attention_fwd_bwd": Workload("attention_fwd_bwd", "attention", build_attention),
    "sgpr_bound_grad": Workload("sgpr_bound_grad", "sgpr", build_sgpr, ("plain", "hlopass")),
}
#: Workloads that cannot run without their fixture module.
NEEDS_FIXTURE = set(WORKLOADS)


def workload_available(name: str) -> str | None:
    """``None`` if ``name`` can run here, else the reason it cannot."""
    workload = WORKLOADS[name]
    if name in NEEDS_FIXTURE and importlib.util.find_spec(f"fixtures.{workload.fixture}") is None:
        return f"fixtures/{workload.fixture}.py is missing"
    return None


# -- the child: one or more measurements ---------------------------------------------------------

def measure_column(workload: str, column: str, tiny: bool, repeats: int) -> dict:
    """Compile and time one column of ``workload`` in this process."""
    import jax

    import hlopass
    inputs, functions, settings, description = WORKLOADS[workload].build(tiny)
    fun = functions.get(column)
    result: dict[str, Any] = {"workload": workload, "column": column, "status": "ok", "description": description}
    if fun is None:
        return {**result, "status": "n/a"}
    try:
        if column == "keops":
            run = functools.partial(fun, *inputs)
            with harness.stopwatch() as clock:  # its first call compiles
                out = run()
            result["compile_seconds"] = clock.seconds
        else:
            jitted = hlopass.jit(fun, **settings) if column == "hlopass" else jax.jit(fun)
            lowered, compiled, result["compile_seconds"] = harness.compile_timed(jitted, inputs)
            result["xla_temp_bytes"] = harness.temp_bytes(compiled)
            if column == "hlopass":
                result["rewrites"] = [str(r) for r in lowered.report.rewrites]
            run = functools.partial(compiled, *inputs)
        timing = harness.time_call(run, repeats, warmup=column != "keops")  # keops: its first call was the warm-up
        result["times"] = timing.wall
        result["median_seconds"] = timing.median
        result["sample"] = harness.sample(out if column == "keops" else timing.out, SAMPLE)
    except Exception as err:  # noqa: BLE001 - a failure (out of memory above all) is a result
        result.update(status="failed", error=harness.short_error(err))
    return result


def child_main(specs: list[str], tiny: bool, repeats: int) -> None:
    """Measure each ``workload:column`` of ``specs`` in this process and report them together."""
    results = [measure_column(*spec.split(":"), tiny, repeats) for spec in specs]
    harness.report_result({"results": results})


# -- the parent ---------------------------------------------------------------------------------

def run_suite(names: list[str], tiny: bool, repeats: int, cap_bytes: int, echo=print,
              keops: bool = True) -> list[dict]:
    """Measure every column of every workload in ``names``; returns one row per measurement.

    The KeOps column runs when ``keops`` and ``pykeops`` imports (its first call
    compiles C++ for each formula, about half a minute each, cached afterwards).
    """
    plan = []
    for name in names:
        reason = workload_available(name)
        if reason:
            echo(f"  skipping {name}: {reason}")
            continue
        columns = [c for c in WORKLOADS[name].columns if c != "keops" or (keops and _keops_lazy() is not None)]
        plan.append((name, columns))
    specs = [f"{name}:{column}" for name, columns in plan for column in columns]
    # one process per measurement; --tiny runs them all in one process (seconds, no per-column RSS)
    groups = [specs] if tiny and specs else [[spec] for spec in specs]
    rows: list[dict] = []
    for step, group in enumerate(harness.progress(groups, "bench_suite"), 1):
        what = group[0] if len(group) == 1 else f"{len(group)} measurements in one process"
        echo(f"[{step}/{len(groups)}] {what} ...")
        argv = harness.module_argv("bench_suite", "--child", ",".join(group), "--repeats", str(repeats),
                                   *(["--tiny"] if tiny else []))
        outcome = harness.run_capped(argv, cap_bytes)
        measured = outcome.get("results") or [
            {"workload": spec.split(":")[0], "column": spec.split(":")[1], **outcome} for spec in group]
        for row in measured:
            if not tiny and "peak_rss_bytes" in outcome:
                row["peak_rss_bytes"] = outcome["peak_rss_bytes"]
            rows.append(row)
            echo(f"    {row['workload']} / {COLUMN_TITLES[row['column']]}: {describe(row)}")
    check_numbers(rows)
    return rows


def describe(row: dict) -> str:
    """One progress line for a measurement."""
    if row.get("status") == "n/a":
        return "not applicable"
    if row.get("status") != "ok":
        return f"{row.get('status')}: {row.get('error', '')}"
    parts = [f"median {row['median_seconds']:.4f} s"]
    if "xla_temp_bytes" in row:
        parts.append(f"temp {format_size(row['xla_temp_bytes'])}")
    if row.get("peak_rss_bytes"):
        parts.append(f"peak RSS {format_size(row['peak_rss_bytes'])}")
    if row.get("rewrites"):
        parts.append(f"{len(row['rewrites'])} rewrite(s)")
    return ", ".join(parts)


def check_numbers(rows: list[dict]) -> None:
    """Attach ``max_rel_diff``: each column's outputs against plain jax.jit's (hand-written's if plain failed)."""
    by_workload: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_workload.setdefault(row["workload"], {})[row["column"]] = row
    for columns in by_workload.values():
        reference = next((columns[c] for c in ("plain", "hand") if columns.get(c, {}).get("status") == "ok"), None)
        for row in columns.values():
            if reference is not None and row.get("status") == "ok" and row is not reference:
                row["max_rel_diff"] = harness.sample_difference(row.get("sample"), reference.get("sample"))
                row["reference"] = reference["column"]


def ratio(numerator, denominator) -> str:
    if not numerator or not denominator:
        return "-"
    return f"{numerator / denominator:.2f}x"


def markdown_table(rows: list[dict], descriptions: dict[str, str], tiny: bool) -> str:
    """The results table for the README, with the machine described."""
    import jax
    by_workload: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_workload.setdefault(row["workload"], {})[row["column"]] = row

    def cell(row):
        if row is None or row.get("status") == "n/a":
            return "-"
        if row.get("status") != "ok":
            return "OOM" if "RESOURCE_EXHAUSTED" in row.get("error", "") else row.get("status", "?")
        parts = [f"{row['median_seconds']:.3g} s"]
        if "xla_temp_bytes" in row:
            parts.append(f"temp {format_size(row['xla_temp_bytes'])}")
        if row.get("peak_rss_bytes"):
            parts.append(f"RSS {format_size(row['peak_rss_bytes'])}")
        return ", ".join(parts)

    lines = [f"Machine: {machine_description()}; jax {jax.__version__}; {datetime.date.today()}"
             + ("; --tiny sizes (smoke run, not a benchmark)" if tiny else ""), "",
             "| workload | plain jax.jit | hand-written | KeOps | hlopass | temp plain/hlopass | time plain/hlopass "
             "| time hand/hlopass | max rel. diff |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, columns in by_workload.items():
        plain, hand, ours = columns.get("plain"), columns.get("hand"), columns.get("hlopass")
        ok = lambda r: r is not None and r.get("status") == "ok"  # noqa: E731
        temp = ratio(plain.get("xla_temp_bytes"), ours.get("xla_temp_bytes")) if ok(plain) and ok(ours) else "-"
        time_plain = ratio(plain["median_seconds"], ours["median_seconds"]) if ok(plain) and ok(ours) else "-"
        time_hand = ratio(hand["median_seconds"], ours["median_seconds"]) if ok(hand) and ok(ours) else "-"
        diff = ours.get("max_rel_diff") if ok(ours) else None
        lines.append(f"| {name} | {cell(plain)} | {cell(hand)} | {cell(columns.get('keops'))} | {cell(ours)} "
                     f"| {temp} | {time_plain} | {time_hand} | {'-' if diff is None else f'{diff:.1e}'} |")
    lines.append("")
    lines.extend(f"- {name}: {desc}" for name, desc in descriptions.items() if name in by_workload)
    where = "all in one process" if tiny else "each column in its own process"
    lines.append(f"- ratios above 1x favour hlopass; times are medians after a warm-up, {where} "
                 "(XLA temp = `compile().memory_analysis().temp_size_in_bytes`; RSS = the process's peak).")
    return "\n".join(lines)


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), cpu)
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return f"{cpu}, {os.cpu_count()} cores, {format_size(memory)} RAM, {platform.system()}, Python {platform.python_version()}"


def plot(rows: list[dict], path: str) -> str | None:
    """Bar charts of XLA temp memory and median time per workload and column (log scale)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = list(dict.fromkeys(r["workload"] for r in rows))
    columns = [c for c in COLUMNS if any(r["column"] == c and r.get("status") == "ok" for r in rows)]
    figure, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / max(len(columns), 1)
    for k, column in enumerate(columns):
        for axis, key in zip(axes, ("xla_temp_bytes", "median_seconds")):
            values = []
            for name in names:
                row = next((r for r in rows if r["workload"] == name and r["column"] == column), {})
                values.append(row.get(key) if row.get("status") == "ok" else 0)
            xs = [i + k * width for i in range(len(names))]
            axis.bar(xs, [v or 0 for v in values], width, label=COLUMN_TITLES[column])
            for x, name in zip(xs, names):
                row = next((r for r in rows if r["workload"] == name and r["column"] == column), {})
                if row.get("status") in ("failed", "crashed", "timeout"):
                    axis.annotate("OOM" if "RESOURCE_EXHAUSTED" in row.get("error", "") else "failed",
                                  xy=(x, 0), xycoords=("data", "axes fraction"), xytext=(0, 4),
                                  textcoords="offset points", rotation=90, fontsize=7, ha="center", color="#c0392b")
    for axis, title in zip(axes, ("XLA temp memory (bytes)", "median time (s)")):
        axis.set_yscale("log")
        axis.set_title(title)
        axis.set_xticks([i + width * (len(columns) - 1) / 2 for i in range(len(names))])
        axis.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        axis.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def write_outputs(rows: list[dict], out_dir: str, tiny: bool, descriptions: dict[str, str]) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    written = []
    path = os.path.join(out_dir, "results.json")
    harness.write_json(path, {"machine": machine_description(), "tiny": tiny, "descriptions": descriptions,
                              "results": harness.without(rows, "sample")})
    written.append(path)
    path = os.path.join(out_dir, "results.csv")
    harness.write_csv(path, rows, ["workload", "column", "status", "xla_temp_bytes", "peak_rss_bytes",
                                   "median_seconds", "compile_seconds", "max_rel_diff", "reference", "error"])
    written.append(path)
    path = os.path.join(out_dir, "results.md")
    with open(path, "w") as handle:
        handle.write(markdown_table(rows, descriptions, tiny) + "\n")
    written.append(path)
    picture = plot(rows, os.path.join(out_dir, "bench.png"))
    if picture:
        written.append(picture)
    return written


README_START, README_END = "<!-- bench_suite:start -->", "<!-- bench_suite:end -->"


def update_readme(path: str, table: str) -> None:
    """Replace the text between ``README_START`` and ``README_END`` in ``path`` by ``table``."""
    with open(path) as handle:
        text = handle.read()
    if README_START not in text or README_END not in text:
        raise SystemExit(f"{path} has no '{README_START}' ... '{README_END}' block to fill")
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    with open(path, "w") as handle:
        handle.write(f"{head}{README_START}\n{table}\n{README_END}{tail}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small sizes, all columns of a workload in one child")
    parser.add_argument("--workloads", help=f"comma-separated subset of: {', '.join(WORKLOADS)}")
    parser.add_argument("--out", default=harness.RESULTS, help="folder for the results")
    parser.add_argument("--json", help="also write results.json's content to this path")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per measurement (default 5, tiny 2)")
    parser.add_argument("--cap", default=DEFAULT_CAP, help=f"address-space cap per child (default {DEFAULT_CAP})")
    parser.add_argument("--no-keops", action="store_true", help="leave out the KeOps column even if installed")
    parser.add_argument("--update-readme", metavar="PATH",
                        help=f"write the table into PATH between {README_START} and {README_END}")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # workload:column,... to measure in this process
    options = parser.parse_args(argv)
    repeats = options.repeats or (2 if options.tiny else 5)
    if options.child:
        child_main(options.child.split(","), options.tiny, repeats)
        return 0
    names = options.workloads.split(",") if options.workloads else list(WORKLOADS)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; known: {', '.join(WORKLOADS)}")
    where = "one child process" if options.tiny else "a child process per measurement"
    print(f"hlopass benchmark suite{' (--tiny)' if options.tiny else ''}: {len(names)} workload(s), "
          f"{where}, capped at {options.cap} of address space", flush=True)
    echo = functools.partial(print, flush=True)
    rows = run_suite(names, options.tiny, repeats, parse_size(options.cap, "--cap"), echo, keops=not options.no_keops)
    descriptions = {r["workload"]: r["description"] for r in rows if r.get("description")}
    written = write_outputs(rows, options.out, options.tiny, descriptions)
    harness.write_json(options.json, {"results": harness.without(rows, "sample")})
    table = markdown_table(rows, descriptions, options.tiny)
    if options.update_readme:
        update_readme(options.update_readme, table)
    print()
    print(table)
    print()
    print("written: " + ", ".join(written))
    failed_hlopass = [r["workload"] for r in rows if r["column"] == "hlopass" and r.get("status") != "ok"]
    return 1 if failed_hlopass else 0


if __name__ == "__main__":
    sys.exit(main())
