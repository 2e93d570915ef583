"""The soak (tools/soak.py): its counts merge across chunks and resumed runs, and mismatches are classified.

No programs are run here (one child imports hlopass to say where it comes from) (a chunk is a fuzzer run, timed by tests/fuzz); the worker summaries below have
the shape ``tests.fuzz.runner.run_seeds`` writes.
"""

from __future__ import annotations

import os

import pytest

from tests import ROOT
from tools import soak


def part(programs=16, failures=()):
    return {"programs": programs, "batches": programs // 8, "cpu_seconds": 10.0, "memory_limited": 8,
            "modes": {"value": programs}, "pieces": {"expand:dot": 3, "frontier:masked_lse": 1},
            "rewrites": {"split:split": 4, "remat:recompute": 1}, "excluded": {"test_x": 1}, "as_accurate": 1,
            "overflow": 0, "fwdrev": [], "unguarded": [], "reference_failed": [], "ill_conditioned": ["a"],
            "fast_flag_only": [{"program": "p", "problem": "values[0]: off"}], "failures": list(failures)}


def test_counts_merge_across_chunks_and_a_resumed_run(tmp_path):
    path = str(tmp_path / "soak.json")
    state = soak.load_state(path, 40)
    soak.merge(state, part(), ["s1", "s2"], devices=1)
    state["wall_seconds"] = 8.0
    soak.save_state(path, state)
    resumed = soak.load_state(path, 20)               # a smaller target does not shrink the first
    assert resumed["target"] == 40 and resumed["programs"] == 16
    soak.merge(resumed, part(8), ["s3"], devices=4)
    assert resumed["programs"] == 24 and resumed["sharded_programs"] == 8 and resumed["chunks"] == 2
    assert resumed["by_piece"] == {"expand:dot": 6, "frontier:masked_lse": 2}
    assert resumed["by_pass"] == {"split": 8, "remat": 2} and resumed["as_accurate"] == 2
    assert resumed["seeds"] == ["s1", "s2", "s3"] and resumed["fast_flag_only"] == ["p: values[0]: off"] * 2
    soak.save_state(path, resumed)
    assert soak.load_state(path, 40)["programs_per_second"] == 3.0


def test_mismatches_are_counted_by_kind_pass_family_and_piece():
    failures = [
        {"problem": "values[0]: max error", "kind": "value mismatch", "pass": None, "pieces": ["expand:dot"],
         "seed": "s1", "index": 2, "traceback": ""},
        {"problem": "raised ValueError: x", "kind": "pass skipped", "pass": "split", "pieces": ["expand:diff"],
         "seed": "s2", "index": 0, "traceback": ""},
    ]
    state = soak.empty_state(10)
    soak.merge(state, part(failures=failures), ["s1", "s2"], devices=1)
    state["mismatches"][0]["minimised"] = {"pieces": ["expand:dot", "reduce:sum"], "families": ["contraction"],
                                           "rewrites": {"matrix_chain:reorder": 1}}
    counts = soak.mismatch_counts(state["mismatches"])
    assert counts["by_kind"] == {"value mismatch": 1, "pass skipped": 1}
    assert counts["by_pass"] == {"matrix_chain": 1, "split": 1}
    assert counts["by_family"] == {"contraction": 1, "unknown": 1}
    assert counts["by_piece"] == {"expand:dot": 1, "reduce:sum": 1, "expand:diff": 1}


def test_fresh_seeds_are_of_the_frontier_vocabulary():
    seeds = soak.fresh_seeds(5)
    assert len(set(seeds)) == 5 and all(s.startswith("s") and s[1:].isdigit() for s in seeds)


def test_the_code_soaked_is_this_checkouts_and_is_recorded(monkeypatch, tmp_path):
    """The file names the commit soaked; a checkout whose environment imports hlopass's passes from
    elsewhere (an editable install of another checkout) is refused, not soaked silently."""
    code = soak.code_under_test()
    assert len(code["commit"]) == 40 and code["passes"].startswith(soak.ROOT), code
    monkeypatch.setattr(soak, "ROOT", str(tmp_path))    # the packages now come from outside "this checkout"
    monkeypatch.setattr(soak, "worker_env", lambda: dict(os.environ, PYTHONPATH=ROOT))
    with pytest.raises(SystemExit, match="not from this checkout"):
        soak.code_under_test()


def test_a_mismatch_the_newer_judge_accepts_is_moved_and_the_soaked_code_is_checked(tmp_path):
    """``--rejudge`` runs a soak file's mismatches again with this checkout's judge: round 17's
    s804230096662/4 (a bfloat16 product XLA keeps in float32, equal to the program evaluated operation by
    operation) leaves ``mismatches``; so does a timed-out chunk whose programs all pass when run again,
    and they are counted; a soak of other (here: uncommitted) code is refused."""
    import subprocess
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    path = str(tmp_path / "soak.json")
    state = soak.empty_state(16)
    state["code"] = [{"commit": head, "dirty": False}]
    state["mismatches"] = [
        {"seed": "s804230096662", "index": 4, "devices": 1, "kind": "value mismatch", "problem": "values[0]: off"},
        {"seed": "s1,s2", "index": None, "devices": 1, "kind": "crash", "problem": "worker timed out (exit -9)",
         "reproduce": "python -m tests.fuzz.runner --seeds s1,s2 --size 2 -v"},
    ]
    soak.rejudge_all(state, path)
    assert state["mismatches"] == []
    moved, chunk = state["rejudged"]
    assert moved["seed"] == "s804230096662" and moved["rejudged_by"] == head and "as_written" in moved["judged_as"]
    assert state["as_written"] == ["s804230096662/4"] and soak.load_state(path, 16)["rejudged"]
    assert chunk["judged_as"][-1].startswith("ran again whole") and state["programs"] == 4
    assert state["seeds"] == ["s1", "s2"] and state["chunks"] == 1
    state["code"].append({"commit": head, "dirty": True})
    with pytest.raises(SystemExit, match="differs from the soaked commit"):
        soak.rejudge_all(state, path)
