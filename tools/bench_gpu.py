"""hlopass on one GPU against plain ``jax.jit`` and chunking by hand (the eXLA paper's GPU experiments).

    python -m tools.bench_gpu [--cases knn3,knn100,...|all] [--json tools/results/gpu.json] [--quick]

Cases (each in its own child process under a time limit, so one failure loses nothing else):

- ``knn3``, ``knn100``: k = 10 nearest of 1,000,000 points for 10,000 queries, d = 3 and 100,
  written naively (broadcast difference, ``lax.top_k`` of the negated distances). Neighbours are
  checked by exact float64 distances on a sample of rows (the k-th returned distance against the
  true k-th smallest), not by index order;
- ``matvec1e5``, ``matvec1e6``: squared-exponential kernel matrix times a vector, n = m = 10^5
  and 10^6, d = 3, and its gradient in ``x``;
- ``sgpr1000``, ``sgpr4000``, ``sgpr10000``: Titsias' collapsed SGPR bound and its gradient in
  float64, n = 2,049,280, d = 11 (the paper's largest data set, synthetic), m inducing points;
- ``transformer``: the gradient of 4 pre-norm Transformer blocks (width 256, sequence 16,384)
  whose activations exceed a memory limit of a third of plain's footprint.

Columns: ``plain`` (``jax.jit``), ``by_hand`` (``lax.map`` over blocks of queries/rows, the fix a
user writes), ``hlopass`` at default settings and ``hlopass_100MB`` (threshold 100 MB, the paper's
setting). Each: compile seconds, the median of 3 calls after a warm-up, XLA's temp bytes, and
exactness. ``--json`` writes every row with the device name and the JAX version.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

from tools import harness

CASE_TIMEOUT_S = {"policy": 240, "sgpr10000": 240, "sgpr4000": 120, "matvec1e6": 100, "transformer": 100, "knn100": 240}
DEFAULT_TIMEOUT_S = 75
CASES = ("knn3", "knn100", "matvec1e5", "matvec1e6", "sgpr1000", "sgpr4000", "sgpr10000", "transformer")
#: The default run, about 5 minutes on one H100: the long cases (knn100, whose plain jax.jit compiles for
#: about 3 minutes; SGPR at m = 4,000 and 10,000, minutes each) run with ``--cases all`` or by name.
SHORT = ("knn3", "matvec1e5", "matvec1e6", "sgpr1000", "transformer")
N_POINTS, N_QUERIES, K = 1_000_000, 10_000, 10
SGPR_N, SGPR_D = 2_049_280, 11
TRANSFORMER_SEQ = 16_384
#: ``--quick``: the same cases at sizes a CPU runs in seconds (the script's own test).
QUICK = os.environ.get("BENCH_GPU_QUICK") == "1"
if QUICK:
    N_POINTS, N_QUERIES, SGPR_N, TRANSFORMER_SEQ = 20_000, 200, 20_000, 512
STEP_BYTES = 100_000 if QUICK else 100_000_000  # the shape cases' step, by hand


# -- measuring one column ------------------------------------------------------------------------

def timed(fn, args, repeats: int = 3) -> dict:
    """Compile ``fn`` (a jitted function) at ``args``, call it once, then ``repeats`` more times."""
    _, compiled, compile_s = harness.compile_timed(fn, args)
    temp = harness.memory_figures(compiled)["temp"]
    timing = harness.time_call(functools.partial(compiled, *args), repeats)
    return {"compile_s": compile_s, "first_call_s": timing.first, "median_s": timing.median,
            "temp_bytes": temp, "_out": timing.out}


def column(name: str, fn, args, check, repeats: int = 3) -> dict:
    """One column: timings, temp, and ``check(out)`` (a dict); an error is recorded, not raised."""
    print(f"column {name}", file=sys.stderr, flush=True)  # what a case that times out was doing
    try:
        row = timed(fn, args, repeats)
        out = row.pop("_out")
        row.update(check(out))
        row["status"] = "ok"
    except Exception as err:  # noqa: BLE001 - a column that fails (RESOURCE_EXHAUSTED) is a result
        row = {"status": "failed", "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
    row["column"] = name
    return row


def hlopass_columns(fn, args, check, repeats: int = 3, static_argnums=()) -> list[dict]:
    import hlopass
    return [column("hlopass", hlopass.jit(fn, static_argnums=static_argnums), args, check, repeats),
            column("hlopass_100MB", hlopass.jit(fn, threshold="100MB", static_argnums=static_argnums),
                   args, check, repeats)]


# -- kNN -------------------------------------------------------------------------------------------

def case_knn(d: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from fixtures.knn import knn_l2

    rng = np.random.default_rng(0)
    queries = jax.device_put(rng.standard_normal((N_QUERIES, d)).astype(np.float32))
    points = jax.device_put(rng.standard_normal((N_POINTS, d)).astype(np.float32))
    sample = np.sort(rng.choice(N_QUERIES, 128, replace=False))
    exact_kth = _exact_kth_distances(np.asarray(queries)[sample], points, K)

    def check(out):
        _, idx = out
        got = _distances64(np.asarray(queries)[sample], points, np.asarray(idx)[sample])
        got_kth = np.sort(got, axis=1)[:, K - 1]
        wrong = ~np.isclose(got_kth, exact_kth, rtol=1e-5, atol=1e-6)
        return {"rows_checked": len(sample), "rows_wrong": int(wrong.sum()),
                "worst_kth_ratio": float(np.max(got_kth / np.maximum(exact_kth, 1e-30)))}

    def knn(q, p):
        return knn_l2(q, p, K)

    def by_hand(q, p):
        blocks = q.reshape(-1, min(100, q.shape[0]), q.shape[1])
        d_, i_ = lax.map(lambda b: knn_l2(b, p, K), blocks)
        return d_.reshape(-1, K), i_.reshape(-1, K)

    args = (queries, points)
    rows = [column("plain", jax.jit(knn), args, check), column("by_hand", jax.jit(by_hand), args, check)]
    return {"case": f"knn{d}", "shape": f"{N_QUERIES}x{N_POINTS}, d={d}, k={K}",
            "rows": rows + hlopass_columns(knn, args, check)}


def _distances64(q, points, idx):
    import numpy as np
    p = np.asarray(points)[idx]                       # (rows, k, d)
    return np.sum((q[:, None, :].astype(np.float64) - p.astype(np.float64)) ** 2, axis=-1)


def _exact_kth_distances(q, points, k):
    """The true k-th smallest squared distance of each query row, in float64 (on the host)."""
    import numpy as np
    q64, p64 = q.astype(np.float64), np.asarray(points).astype(np.float64)
    d2 = np.sum(q64 ** 2, 1)[:, None] + np.sum(p64 ** 2, 1)[None, :] - 2.0 * q64 @ p64.T
    return np.partition(d2, k - 1, axis=1)[:, k - 1]


# -- kernel mat-vec --------------------------------------------------------------------------------

def case_matvec(n: int) -> dict:
    n = n // 100 if QUICK else n
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from fixtures.kernels import kernel_matvec

    rng = np.random.default_rng(1)
    x = jax.device_put(rng.standard_normal((n, 3)).astype(np.float32))
    y = jax.device_put(rng.standard_normal((n, 3)).astype(np.float32))
    v = jax.device_put(rng.standard_normal((n,)).astype(np.float32))
    block = next(b for b in (1000, 100, 10, 1) if n % b == 0 and (n <= 100_000 or b <= 100))

    def by_hand(x, y, v):
        return lax.map(lambda b: kernel_matvec(b, y, v), x.reshape(-1, block, 3)).reshape(-1)

    def grad_of(f):
        return jax.grad(lambda x, y, v: jnp.sum(f(x, y, v)))

    reference = {}

    def check_against(key):
        def check(out):
            out = np.asarray(out)
            if key not in reference:
                reference[key] = out
                return {"max_rel_diff": 0.0, "reference": True}
            ref = reference[key]
            return {"max_rel_diff": float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))}
        return check

    args = (x, y, v)
    import hlopass
    rows = []
    for label, f in (("value", kernel_matvec), ("gradient", None)):
        fn = kernel_matvec if label == "value" else grad_of(kernel_matvec)
        hand = by_hand if label == "value" else grad_of(by_hand)
        chk = check_against(label)
        reps = 3 if n <= 100_000 else 1
        cols = []
        if n <= 100_000:
            cols.append(column("plain", jax.jit(fn), args, chk, reps))
        cols.append(column("by_hand", jax.jit(hand), args, chk, reps))
        cols += [column("hlopass", hlopass.jit(fn), args, chk, reps),
                 column("hlopass_100MB", hlopass.jit(fn, threshold="100MB"), args, chk, reps)]
        for c in cols:
            c["quantity"] = label
        rows += cols
    return {"case": f"matvec{n:.0e}".replace("+0", ""), "shape": f"n=m={n}, d=3", "rows": rows}


# -- SGPR ----------------------------------------------------------------------------------------

def case_sgpr(m: int) -> dict:
    m = m // 100 if QUICK else m
    import jax
    jax.config.update("jax_enable_x64", True)
    import numpy as np
    import hlopass
    from fixtures.gp import make_sgpr, sgpr_value_and_grad

    X, y, Z, log_params = (jax.device_put(a) for a in make_sgpr(SGPR_N, m, SGPR_D))
    args = (X, y, Z, log_params)

    def check(out):
        value, (gz, gp) = out
        return {"value": float(value), "finite": bool(np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(gp))))}

    repeats = 1 if m >= 4000 else 3
    rows = [column("plain", jax.jit(sgpr_value_and_grad), args, check, repeats),
            column("hlopass_1GB", hlopass.jit(sgpr_value_and_grad, threshold="1GB"), args, check, repeats)]
    return {"case": f"sgpr{m}", "shape": f"n={SGPR_N}, d={SGPR_D}, m={m}, float64, value and gradient", "rows": rows}


# -- a Transformer training step over its memory limit -------------------------------------------

def case_transformer() -> dict:
    import jax
    import numpy as np
    import hlopass
    from tools.bench_remat import transformer_inputs, transformer_loss

    params, x = transformer_inputs(4, 256, TRANSFORMER_SEQ)
    grad = jax.grad(transformer_loss)
    plain = column("plain", jax.jit(grad), (params, x), lambda out: {})
    limit = None
    if plain.get("temp_bytes"):
        limit = max(plain["temp_bytes"] // 3, 2**20)
    ref = jax.jit(grad)(params, x)

    def check(out):
        diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) / max(float(np.max(np.abs(np.asarray(b)))), 1e-30)
                   for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)))
        return {"max_rel_diff": diff}

    rows = [plain]
    if limit:
        rows.append(column(f"hlopass_limit", hlopass.jit(grad, memory_limit=limit), (params, x), check))
        rows[-1]["memory_limit"] = limit
    return {"case": "transformer", "shape": "4 blocks, width 256, sequence 16384, gradient", "rows": rows}


# -- profiling (``--cases knn_shapes,matvec_shapes,policy``; not in the default run) ----------------

def case_knn_shapes() -> dict:
    """kNN d = 3 at 100 MB steps written by hand along either axis, with and without unrolling."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    import hlopass
    from fixtures.knn import knn_l2, pairwise_sq_l2

    rng = np.random.default_rng(0)
    q = jax.device_put(rng.standard_normal((N_QUERIES, 3)).astype(np.float32))
    p = jax.device_put(rng.standard_normal((N_POINTS, 3)).astype(np.float32))
    rows_per_step = max(1, STEP_BYTES // (4 * N_POINTS))
    cols_per_step = max(K, STEP_BYTES // (4 * N_QUERIES))

    def along_queries(unroll):
        def f(q, p):
            def step(i, acc):
                d_, i_ = knn_l2(lax.dynamic_slice_in_dim(q, i * rows_per_step, rows_per_step), p, K)
                return (lax.dynamic_update_slice_in_dim(acc[0], d_, i * rows_per_step, 0),
                        lax.dynamic_update_slice_in_dim(acc[1], i_, i * rows_per_step, 0))
            init = (jnp.zeros((N_QUERIES, K), q.dtype), jnp.zeros((N_QUERIES, K), jnp.int32))
            return lax.fori_loop(0, N_QUERIES // rows_per_step, step, init, unroll=unroll)
        return f

    def along_points(unroll):
        def f(q, p):
            def step(j, acc):
                block = lax.dynamic_slice_in_dim(p, j * cols_per_step, cols_per_step)
                d_ = pairwise_sq_l2(q, block)
                cand_d = jnp.concatenate([acc[0], d_], 1)
                cand_i = jnp.concatenate([acc[1], j * cols_per_step + lax.broadcasted_iota(jnp.int32, d_.shape, 1)], 1)
                neg, pos = lax.top_k(-cand_d, K)
                return -neg, jnp.take_along_axis(cand_i, pos, 1)
            init = (jnp.full((N_QUERIES, K), jnp.inf, q.dtype), jnp.zeros((N_QUERIES, K), jnp.int32))
            return lax.fori_loop(0, N_POINTS // cols_per_step, step, init, unroll=unroll)
        return f

    def none(out):
        return {}

    def knn(q, p):
        return knn_l2(q, p, K)

    args = (q, p)
    rows = [column("hlopass_100MB", hlopass.jit(knn, threshold="100MB"), args, none)]
    for unroll in (1, 4):
        rows.append(column(f"queries_u{unroll}", jax.jit(along_queries(unroll)), args, none))
        rows.append(column(f"points_u{unroll}", jax.jit(along_points(unroll)), args, none))
    for split in ("100MB", "1GB"):
        f = hlopass.jit(knn, threshold="1GB", split_size=split)
        rows.append(column(f"hlopass_1GB/{split}", f, args, none))
    report = hlopass.jit(knn, threshold="100MB").trace(*args).report
    return {"case": "knn_shapes", "shape": f"{N_QUERIES}x{N_POINTS}, d=3, 100 MB steps",
            "report": str(report)[-3000:], "rows": rows}


def case_matvec_shapes() -> dict:
    """Kernel mat-vec n = 10^5 at 100 MB steps by hand: dot or multiply-and-sum, unrolled or not."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    import hlopass
    from fixtures.kernels import kernel_matvec, sq_exp_kernel

    n = 100_000 if not QUICK else 1000
    rng = np.random.default_rng(1)
    x, y = (jax.device_put(rng.standard_normal((n, 3)).astype(np.float32)) for _ in range(2))
    v = jax.device_put(rng.standard_normal((n,)).astype(np.float32))
    rows_per_step = max(1, STEP_BYTES // (4 * n))

    def summed(x, y, v):
        return jnp.sum(sq_exp_kernel(x, y) * v[None, :], axis=1)

    def by_steps(body, unroll):
        def f(x, y, v):
            def step(i, out):
                part = body(lax.dynamic_slice_in_dim(x, i * rows_per_step, rows_per_step), y, v)
                return lax.dynamic_update_slice_in_dim(out, part, i * rows_per_step, 0)
            return lax.fori_loop(0, n // rows_per_step, step, jnp.zeros((n,), x.dtype), unroll=unroll)
        return f

    def none(out):
        return {}

    args = (x, y, v)
    rows = [column("plain_dot", jax.jit(kernel_matvec), args, none),
            column("plain_summed", jax.jit(summed), args, none),
            column("hlopass_100MB", hlopass.jit(kernel_matvec, threshold="100MB"), args, none),
            column("hlopass_100MB_summed", hlopass.jit(summed, threshold="100MB"), args, none)]
    for body, label in ((kernel_matvec, "dot"), (summed, "summed")):
        for unroll in (1, 8):
            rows.append(column(f"{label}_u{unroll}", jax.jit(by_steps(body, unroll)), args, none))
    report = hlopass.jit(kernel_matvec, threshold="100MB").trace(*args).report
    return {"case": "matvec_shapes", "shape": f"n={n}, 100 MB steps", "report": str(report)[-3000:], "rows": rows}


def case_policy() -> dict:
    """Steps per loop iteration (``SplitPass(accelerator_steps_per_iteration=...)``) on the kernel
    mat-vec, its gradient and kNN at 100 MB steps; and the throughput of the products and triangular
    solves one float64 SGPR step runs (m = 10,000, a 1 GB slice of 12,500 points)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    import hlopass
    from fixtures.kernels import kernel_matvec
    from fixtures.knn import knn_l2
    from hlopass.passes.split import SplitPass

    n = 100_000 if not QUICK else 1000
    rng = np.random.default_rng(1)
    x, y = (jax.device_put(rng.standard_normal((n, 3)).astype(np.float32)) for _ in range(2))
    v = jax.device_put(rng.standard_normal((n,)).astype(np.float32))
    grad = jax.grad(lambda x, y, v: jnp.sum(kernel_matvec(x, y, v)), argnums=(0, 1))
    q = jax.device_put(rng.standard_normal((N_QUERIES, 3)).astype(np.float32))
    p = jax.device_put(rng.standard_normal((N_POINTS, 3)).astype(np.float32))

    def none(out):
        return {}

    def knn(q, p):
        return knn_l2(q, p, K)

    rows = [column("matvec_plain", jax.jit(kernel_matvec), (x, y, v), none),
            column("matvec_grad_plain", jax.jit(grad), (x, y, v), none)]
    for per in (1, 4, 16):
        chosen = ["hvp", "adjoint", "algebraic", "matrix_chain", SplitPass(accelerator_steps_per_iteration=per), "remat"]
        rows.append(column(f"matvec_100MB_x{per}", hlopass.jit(kernel_matvec, threshold="100MB", passes=chosen),
                           (x, y, v), none))
        rows.append(column(f"matvec_grad_100MB_x{per}", hlopass.jit(grad, threshold="100MB", passes=chosen),
                           (x, y, v), none))
        rows.append(column(f"knn3_100MB_x{per}", hlopass.jit(knn, threshold="100MB", passes=chosen), (q, p), none))
        rows.append(column(f"knn3_x{per}", hlopass.jit(knn, passes=chosen), (q, p), none))
    m, c = (10_000, 12_500) if not QUICK else (200, 300)
    with jax.enable_x64(True):
        a = jax.device_put(rng.standard_normal((m, c)))
        spd = rng.standard_normal((m, m)) / np.sqrt(m)
        low = jax.device_put(np.tril(spd) + 4 * np.eye(m))
        sq = jax.device_put(spd)
        kernels = {
            "f64_gram_mxc_cxm": (jax.jit(lambda a: a @ a.T), (a,), 2 * m * m * c),
            "f64_gemm_mxm_mxc": (jax.jit(lambda s, a: s @ a), (sq, a), 2 * m * m * c),
            "f64_trsm_mxm_mxc": (jax.jit(lambda l, a: lax.linalg.triangular_solve(l, a, left_side=True, lower=True)),
                                 (low, a), m * m * c),
            "f64_trsm_transposed": (jax.jit(lambda l, a: lax.linalg.triangular_solve(
                l, a, left_side=True, lower=True, transpose_a=True)), (low, a), m * m * c),
        }
        for name, (fn, args, flop) in kernels.items():
            row = column(name, fn, args, none)
            if row["status"] == "ok":
                row["tflops"] = flop / row["median_s"] / 1e12
            rows.append(row)
    return {"case": "policy", "shape": f"n={n}; kNN {N_QUERIES}x{N_POINTS}; SGPR step m={m}, {c} points",
            "rows": rows}


def run_case(name: str) -> dict:
    if name == "policy":
        return case_policy()
    if name == "knn_shapes":
        return case_knn_shapes()
    if name == "matvec_shapes":
        return case_matvec_shapes()
    if name.startswith("knn"):
        return case_knn(int(name[3:]))
    if name.startswith("matvec"):
        return case_matvec(int(float(name[6:])))
    if name.startswith("sgpr"):
        return case_sgpr(int(name[4:]))
    if name == "transformer":
        return case_transformer()
    raise SystemExit(f"unknown case {name!r}; cases: {', '.join(CASES)}")


# -- the parent: one child per case ----------------------------------------------------------------

def child_main(name: str) -> None:
    import jax
    result = run_case(name)
    result.update(device=str(jax.devices()[0].device_kind), backend=jax.default_backend(), jax=jax.__version__)
    harness.report_result(result)


def run_child(name: str) -> dict:
    timeout = CASE_TIMEOUT_S.get(name, DEFAULT_TIMEOUT_S)
    result = harness.run_capped(harness.module_argv("bench_gpu", "--child", name), None, timeout=timeout,
                                platforms=None, keep=("process_seconds",))
    if result.get("status") in ("timeout", "crashed"):
        return {"case": name, "status": result["status"], "error": result["error"]}
    result["process_s"] = result.pop("process_seconds")
    return result


def print_case(result: dict) -> None:
    print(f"\n== {result['case']}: {result.get('shape', '')}  [{result.get('device', '?')}, jax {result.get('jax', '?')}]")
    if "rows" not in result:
        print(f"   {result.get('status')}: {result.get('error')}")
        return
    plain = {r.get("quantity"): r for r in result["rows"] if r["column"] == "plain" and r["status"] == "ok"}
    for r in result["rows"]:
        if r["status"] != "ok":
            print(f"   {r['column']:<15} {r.get('quantity', ''):<9} FAILED {r['error'][:140]}")
            continue
        base = plain.get(r.get("quantity"))
        ratio = f"{base['median_s'] / r['median_s']:.2f}x plain" if base and r is not base else ""
        extra = {k: r[k] for k in ("rows_wrong", "worst_kth_ratio", "max_rel_diff", "value", "tflops") if k in r}
        temp = r.get("temp_bytes")
        print(f"   {r['column']:<15} {r.get('quantity', ''):<9} compile {r['compile_s']:6.2f} s  "
              f"call {r['median_s']:8.4f} s  temp {temp / 1e9 if temp is not None else float('nan'):8.3f} GB  "
              f"{ratio:<12} {extra}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(SHORT),
                        help=f"comma-separated, or 'all' ({', '.join(CASES)}); default: {', '.join(SHORT)}")
    parser.add_argument("--json", default=None, help="write the rows here (e.g. tools/results/gpu.json)")
    parser.add_argument("--quick", action="store_true", help="small sizes (a CPU smoke run)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        os.environ["BENCH_GPU_QUICK"] = "1"
    if args.child:
        child_main(args.child)
        return 0
    names = list(CASES) if args.cases == "all" else args.cases.split(",")
    results = []
    for name in harness.progress(names, "bench_gpu"):
        result = run_child(name)
        print_case(result)
        results.append(result)
        sys.stdout.flush()
        # after every case: a run stopped early keeps what it measured
        harness.write_json(args.json, {"cases": results}, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
