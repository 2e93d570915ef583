"""JAX's own tests through hlopass: JAX 0.10.2's test files with ``jax.jit`` routed to ``hlopass.jit``.

    python -m tools.peer_tests                         # the seven files, all cases; writes tools/results/peer_tests.md
    python -m tools.peer_tests --files reducers,einsum -k "testEinsum" --json out.json
    python -m tools.peer_tests --files lax --no-baseline --threshold 8

The test files are read from ``shared/peer-tests/jax-0.10.2/`` beside the repository (or a folder above it;
``--peer-dir``, or ``HLOPASS_PEER_DIR``);
they need ``absl-py`` (``bash tools/test.sh`` installs it). Each file runs in its own pytest process
(``--jobs`` at a time) with this module as a plugin: ``jax.jit`` and ``jax._src.api.jit`` called from a
test module or from ``jax._src.test_util`` (``_CompileAndCheck``, ``check_grads``'s helpers) become
``hlopass.jit(f, threshold=T, split_size=S, **jit_kwargs)``; JAX's own internal uses of ``jit`` stay
as they are.

**Making rewrites fire.** JAX's test arrays are tiny (a few to a few hundred elements), so the default
threshold ``1`` byte (``--threshold``) makes every tensor "large": every reduction, contraction, top-k
or cumulative op whose result is smaller than its operand seeds a split, cut into one-element slices
(``--split-size``, default the threshold); chains and expansions are considered at every size. The
report of every pipeline run is counted per test, so the summary says how many tests had at least
one rewrite, by pass and kind.

Passes run with ``HLOPASS_RAISE_PASS_ERRORS=1`` and ``HLOPASS_CHECK_PASSES=1``: a pass that fails fails
the test (by default hlopass would skip the pass and log it).

**Triage.** A test that fails with hlopass is re-run without it (``--no-baseline`` skips this); a failure
that also happens without hlopass is JAX's or the machine's, not ours. The rest is sorted into
categories by the failure text: tests of ``jax.jit`` internals (private attributes and stages, trace or
compile counts asserted by the test, ``repr``) are expected; everything else is a defect.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from tools import harness

ROOT = Path(__file__).resolve().parent.parent
FILES = {
    "reducers": "lax_numpy_reducers_test.py",
    "einsum": "lax_numpy_einsum_test.py",
    "indexing": "lax_numpy_indexing_test.py",
    "autodiff": "lax_autodiff_test.py",
    "linalg": "linalg_test.py",
    "lax": "lax_test.py",
    "api": "api_test.py",
}
ENV_ROUTE = "HLOPASS_PEER_ROUTE"          # "1": the plugin routes jax.jit to hlopass.jit
ENV_THRESHOLD = "HLOPASS_PEER_THRESHOLD"
ENV_SPLIT = "HLOPASS_PEER_SPLIT_SIZE"
ENV_STATS = "HLOPASS_PEER_STATS"          # where the plugin writes rewrites per test (JSON)
ENV_EAGER = "HLOPASS_PEER_EAGER"          # "1" (default): eager jnp.*/lax.* calls in test modules go through hlopass


def default_peer_dir() -> Path:
    """``HLOPASS_PEER_DIR``, else ``shared/peer-tests/jax-0.10.2`` beside the repository or a folder above it."""
    if os.environ.get("HLOPASS_PEER_DIR"):
        return Path(os.environ["HLOPASS_PEER_DIR"])
    for parent in ROOT.parents:
        candidate = parent / "shared" / "peer-tests" / "jax-0.10.2"
        if candidate.exists():
            return candidate
    return ROOT.parent / "shared" / "peer-tests" / "jax-0.10.2"


# ------------------------------------------------------------------------------------- the plugin
_stats: dict[str, collections.Counter] = {}
_current = ["<collection>"]


def _caller_routes(module: str) -> bool:
    return module.endswith("_test") or module in ("jax._src.test_util", "jax._src.public_test_util")


def install() -> None:
    """Route ``jax.jit`` (called from test modules and JAX's test utilities) to ``hlopass.jit``."""
    import jax
    from hlopass import internals as jx

    import hlopass
    import hlopass.call
    import hlopass.checked

    real_jit = jx.api_module.jit
    threshold = os.environ.get(ENV_THRESHOLD, "1")
    split_size = os.environ.get(ENV_SPLIT, threshold)

    def jit(fun=None, /, *args, **kwargs):
        module = sys._getframe(1).f_globals.get("__name__", "")
        if not _caller_routes(module) or args:
            return real_jit(fun, *args, **kwargs) if fun is not None else real_jit(*args, **kwargs)
        if fun is None:
            return lambda f: hlopass.jit(f, threshold=threshold, split_size=split_size, **kwargs)
        return hlopass.jit(fun, threshold=threshold, split_size=split_size, **kwargs)

    jit.__wrapped__ = real_jit
    jax.jit = jit
    jx.api_module.jit = jit

    original = hlopass.call.run_pipeline

    def counting(*a, **k):
        result = original(*a, **k)
        counter = _stats.setdefault(_current[0], collections.Counter())
        counter["pipelines"] += 1
        for rewrite in result.report.rewrites:
            counter[f"{rewrite.pass_name}:{rewrite.kind}"] += 1
        return result
    hlopass.call.run_pipeline = counting  # the lowering rule
    hlopass.checked.run_pipeline = counting  # the primitive's eager calls (eager jax.grad / jax.vmap)


#: jnp/lax names whose eager calls are not routed: they return dtypes, shapes or Python values.
NOT_ROUTED = {"issubdtype", "result_type", "promote_types", "can_cast", "iinfo", "finfo", "shape", "ndim", "size",
              "isscalar", "iscomplexobj", "isrealobj", "dtype", "isdtype", "broadcast_shapes", "get_printoptions",
              "printoptions", "set_printoptions", "load", "save", "savez", "frompyfunc", "vectorize",
              "einsum_path"}


class _Routed:
    """An eager ``jnp``/``lax`` function called through ``hlopass.jit`` (array arguments dynamic,
    everything else closed over); attributes (``jnp.add.reduce``) pass through."""

    def __init__(self, fn, name):
        self._fn, self._name = fn, name

    def __getattr__(self, attr):
        return getattr(self._fn, attr)

    def __call__(self, *args, **kwargs):
        import jax
        import numpy as np
        from hlopass import internals as jx

        flat, tree = jax.tree_util.tree_flatten((args, kwargs))
        if any(isinstance(x, jx.Tracer) for x in flat):
            return self._fn(*args, **kwargs)         # inside a trace: the enclosing jit sees it
        arrays = [i for i, x in enumerate(flat) if isinstance(x, (np.ndarray, jax.Array)) and x.dtype != object]
        if not arrays:
            return self._fn(*args, **kwargs)
        try:
            return self._staged(flat, tree, arrays)
        except (TypeError, jax.errors.ConcretizationTypeError) as err:
            if "not a valid JAX type" in str(err):   # returns a Python value, not arrays
                return self._fn(*args, **kwargs)
            # a NumPy integer array that the function needs as a concrete value (split sizes, a
            # shape): close over NumPy integer arrays, as a user would with static_argnums
            concrete = [i for i in arrays if not (isinstance(flat[i], np.ndarray)
                                                  and np.issubdtype(flat[i].dtype, np.integer))]
            if concrete == arrays:
                raise
            try:
                return self._staged(flat, tree, concrete)
            except Exception:
                raise err from None

    def _staged(self, flat, tree, dynamic):
        import jax

        import hlopass
        fn = self._fn

        def staged(*values):
            full = list(flat)
            for i, v in zip(dynamic, values):
                full[i] = v
            a, k = jax.tree_util.tree_unflatten(tree, full)
            return fn(*a, **k)
        staged.__name__ = self._name
        threshold = os.environ.get(ENV_THRESHOLD, "1")
        return hlopass.jit(staged, threshold=threshold, split_size=os.environ.get(ENV_SPLIT, threshold))(
            *[flat[i] for i in dynamic])


class _RoutedModule:
    def __init__(self, module):
        self._module = module
        self._cache = {}

    def __getattr__(self, name):
        value = getattr(self._module, name)
        if name in NOT_ROUTED or isinstance(value, type) or not callable(value) or name.startswith("_"):
            return value
        if name not in self._cache:
            self._cache[name] = _Routed(value, name)
        return self._cache[name]


def pytest_configure(config):
    if os.environ.get(ENV_ROUTE) == "1":
        install()


def pytest_collection_modifyitems(session, config, items):
    """With HLOPASS_PEER_EAGER=1, eager ``jnp.*`` and ``lax.*`` calls in test modules go through hlopass too."""
    if os.environ.get(ENV_ROUTE) != "1" or os.environ.get(ENV_EAGER, "1") != "1":
        return
    import jax.numpy as jnp
    from jax import lax
    for module in {id(item.module): item.module for item in items if getattr(item, "module", None)}.values():
        for name, real in (("jnp", jnp), ("lax", lax)):
            if getattr(module, name, None) is real:
                setattr(module, name, _RoutedModule(real))


def pytest_runtest_setup(item):
    _current[0] = item.nodeid


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get(ENV_STATS)
    if path and os.environ.get(ENV_ROUTE) == "1":
        Path(path).write_text(json.dumps({k: dict(v) for k, v in _stats.items()}))


# ---------------------------------------------------------------------------------------- running
def _pytest(peer_dir: Path, targets: list[str], route: bool, junit: Path, extra_env: dict, stats: Path | None,
            timeout: float) -> float:
    env = dict(os.environ)
    env.update(extra_env)
    env[ENV_ROUTE] = "1" if route else "0"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tools"), str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("JAX_NUM_GENERATED_CASES", "3")
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    if stats:
        env[ENV_STATS] = str(stats)
    for name in ("HLOPASS_TENSOR_SIZE_THRESHOLD", "HLOPASS_TENSOR_SPLIT_SIZE", "HLOPASS_PASSES"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "peer_tests", "--rootdir",
           str(peer_dir), "-o", "addopts=", "--junitxml", str(junit), *targets]
    with harness.stopwatch() as clock:
        subprocess.run(cmd, cwd=peer_dir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=timeout)
    return clock.seconds


def _outcomes(junit: Path) -> dict[str, dict]:
    """nodeid-ish key -> {"outcome": passed|failed|skipped, "message", "text"}."""
    out = {}
    if not junit.exists():
        return out
    for case in ET.parse(junit).getroot().iter("testcase"):
        key = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        outcome, message, text = "passed", "", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message, text = "failed", child.get("message", ""), child.text or ""
            elif child.tag == "skipped":
                outcome = "skipped"
        out[key] = {"outcome": outcome, "message": message, "text": text}
    return out


#: (category, expected?, pattern on the failure message + traceback). First match wins.
CATEGORIES = [
    ("jit internals: trace, lowering or compile counts asserted by the test", True,
     r"count_(jit|pjit|aot)|cache_miss|tracing_count|lowering_count|_cache_size|assert_num_jit|"
     r"count_primitive_compiles|count_jit_and_pmap"),
    ("jit internals: private attributes, stages or types of the jitted object", True,
     r"object has no attribute|'HlopassFunction'|HlopassFunction|hlopass\.api\.Traced|Lowered|"
     r"isinstance\(.*(stages|pjit)"),
    ("jit internals: repr, names, docstrings", True, r"repr\(|__name__|__qualname__|__doc__"),
    ("defect: RecursionError (jax.disable_jit)", False, r"RecursionError"),
    ("defect: no lowering / transformation rule for hlopass_call", False, r"hlopass_call"),
    ("defect: a bad argument is not rejected as jax.jit rejects it", False,
     r"DID NOT RAISE|not raised|Exception not raised"),
    ("defect: values differ from jax.jit's", False,
     r"Not equal to tolerance|not almost equal|Arrays are not equal|Mismatched elements|mismatch"),
    ("defect: a pass failed (HLOPASS_RAISE_PASS_ERRORS)", False, r"passes/\w+/\w+\.py|hlopass/pipeline\.py"),
    ("defect: other", False, r""),
]


def categorise(message: str, text: str) -> tuple[str, bool]:
    blob = message + "\n" + text
    for name, expected, pattern in CATEGORIES:
        if re.search(pattern, blob):
            return name, expected
    return CATEGORIES[-1][0], False


def run(files: list[str], peer_dir: Path, selection: str | None, jobs: int, baseline: bool, threshold: str,
        split_size: str, timeout: float, workdir: Path) -> dict:
    """Run ``files`` with routing on; returns outcomes, rewrite counts and the triage."""
    extra = {ENV_THRESHOLD: threshold, ENV_SPLIT: split_size}
    seconds: dict[str, float] = {}
    pending = list(files)
    running: list = []

    def launch(name):
        junit, stat = workdir / f"{name}.xml", workdir / f"{name}.stats.json"
        targets = [FILES[name]] + (["-k", selection] if selection else [])
        env = dict(os.environ)
        env.update(extra)
        env[ENV_ROUTE] = "1"
        env[ENV_STATS] = str(stat)
        env.update(HLOPASS_RAISE_PASS_ERRORS="1", HLOPASS_CHECK_PASSES="1")  # a failing pass fails the test
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tools"), str(ROOT), env.get("PYTHONPATH", "")])
        env.setdefault("JAX_NUM_GENERATED_CASES", "3")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "peer_tests", "--rootdir",
               str(peer_dir), "-o", "addopts=", "--junitxml", str(junit), *targets]
        return name, junit, stat, time.perf_counter(), subprocess.Popen(
            cmd, cwd=peer_dir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    bar = harness.Progress(len(pending), "peer_tests")
    while pending or running:
        while pending and len(running) < jobs:
            running.append(launch(pending.pop(0)))
        time.sleep(0.5)
        for item in list(running):
            name, junit, stat, start, proc = item
            if proc.poll() is None and time.perf_counter() - start < timeout:
                continue
            if proc.poll() is None:
                proc.kill()
            running.remove(item)
            seconds[name] = time.perf_counter() - start
            bar.update(note=name)
    bar.close()

    return summarise(files, peer_dir, selection, baseline, threshold, split_size, timeout, workdir, seconds)


def summarise(files, peer_dir: Path, selection, baseline: bool, threshold: str, split_size: str, timeout: float,
              workdir: Path, seconds: dict | None = None) -> dict:
    """Read the JUnit reports and rewrite counts in ``workdir``, re-run failures without hlopass, triage."""
    seconds = seconds or {}
    results: dict[str, dict] = {}
    stats: dict[str, dict] = {}
    files = [name for name in files if (workdir / f"{name}.xml").exists()]
    for name in files:
        for key, value in _outcomes(workdir / f"{name}.xml").items():
            results[f"{name}:{key}"] = value
        stat = workdir / f"{name}.stats.json"
        if stat.exists():
            for nodeid, counts in json.loads(stat.read_text()).items():
                stats[f"{name}:{nodeid}"] = counts
    failed = {k: v for k, v in results.items() if v["outcome"] == "failed"}
    if baseline and failed:
        by_file = collections.defaultdict(list)
        for key in failed:
            name, rest = key.split(":", 1)
            by_file[name].append(rest.split("::", 1)[1])
        for name, tests in by_file.items():
            junit = workdir / f"{name}.baseline.xml"
            expr = " or ".join(sorted(set(re.sub(r"[^A-Za-z0-9_]", " ", t).split()[0] for t in tests)))
            _pytest(peer_dir, [FILES[name], "-k", expr], False, junit, {}, None, timeout)
            plain = _outcomes(junit)
            for key in [k for k in failed if k.startswith(name + ":")]:
                base = plain.get(key.split(":", 1)[1])
                failed[key]["baseline"] = base["outcome"] if base else "not run"

    triage = {}
    for key, value in failed.items():
        if value.get("baseline") == "failed":
            triage[key] = ("fails without hlopass too", True)
        else:
            triage[key] = categorise(value["message"], value["text"])
    rewritten = collections.Counter()
    tests_with_rewrites = 0
    for key, counts in stats.items():
        kinds = {k: v for k, v in counts.items() if k != "pipelines"}
        if kinds:
            tests_with_rewrites += 1
        for k, v in kinds.items():
            rewritten[k] += v
    return {"files": files, "selection": selection, "threshold": threshold, "split_size": split_size,
            "seconds": seconds, "outcomes": collections.Counter(v["outcome"] for v in results.values()),
            "per_file": {n: collections.Counter(v["outcome"] for k, v in results.items() if k.startswith(n + ":"))
                         for n in files},
            "tests_with_rewrites": tests_with_rewrites, "rewrites": rewritten,
            "failures": {k: {"category": triage[k][0], "expected": triage[k][1],
                             "message": failed[k]["message"][:300], "baseline": failed[k].get("baseline")}
                         for k in sorted(failed)}}


def markdown(summary: dict, command: str) -> str:
    lines = ["# JAX 0.10.2's own tests through hlopass", "",
             f"Command: `{command}` (JAX_NUM_GENERATED_CASES={os.environ.get('JAX_NUM_GENERATED_CASES', '3')}; "
             f"threshold {summary['threshold']} B, split size {summary['split_size']} B). "
             f"Machine: 2 shared CPU cores; {time.strftime('%Y-%m-%d')}.", "",
             harness.markdown_table(["file", "passed", "failed", "skipped", "seconds"], [
                 [FILES[name], *(summary["per_file"].get(name, {}).get(k, 0) for k in ("passed", "failed", "skipped")),
                  f"{summary['seconds'].get(name, 0):.0f}"] for name in summary["files"]])]
    lines += ["", f"Tests in which at least one rewrite fired: {summary['tests_with_rewrites']}. "
              "Rewrites, by pass and kind: " + ", ".join(f"{k} {v}" for k, v in
                                                         sorted(summary['rewrites'].items(), key=lambda kv: -kv[1])),
              "", "## Failures by category", ""]
    by_cat = collections.defaultdict(list)
    for key, f in summary["failures"].items():
        by_cat[(not f["expected"], f["category"])].append((key, f))
    for (_, cat), items in sorted(by_cat.items()):
        lines.append(f"### {cat} ({len(items)})")
        lines.append("")
        for key, f in items:
            message = " ".join(f["message"].split())[:160]
            lines.append(f"- `{key}`: {message}")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", default=",".join(FILES), help=f"comma-separated, of {', '.join(FILES)}")
    parser.add_argument("-k", dest="selection", default=None, help="pytest -k expression")
    parser.add_argument("--threshold", default="1", help="hlopass threshold for routed functions (bytes or size)")
    parser.add_argument("--split-size", default=None, help="hlopass split size (default: the threshold)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per file")
    parser.add_argument("--no-baseline", dest="baseline", action="store_false")
    parser.add_argument("--peer-dir", type=Path, default=None)
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the JUnit reports here; with --summarise-only, read them from here")
    parser.add_argument("--summarise-only", action="store_true", help="triage the reports already in --workdir")
    parser.add_argument("--json", type=Path, default=None, help="write the summary as JSON")
    parser.add_argument("--markdown", type=Path, default=None,
                        help="write the summary as markdown (default for a full run: tools/results/peer_tests.md)")
    args = parser.parse_args(argv)
    peer_dir = args.peer_dir or default_peer_dir()
    if not (peer_dir / FILES["reducers"]).exists():
        print(f"error: JAX's test files are not in {peer_dir} (--peer-dir or HLOPASS_PEER_DIR)", file=sys.stderr)
        return 2
    files = [f.strip() for f in args.files.split(",") if f.strip()]
    unknown = [f for f in files if f not in FILES]
    if unknown:
        print(f"error: --files: unknown {unknown}; choose from {', '.join(FILES)}", file=sys.stderr)
        return 2
    split_size = args.split_size or args.threshold
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        if args.summarise_only:
            summary = summarise(files, peer_dir, args.selection, args.baseline, args.threshold, split_size,
                                args.timeout, workdir)
        else:
            summary = run(files, peer_dir, args.selection, args.jobs, args.baseline, args.threshold, split_size,
                          args.timeout, workdir)
    command = "python -m tools.peer_tests " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    md_path = args.markdown or (ROOT / "tools" / "results" / "peer_tests.md"
                                if args.files == ",".join(FILES) and not args.selection else None)
    if md_path:
        md_path.write_text(markdown(summary, command.strip()))
    defects = [k for k, f in summary["failures"].items() if not f["expected"]]
    print(f"{dict(summary['outcomes'])}; tests with rewrites: {summary['tests_with_rewrites']}; "
          f"rewrites: {dict(summary['rewrites'])}")
    for key, f in summary["failures"].items():
        print(f"{'DEFECT' if not f['expected'] else 'expected'}  {key}  [{f['category']}]  {f['message'][:120]!r}")
    return 1 if defects else 0


if __name__ == "__main__":
    sys.exit(main())
