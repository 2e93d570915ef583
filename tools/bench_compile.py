"""Where hlopass's first call goes: trace, each pass, the never-worse comparison, lowering and XLA
compile, against ``jax.jit``'s first call, on programs written with popular JAX libraries.

    python -m tools.bench_compile [--programs a,b] [--columns plain,nothing,forced] [--repeat 3]
                                  [--json tools/results/compile.json]

Each program runs in its own child process per column (so no cache of one column helps another):
``plain`` (``jax.jit``), ``nothing`` (hlopass's defaults: usually nothing is above the threshold),
``forced`` (a threshold a tenth of the program's largest intermediate, so the passes rewrite; found
in a child of its own, so that the timed child traces nothing before its call), and
``plain_cached`` / ``nothing_cached`` / ``forced_cached``: a second process sharing a persistent compilation cache
(``JAX_COMPILATION_CACHE_DIR``) with a first one that filled it (their children also time a second
call, the program's own run: each cached column says, besides its ratio, what its first call adds to
that run against what plain's adds to its own, "less a call"; a program rewritten under a forced
threshold may run slower than plain's, which is no cost of the first call). Per column: the first call of a
fresh function object (``first_call_s``: trace + passes + lower + compile + run, the first thing the
child does), then, for a breakdown, the stages of a fresh instance one by one: tracing (``f.trace``),
the passes (each pass's own time from the report), lowering (``.lower`` after tracing, which
includes the never-worse comparison's compiles when it makes one) and XLA's compile. With
``--repeat N`` each column runs in N children, the columns interleaved round by round, and the
median first call is reported (the machine may be shared); ``--baseline DIR`` runs the hlopass
columns of another checkout (an earlier commit's worktree) in the same rounds, for before/after
figures under the same load. hlopass's modules are compiled to bytecode first, as an install does (so that
``PYTHONDONTWRITEBYTECODE`` does not charge their compilation to the first call); each line says whether issue 27's bound holds (nothing set: 1.1x plain + 0.2 s;
forced: 2x; cached: 1.2x plain's cached). The libraries (flax, optax, numpyro, ott-jax, jax-md,
tinygp) are the ``compile-bench`` extra: ``bash tools/setup.sh compile-bench``; a program whose
library is missing is reported as such, not skipped silently.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from tools import harness

RESULT = "BENCH_COMPILE_RESULT "
TIMEOUT_S = 600


# -- the programs: each returns (function, args) -------------------------------------------------

def transformer_adam():
    """A 2-layer Transformer language model (flax.linen, width 256, sequence 1024, batch 4) and one
    Adam step (optax): loss, gradient, update."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.LayerNorm()(x)
            h = nn.SelfAttention(num_heads=4, deterministic=True)(h, mask=nn.make_causal_mask(x[..., 0]))
            x = x + h
            h = nn.Dense(1024)(nn.LayerNorm()(x))
            return x + nn.Dense(256)(nn.gelu(h))

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(1000, 256)(tokens)
            for _ in range(2):
                x = Block()(x)
            return nn.Dense(1000)(nn.LayerNorm()(x))

    model, tx = LM(), optax.adam(1e-3)
    tokens = jnp.zeros((4, 1024), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), tokens)
    state = tx.init(params)

    def step(params, state, tokens):
        def loss(p):
            logits = model.apply(p, tokens)
            return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()
        value, grads = jax.value_and_grad(loss)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    return step, (params, state, tokens)


def cnn_sgd():
    """A small CNN (flax.linen: three conv layers, 64 images of 64 x 64 x 3) and an SGD step (optax)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            for features in (32, 64, 64):
                x = nn.relu(nn.Conv(features, (3, 3))(x))
                x = nn.avg_pool(x, (2, 2), (2, 2))
            return nn.Dense(10)(x.reshape(x.shape[0], -1))

    model, tx = CNN(), optax.sgd(0.1)
    images, labels = jnp.ones((64, 64, 64, 3)), jnp.zeros((64,), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), images)
    state = tx.init(params)

    def step(params, state, images, labels):
        def loss(p):
            return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, images), labels).mean()
        grads = jax.grad(loss)(params)
        updates, state = tx.update(grads, state)
        return optax.apply_updates(params, updates), state

    return step, (params, state, images, labels)


def attention_grad():
    """Multi-head attention (flax.linen, 8 heads, width 512, sequence 2048, batch 2): loss and gradient."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    layer = nn.MultiHeadDotProductAttention(num_heads=8, qkv_features=512, deterministic=True)
    x = jnp.ones((2, 2048, 512))
    params = layer.init(jax.random.PRNGKey(0), x, x)

    def loss_and_grad(params, x):
        return jax.value_and_grad(lambda p: jnp.sum(jnp.sin(layer.apply(p, x, x))))(params)

    return loss_and_grad, (params, x)


def gp_marginal_likelihood():
    """An exact GP's negative log marginal likelihood and its gradient (tinygp, n = 2,000, d = 3)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import tinygp

    x = np.random.default_rng(0).uniform(size=(2000, 3))
    y = np.sin(x.sum(1))

    def nll(log_params, x, y):
        kernel = jnp.exp(log_params[0]) * tinygp.kernels.ExpSquared(jnp.exp(log_params[1]))
        return -tinygp.GaussianProcess(kernel, x, diag=jnp.exp(log_params[2])).log_probability(y)

    return jax.value_and_grad(nll), (jnp.zeros(3), x, y)


def sgpr_bound():
    """The project's SGPR bound and gradient (fixtures.gp, float32 here: n = 20,000, m = 200, d = 5)."""
    import numpy as np
    from fixtures.gp import make_sgpr, sgpr_value_and_grad
    return sgpr_value_and_grad, make_sgpr(20_000, 200, 5, dtype=np.float32)


def numpyro_potential():
    """A hierarchical logistic regression's potential energy and its gradient (numpyro, 5,000 x 20)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import numpyro
    import numpyro.distributions as dist
    from numpyro.infer.util import initialize_model

    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((5000, 20)), rng.integers(0, 2, 5000)

    def model(X, y):
        scale = numpyro.sample("scale", dist.HalfNormal(1.0))
        w = numpyro.sample("w", dist.Normal(jnp.zeros(20), scale))
        b = numpyro.sample("b", dist.Normal(0.0, 1.0))
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)

    info = initialize_model(jax.random.PRNGKey(0), model, model_args=(X, y))
    potential = info.potential_fn
    return jax.value_and_grad(potential), (info.param_info.z,)


def ott_sinkhorn():
    """An entropic optimal-transport solve between two point clouds and its gradient (ott-jax Sinkhorn,
    1,000 x 1,200 points in d = 3)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from ott.geometry import pointcloud
    from ott.problems.linear import linear_problem
    from ott.solvers.linear import sinkhorn

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((1000, 3)), rng.standard_normal((1200, 3)) + 0.5

    def cost(x, y):
        geom = pointcloud.PointCloud(x, y, epsilon=0.1)
        return sinkhorn.Sinkhorn(max_iterations=50)(linear_problem.LinearProblem(geom)).reg_ot_cost

    return jax.value_and_grad(cost), (jnp.asarray(x), jnp.asarray(y))


def jaxmd_forces():
    """A Lennard-Jones energy and forces of 2,000 particles in a periodic box (jax-md)."""
    import jax
    import numpy as np
    from jax_md import energy, space

    box = 20.0
    displacement, _ = space.periodic(box)
    positions = np.random.default_rng(0).uniform(0, box, (2000, 3))
    energy_fn = energy.lennard_jones_pair(displacement)
    return jax.value_and_grad(energy_fn), (positions,)


def knn():
    """The project's kNN (fixtures.knn, 2,000 queries among 100,000 points, d = 3, k = 10)."""
    import numpy as np
    from fixtures.knn import knn_l2
    rng = np.random.default_rng(0)
    return (lambda q, p: knn_l2(q, p, 10)), (rng.standard_normal((2000, 3), np.float32),
                                             rng.standard_normal((100_000, 3), np.float32))


PROGRAMS = {f.__name__: f for f in (transformer_adam, cnn_sgd, attention_grad, gp_marginal_likelihood, sgpr_bound,
                                     numpyro_potential, ott_sinkhorn, jaxmd_forces, knn)}


# -- one program in a child ------------------------------------------------------------------------

#: The columns: ``plain`` (``jax.jit``), ``nothing`` (hlopass's defaults), ``forced`` (a threshold a
#: tenth of the largest intermediate), and the second process of each of the first two with JAX's
#: persistent compilation cache filled by a first one (``plain_cached``, ``nothing_cached``, ``forced_cached``).
COLUMNS = ("plain", "nothing", "forced", "plain_cached", "nothing_cached", "forced_cached")


def _largest_intermediate(fn, args) -> int:
    import jax
    from hlopass.jaxpr_utils import largest_values
    rows = largest_values(jax.make_jaxpr(fn)(*args), limit=1)
    return rows[0][1] if rows else 0


def _staged(f, args) -> dict:
    """Trace, lower, compile and run ``f`` (a jitted function, fresh) once, timing each stage."""
    import jax
    times, start = {}, time.perf_counter()
    traced = f.trace(*args)
    times["trace_s"] = time.perf_counter() - start
    start = time.perf_counter()
    lowered = traced.lower()
    times["lower_s"] = time.perf_counter() - start
    start = time.perf_counter()
    compiled = lowered.compile()
    times["compile_s"] = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times["run_s"] = time.perf_counter() - start
    times["staged_s"] = sum(times.values())
    return times, traced


#: The forced column's threshold, from the parent (:func:`run_program`): computed here, ``jax.make_jaxpr``
#: would trace the libraries' inner jitted functions before the timed call (on the CNN step hlopass's
#: trace then took 0.1 s instead of 0.4 s), flattering the column.
FORCED_THRESHOLD_ENV = "BENCH_COMPILE_FORCED_THRESHOLD"


def _jitted(column: str, fn, args):
    import jax
    import hlopass
    if column.startswith("plain"):
        return jax.jit(fn)
    kwargs = {"threshold": _forced_threshold(fn, args)} if column.startswith("forced") else {}
    return hlopass.jit(fn, **kwargs)


def _forced_threshold(fn, args) -> int:
    """A tenth of the program's largest intermediate (from the parent when it says, see :data:`FORCED_THRESHOLD_ENV`)."""
    given = os.environ.get(FORCED_THRESHOLD_ENV)
    return int(given) if given else max(_largest_intermediate(fn, args) // 10, 1)


def forced_threshold(name: str) -> int:
    """The forced column's threshold for program ``name``, in this process (a child of its own)."""
    return _forced_threshold(*PROGRAMS[name]())


def measure(name: str, column: str) -> dict:
    """One column of one program, in this (fresh) process (see :data:`COLUMNS`).

    ``first_call_s`` is what a user waits for: the first call of a fresh function object
    (``f(*args)``: trace, passes, lower, compile, run), made first in the process. Then, on a fresh
    instance of the program, the stages one by one (``f.trace``, ``.lower``, ``.compile``, a call) and
    for hlopass each pass's own seconds from the report: a breakdown, in a process already warm.
    """
    import jax
    import hlopass  # noqa: F401 - imported before the program is built, as a user's script does
    fn, args = PROGRAMS[name]()
    jax.block_until_ready(args)
    f = _jitted(column, fn, args)
    start, cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(f(*args))
    result = {"first_call_s": time.perf_counter() - start, "first_call_cpu_s": time.process_time() - cpu}
    if column.endswith("_cached"):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        result["second_call_s"] = time.perf_counter() - start  # the program's own run, compiled
        return result
    fn, args = PROGRAMS[name]()
    times, traced = _staged(_jitted(column, fn, args), args)
    result.update(times)
    if column == "plain":
        result["largest_intermediate_bytes"] = _largest_intermediate(fn, args)
    else:
        report = traced.report
        result["passes_s"] = {p.name: p.seconds for p in report.passes}
        result["rewrites"] = sum(len(p.rewrites) for p in report.passes)
    return result


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_child(name: str, column: str, env: dict | None = None, root: str = ROOT) -> dict:
    """One child: ``python -m tools.bench_compile --child NAME:COLUMN`` in ``root`` (whose hlopass it
    imports: the checkout to measure)."""
    try:
        done = subprocess.run([sys.executable, "-m", "tools.bench_compile", "--child", f"{name}:{column}"],
                              cwd=root, capture_output=True, text=True, timeout=TIMEOUT_S,
                              env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        return {"status": f"no result after {TIMEOUT_S} s"}
    for line in done.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    tail = (done.stderr or done.stdout).strip().splitlines()[-2:]
    return {"status": "failed: " + " | ".join(tail)}


def run_once(name: str, column: str, root: str = ROOT, env: dict | None = None) -> dict:
    """One timed child of a column; a ``*_cached`` column's child gets a fresh persistent cache,
    filled by a child of the uncached column first (not timed)."""
    if not column.endswith("_cached"):
        return run_child(name, column, env, root=root)
    cache = tempfile.mkdtemp(prefix="bench_compile_cache_")
    env = {**(env or {}), "JAX_COMPILATION_CACHE_DIR": cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    try:
        filled = run_child(name, column.removesuffix("_cached"), env, root)
        return filled if "first_call_s" not in filled else run_child(name, column, env, root)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def run_program(name: str, columns: list[str], repeat: int, baseline: str | None) -> dict:
    """Every column of one program, ``repeat`` rounds, the columns interleaved within each round (so
    a shared machine's load hits them alike); with a ``baseline`` checkout its hlopass columns run
    in the same rounds (``baseline:nothing``...). Per column: the run with the median first call,
    and every first call (``first_calls_s``)."""
    keys = [(c, ROOT) for c in columns]
    if baseline:
        keys += [(c, baseline) for c in columns if not c.startswith("plain")]
    runs: dict = {key: [] for key in keys}
    env = {}
    if any(c.startswith("forced") for c in columns):   # found in a child of its own (FORCED_THRESHOLD_ENV)
        found = run_child(name, "threshold")
        if "threshold" in found:
            env[FORCED_THRESHOLD_ENV] = str(found["threshold"])
        else:
            print(f"  {name}: no threshold from its own child ({found.get('status')}); each forced child "
                  f"finds it before its timed call", flush=True)
    for _ in range(repeat):
        for column, root in keys:
            if runs[(column, root)] and "first_call_s" not in runs[(column, root)][-1]:
                continue
            runs[(column, root)].append(run_once(name, column, root, env))
    row = {}
    for (column, root), got in runs.items():
        name_ = column if root == ROOT else f"baseline:{column}"
        if "first_call_s" not in got[-1]:
            row[name_] = got[-1]
            continue
        got.sort(key=lambda r: r["first_call_s"])
        row[name_] = dict(got[len(got) // 2], first_calls_s=[round(r["first_call_s"], 3) for r in got],
                          first_call_cpu_s_median=sorted(r.get("first_call_cpu_s", 0.0) for r in got)[len(got) // 2])
    return row


def _acceptance(column: str, value: float, plain: float, rewrites: int = 0) -> str:
    """Issue 27's bound for the column: nothing set and nothing rewritten 1.1x plain + 0.2 s, rewrites
    (forced, or nothing set where a pass rewrites anyway) 2x, cached 1.2x."""
    if column == "nothing" and rewrites:
        column = "forced"
    bound = {"nothing": 1.1 * plain + 0.2, "forced": 2 * plain, "nothing_cached": 1.2 * plain,
             "forced_cached": 1.2 * plain}.get(column)
    return "" if bound is None else ("ok" if value <= bound else f"over {bound:.2f} s")


def _passes_from_this_checkout() -> None:
    """Import ``hlopass.passes`` from this checkout's ``passes/``. An editable install maps that name
    to the installed checkout's folder whatever the working directory, so a baseline child would
    otherwise run its own engine with this checkout's passes."""
    import importlib.abc
    import importlib.machinery
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    class ThisCheckout(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != "hlopass.passes":
                return None  # its submodules follow the package's __path__
            return importlib.machinery.PathFinder.find_spec(fullname, [root])
    sys.meta_path.insert(0, ThisCheckout())


def _compile_sources(root: str = ROOT) -> None:
    """Write the bytecode of ``root``'s hlopass, its passes and the fixtures, as ``pip install`` does:
    where ``PYTHONDONTWRITEBYTECODE`` is set, a child would otherwise compile every hlopass module from
    source on import, a cost ``jax.jit`` (installed with its bytecode) does not pay. A ``--baseline``
    checkout's too: without it, its columns paid that cost (0.15 s on the CNN, which rewrites nothing)."""
    import compileall
    for folder in ("hlopass", "passes", "fixtures", "tools"):
        compileall.compile_dir(os.path.join(root, folder), quiet=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", default=",".join(PROGRAMS))
    parser.add_argument("--columns", default="plain,nothing,forced",
                        help=f"comma-separated, of {', '.join(COLUMNS)}")
    parser.add_argument("--repeat", type=int, default=1, help="children per column; the median is reported")
    parser.add_argument("--baseline", default=None, metavar="DIR",
                        help="a checkout of hlopass to compare with (a git worktree of an earlier commit, with "
                             "this file in its tools/): its hlopass columns run interleaved with these")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _passes_from_this_checkout()
        name, column = args.child.split(":")
        result = {"threshold": forced_threshold(name)} if column == "threshold" else measure(name, column)
        print(RESULT + json.dumps(result), flush=True)
        return 0
    columns = [c for c in args.columns.split(",") if c]
    unknown = sorted(set(columns) - set(COLUMNS))
    if unknown:
        parser.error(f"unknown column(s) {', '.join(unknown)}; known: {', '.join(COLUMNS)}")
    for root in (ROOT, *([os.path.abspath(args.baseline)] if args.baseline else [])):
        _compile_sources(root)
    rows = []
    for name in harness.progress(args.programs.split(","), "programs"):
        row = {"program": name, "doc": PROGRAMS[name].__doc__.split("\n")[0]}
        row.update(run_program(name, columns, args.repeat, args.baseline and os.path.abspath(args.baseline)))
        rows.append(row)
        cells = []
        shown = columns + [f"baseline:{c}" for c in columns if args.baseline and not c.startswith("plain")]
        for column in shown:
            col = row[column]
            if "first_call_s" not in col:
                cells.append(f"{column}: {col.get('status')}")
                continue
            text = f"{column} {col['first_call_s']:.2f} s"
            base = row.get("plain_cached" if column.endswith("_cached") else "plain", {}).get("first_call_s")
            if base and not column.startswith("plain"):
                col["ratio_first_call"] = col["first_call_s"] / base
                verdict = _acceptance(column.removeprefix("baseline:"), col["first_call_s"], base, col.get("rewrites", 0))
                text += f" ({col['ratio_first_call']:.2f}x{', ' + verdict if verdict else ''})"
                plain_second = row.get("plain_cached", {}).get("second_call_s")
                if col.get("second_call_s") is not None and plain_second is not None:
                    # what the first call adds to the program's own run, beside plain's: a rewritten
                    # program may run slower (loops over slices under a forced threshold), which is not
                    # a cost of the first call
                    col["overhead_s"] = col["first_call_s"] - col["second_call_s"]
                    text += f" [less a call {col['overhead_s']:.2f} s, plain's {base - plain_second:.2f} s]"
            if col.get("passes_s"):
                slowest = sorted(col["passes_s"].items(), key=lambda kv: -kv[1])[:2]
                text += " [" + ", ".join(f"{k} {v:.2f} s" for k, v in slowest) + f"; {col['rewrites']} rewrites]"
            cells.append(text)
        print(f"{name:<24} " + " | ".join(cells), flush=True)
        harness.write_json(args.json, {"columns": columns, "repeat": args.repeat, "baseline": args.baseline,
                                       "rows": rows}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
