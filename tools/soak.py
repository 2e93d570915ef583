"""A soak of the differential fuzzer: many fresh programs, every mismatch a failure, minimised and classified.

``python -m tools.soak --programs 20000 [--workers 2] [--out tools/results/soak.json]`` runs fresh seeds of
the frontier vocabulary (``s...``: ``tests/fuzz/programs.vocabulary``) through ``tests.fuzz.runner`` in
worker processes, a chunk of seeds per worker run, as the CI fuzzer runs them (XLA's fast flag, a
difference seen only there re-run at the default flags and dropped if it goes; passes raise; each result
type-checked; the rewritten program always run), with ``HLOPASS_FUZZ_STRICT_FRESH`` semantics: any
mismatch or crash of a fresh program is a failure (the exit status is 1). Every ``--sharded-every``-th
chunk runs on 4 host devices (``--devices 4``: sharded inputs, ``shard_map``).

It is resumable: after each chunk the counts are merged into ``--out`` (written atomically), and a
second run adds to them until ``--programs`` are done; ``--minutes`` stops it after that long (chunks
under way finish). Then each mismatch not yet minimised is shrunk (``runner.minimise``: the program's
recorded choices replayed towards the simplest while it fails the same way; default XLA flags) and
classified: by kind (value mismatch, gradient mismatch, crash, pass skipped), by pass (the one that
raised, or those that rewrote the minimised program), by primitive family and by vocabulary piece.
``--minimise-only`` does just that on an existing file. ``--rejudge`` runs a file's mismatches again with
this checkout's judge, when the code under test is the soaked commit's (:func:`rejudge_all`).

It soaks the checkout it runs from, with that checkout's own environment (its ``.venv``): it stops
with an error when the workers would import ``hlopass`` or its passes from elsewhere, and the file
lists the commit of each run (``code``: the commit, whether tracked files differed from it, where
the packages came from).

The file holds: the code soaked, programs, batches, chunks, wall and CPU seconds, programs per wall second, programs by
mode, by vocabulary piece and under a memory limit, rewrites by pass and kind, programs redrawn by
exclusions, the differences judged rounding (and the other judged kinds), the mismatches (each with its
reproducing command and its minimised program) and their counts by kind, pass, family and piece.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time

from tools.harness import RESULTS, ROOT

DEFAULT_OUT = os.path.join(RESULTS, "soak.json")
FAST_FLAG = "--xla_backend_optimization_level=0"   # tests.fuzz.runner.FAST_FLAG (not imported: no JAX here)
COUNTERS = ("by_mode", "by_piece", "rewrites", "excluded")
JUDGED = ("as_accurate", "overflow")
LISTED = ("fwdrev", "unguarded", "fast_flag_only", "reference_failed", "ill_conditioned", "as_written", "ynn_only")


def fresh_seeds(count: int) -> list[str]:
    """``count`` new seeds of the frontier vocabulary (``s`` and 40 random bits)."""
    return [f"s{random.SystemRandom().getrandbits(40)}" for _ in range(count)]


def worker_env(default_flags: bool = False) -> dict:
    """The environment of a worker: the test suite's settings, XLA's fast flag unless ``default_flags``."""
    flags = os.environ.get("XLA_FLAGS", "").replace(FAST_FLAG, "").strip()
    if not default_flags:
        flags = (flags + " " + FAST_FLAG).strip()
    return dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
                HLOPASS_RAISE_PASS_ERRORS="1", HLOPASS_CHECK_PASSES="1", HLOPASS_NEVER_WORSE="0",
                JAX_PLATFORMS="cpu", XLA_FLAGS=flags)


def code_under_test() -> dict:
    """Where the workers' ``hlopass`` and ``hlopass.passes`` come from, and this checkout's commit (and
    whether its tracked files differ from it). Raises ``SystemExit`` when either package is not this
    checkout's: an editable install maps ``hlopass.passes`` to the installed checkout's ``passes/``
    whatever ``PYTHONPATH`` says, so a worktree run with another checkout's environment would test
    that checkout's passes as they are edited."""
    probe = ("import importlib.util as u; import hlopass; "
             "print(hlopass.__file__); print(u.find_spec('hlopass.passes').origin)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=worker_env(), capture_output=True, text=True,
                          check=True)
    engine, passes = done.stdout.split()[-2:]
    for name, path in (("hlopass", engine), ("hlopass.passes", passes)):
        if os.path.commonpath([os.path.realpath(path), os.path.realpath(ROOT)]) != os.path.realpath(ROOT):
            raise SystemExit(f"tools.soak: the workers would import {name} from {path}, not from this checkout "
                             f"({ROOT}): run the soak with this checkout's own environment "
                             f"(bash tools/setup.sh test && .venv/bin/python -m tools.soak ...)")

    def git(*words):
        return subprocess.run(["git", *words], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "hlopass": engine, "passes": passes}


def empty_state(target: int) -> dict:
    """A soak file with nothing run yet."""
    now = datetime.datetime.now().isoformat(timespec="seconds")
    return {"command": "", "target": target, "programs": 0, "batches": 0, "chunks": 0, "sharded_programs": 0,
            "memory_limited_programs": 0, "wall_seconds": 0.0, "cpu_seconds": 0.0, "programs_per_second": None,
            "started": now, "updated": now, "machine": {}, "seeds": [],
            **{k: {} for k in COUNTERS}, "by_pass": {}, **{k: 0 for k in JUDGED}, **{k: [] for k in LISTED},
            "mismatches": [], "mismatch_counts": {}}


def load_state(path: str, target: int) -> dict:
    """The soak file at ``path`` (its counts so far), or an empty one."""
    if os.path.exists(path):
        with open(path) as fh:
            state = json.load(fh)
        state["target"] = max(target, state.get("target", 0))
        base = empty_state(target)
        for key, value in base.items():
            state.setdefault(key, value)
        return state
    return empty_state(target)


def save_state(path: str, state: dict) -> None:
    """Write ``state`` to ``path`` atomically (a killed soak leaves the last whole file)."""
    state["updated"] = datetime.datetime.now().isoformat(timespec="seconds")
    state["programs_per_second"] = state["programs"] / state["wall_seconds"] if state["wall_seconds"] else None
    state["mismatch_counts"] = mismatch_counts(state["mismatches"])
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(os.path.abspath(path)), delete=False,
                                     suffix=".tmp") as fh:
        json.dump(state, fh, indent=1, sort_keys=True)
    os.replace(fh.name, path)


def add_judged(state: dict, part: dict) -> None:
    """Add a worker's judged differences (counts and lists, not its failures) to ``state``."""
    for key in JUDGED:
        state[key] += part.get(key, 0)
    for key in LISTED:
        state[key] += [x if isinstance(x, str) else f"{x.get('program')}: {x.get('problem')}"
                       for x in part.get(key, [])]


def merge(state: dict, part: dict, seeds: list[str], devices: int) -> None:
    """Add one worker's summary (``runner.run_seeds``) to ``state``."""
    state["programs"] += part["programs"]
    state["batches"] += part["batches"]
    state["chunks"] += 1
    state["cpu_seconds"] += part.get("cpu_seconds", 0.0)
    state["seeds"] += seeds
    state["memory_limited_programs"] += part.get("memory_limited", 0)
    if devices > 1:
        state["sharded_programs"] += part["programs"]
    for key, source in (("by_mode", "modes"), ("by_piece", "pieces"), ("rewrites", "rewrites"),
                        ("excluded", "excluded")):
        counter = collections.Counter(state[key])
        counter.update(part.get(source, {}))
        state[key] = dict(counter)
    by_pass = collections.Counter()
    for name, count in state["rewrites"].items():
        by_pass[name.split(":")[0]] += count
    state["by_pass"] = dict(by_pass)
    add_judged(state, part)
    for failure in part["failures"]:
        failure = dict(failure, devices=devices, minimised=None)
        failure["traceback"] = failure.get("traceback", "")[-3000:]
        state["mismatches"].append(failure)


def mismatch_counts(mismatches: list[dict]) -> dict:
    """The mismatches counted by kind, by pass, by primitive family and by vocabulary piece (of the
    minimised program where there is one)."""
    counts = {k: collections.Counter() for k in ("by_kind", "by_pass", "by_family", "by_piece")}
    for m in mismatches:
        small = m.get("minimised") or {}
        counts["by_kind"][m.get("kind") or "unknown"] += 1
        passes = [m["pass"]] if m.get("pass") else sorted({r.split(":")[0] for r in small.get("rewrites", {})})
        for name in passes or ["none"]:
            counts["by_pass"][name] += 1
        for family in small.get("families") or ["unknown"]:
            counts["by_family"][family] += 1
        for piece in small.get("pieces") or m.get("pieces") or []:
            counts["by_piece"][piece] += 1
    return {k: dict(v) for k, v in counts.items()}


def run_chunks(state: dict, args, path: str) -> None:
    """Run chunks of fresh seeds in ``args.workers`` processes until the target or the time is reached."""
    started = time.perf_counter()
    deadline = started + 60 * args.minutes if args.minutes else None
    running: list[tuple] = []
    launched = state["chunks"]
    pending_programs = 0

    def launch():
        nonlocal launched, pending_programs
        devices = 4 if args.sharded_every and launched % args.sharded_every == args.sharded_every - 1 else 1
        size = args.size if devices == 1 else max(1, args.size // 2)
        seeds = fresh_seeds(args.chunk)
        out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
        log = tempfile.NamedTemporaryFile(suffix=".log", delete=False).name
        cmd = [sys.executable, "-m", "tests.fuzz.runner", "--seeds", ",".join(seeds), "--size", str(size),
               "--json", out] + (["--devices", str(devices)] if devices > 1 else [])
        with open(log, "w") as fh:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=worker_env(), stdout=fh, stderr=subprocess.STDOUT)
        launched += 1
        pending_programs += len(seeds) * size
        running.append((proc, seeds, devices, size, out, log, time.perf_counter()))

    last = time.perf_counter()
    while True:
        enough = state["programs"] + pending_programs >= state["target"]
        late = deadline is not None and time.perf_counter() >= deadline
        while len(running) < args.workers and not enough and not late:
            launch()
            enough = state["programs"] + pending_programs >= state["target"]
        if not running:
            break
        time.sleep(2)
        for item in list(running):
            proc, seeds, devices, size, out, log, t0 = item
            timed_out = time.perf_counter() - t0 > args.chunk_timeout
            if proc.poll() is None and not timed_out:
                continue
            if timed_out and proc.poll() is None:
                proc.kill()
                proc.wait()
            running.remove(item)
            pending_programs -= len(seeds) * size
            now = time.perf_counter()
            state["wall_seconds"] += now - last
            last = now
            if os.path.exists(out) and os.path.getsize(out):
                with open(out) as fh:
                    merge(state, json.load(fh), seeds, devices)
            else:
                with open(log) as fh:
                    tail = fh.read()[-3000:]
                state["mismatches"].append({
                    "seed": ",".join(seeds), "index": None, "program": None, "devices": devices, "pass": None,
                    "kind": "crash", "problem": f"worker {'timed out' if timed_out else 'died'} "
                                                f"(exit {proc.returncode})", "pieces": [], "minimised": None,
                    "reproduce": f"python -m tests.fuzz.runner --seeds {','.join(seeds)} --size {size}"
                                 + (f" --devices {devices}" if devices > 1 else "") + " -v",
                    "traceback": tail})
            for name in (out, log):
                if os.path.exists(name):
                    os.unlink(name)
            save_state(path, state)
            rate = state["programs"] / state["wall_seconds"] if state["wall_seconds"] else 0.0
            print(f"{state['programs']}/{state['target']} programs, {len(state['mismatches'])} mismatches, "
                  f"{rate:.3f} programs/s", flush=True)


def minimise_all(state: dict, path: str, budget_s: float) -> None:
    """Minimise and classify each mismatch of ``state`` not yet minimised (default XLA flags)."""
    for m in state["mismatches"]:
        if m.get("minimised") is not None or m.get("index") is None:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "min.json")
            cmd = [sys.executable, "-m", "tests.fuzz.runner", "--seeds", m["seed"], "--program", str(m["index"]),
                   "--minimise", "--json", out] + (["--devices", str(m["devices"])] if m.get("devices", 1) > 1 else [])
            try:
                subprocess.run(cmd, cwd=ROOT, env=worker_env(default_flags=True), capture_output=True, text=True,
                               timeout=budget_s + 600)
            except subprocess.TimeoutExpired:
                pass
            if os.path.exists(out):
                with open(out) as fh:
                    m["minimised"] = json.load(fh)
            else:
                m["minimised"] = {"choices": None, "problem": "minimisation did not finish"}
        save_state(path, state)
        print(f"minimised {m['seed']}/{m['index']}: {m['minimised'].get('program')}", flush=True)


#: What draws and runs the programs: a soak's mismatches may be judged again by a later checkout's judge
#: (``tests/fuzz/runner.py``) only when these are the soaked commit's.
CODE_UNDER_TEST = ("hlopass", "passes", "pyproject.toml", "tests/fuzz/programs.py", "tests/fuzz/pieces.py",
                   "tests/fuzz/exclusions.py")


def rejudge_all(state: dict, path: str) -> None:
    """Run each mismatch of ``state`` again with this checkout's fuzzer, whose judge may know more than the
    soaked commit's (the fuzzer's flags, one program at a time; a chunk that died or timed out, all its
    programs, with no time limit): one that passes now leaves ``mismatches`` for ``rejudged``, with the
    commit that judged it and how (the judged kinds' lists grow with it; a chunk's programs are counted).
    Refused unless :data:`CODE_UNDER_TEST` is the soaked commit's: then the same programs ran through the
    same code, and only the verdict is new."""
    def git(*words):
        return subprocess.run(["git", *words], cwd=ROOT, capture_output=True, text=True)
    head = git("rev-parse", "HEAD").stdout.strip()
    for run in state.get("code", []):
        diff = git("diff", "--name-only", run["commit"], "--", *CODE_UNDER_TEST)   # against the working tree
        if diff.returncode or diff.stdout.strip() or run.get("dirty"):
            raise SystemExit(f"tools.soak --rejudge: the code under test differs from the soaked commit "
                             f"{run['commit'][:12]} ({diff.stdout.split() or diff.stderr.strip() or 'dirty'}): "
                             f"soak this checkout instead")
    kept = []
    for m in state["mismatches"]:
        devices = m.get("devices", 1)
        whole_chunk = m.get("index") is None    # a chunk that died or timed out: all its programs again, untimed
        which = (["--size", re.search(r"--size (\d+)", m["reproduce"]).group(1)] if whole_chunk
                 else ["--program", str(m["index"])])
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "again.json")
            cmd = [sys.executable, "-m", "tests.fuzz.runner", "--seeds", m["seed"], *which,
                   "--json", out] + (["--devices", str(devices)] if devices > 1 else [])
            subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True)
            part = json.load(open(out)) if os.path.exists(out) else None
        if part is None or part["failures"] or part["fast_flag_only"] or not part["programs"]:
            kept.append(m)
            print(f"rejudged {m['seed']}/{m['index']}: still a mismatch", flush=True)
            continue
        how = [k for k in (*JUDGED, *LISTED) if part.get(k)]
        if whole_chunk:     # its programs were never counted: they are now, with all they drew
            merge(state, part, m["seed"].split(","), devices)
            how.append(f"ran again whole in {part['seconds']:.0f} s")
        else:
            add_judged(state, part)
        state.setdefault("rejudged", []).append(dict(m, rejudged_by=head, judged_as=how))
        print(f"rejudged {m['seed']}/{m['index']}: passes now ({', '.join(how) or 'equal'})", flush=True)
    state["mismatches"] = kept
    save_state(path, state)


def main(argv=None) -> int:
    """The ``python -m tools.soak`` command; exit status 1 when any fresh program mismatched or crashed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=20000, help="programs in all (resumed runs count)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes at a time")
    parser.add_argument("--chunk", type=int, default=4, help="seeds (batches) per worker run")
    parser.add_argument("--size", type=int, default=8, help="programs per batch")
    parser.add_argument("--sharded-every", type=int, default=10,
                        help="every n-th chunk on 4 host devices (sharded modes, half-size batches); 0: never")
    parser.add_argument("--minutes", type=float, default=0.0, help="stop launching chunks after this long")
    parser.add_argument("--chunk-timeout", type=float, default=3600.0, help="seconds before a chunk is killed")
    parser.add_argument("--minimise-budget", type=float, default=600.0, help="seconds of shrinking per mismatch")
    parser.add_argument("--no-minimise", dest="minimise", action="store_false")
    parser.add_argument("--minimise-only", action="store_true", help="only minimise the file's mismatches")
    parser.add_argument("--rejudge", action="store_true",
                        help="only run the file's mismatches again with this checkout's judge (same code under test)")
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    state = load_state(args.out, args.programs)
    state["command"] = "python -m tools.soak " + " ".join(argv if argv is not None else sys.argv[1:])
    state["machine"] = {"cpus": os.cpu_count(), "load_at_start": list(os.getloadavg()), "nice": os.nice(0)}
    if args.rejudge:
        rejudge_all(state, args.out)
        print(f"{state['programs']} programs, {len(state['mismatches'])} mismatches after judging again")
        return 1 if state["mismatches"] else 0
    code = code_under_test()
    runs = state.setdefault("code", [])
    if code not in runs:      # a resumed soak that ran other code lists each
        runs.append(code)
    if not args.minimise_only:
        run_chunks(state, args, args.out)
    if args.minimise or args.minimise_only:
        minimise_all(state, args.out, args.minimise_budget)
    save_state(args.out, state)
    print(f"{state['programs']} programs in {state['wall_seconds']:.0f} s "
          f"({state['programs_per_second'] or 0:.3f}/s), {len(state['mismatches'])} mismatches: "
          f"{state['mismatch_counts'].get('by_kind', {})}")
    return 1 if state["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
