"""Issue 27, compile in seconds: the pipeline's gates (a program with nothing to do goes to XLA as
written, no pass run), the persistent cache of its decisions (a second process skips the passes)
and the progress lines of long pass work."""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlopass
from hlopass import pipeline, program_cache, progress
from hlopass.jaxpr_utils import largest_value_bytes
from hlopass.pass_base import ProgramFacts
from tests.core import spy_pass
from tests.core.spy_pass import RUNS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def small(x, y):
    return jnp.sum(jnp.tanh(x @ y.T), 1)


def make_small():
    """A fresh function object (a fresh trace, the same source lines) each call."""
    return lambda x, y: jnp.sum(jnp.tanh(x @ y.T), 1)


def args():
    rng = np.random.default_rng(0)
    return rng.standard_normal((64, 8), np.float32), rng.standard_normal((32, 8), np.float32)


@pytest.fixture(autouse=True)
def _fresh_counts():
    RUNS.clear()
    yield
    RUNS.clear()


# -- nothing to do costs nothing ---------------------------------------------------------------------

def test_nothing_to_do_runs_no_pass_and_equals_jax_jit(monkeypatch):
    def no_inlining(*a, **k):
        raise AssertionError("the pipeline inlined calls of a program with nothing to do")
    monkeypatch.setattr(pipeline, "inline_calls", no_inlining)
    f = hlopass.jit(small, passes="hvp,adjoint,test_spy_gated,remat")
    out = f(*args())
    assert RUNS["test_spy_gated"] == 0
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(small)(*args())))
    report = f.trace(*args()).report
    assert [p.ran for p in report.passes] == [False] * 4
    assert "not run (nothing for it to do)" in str(report)
    assert "hlopass_small" in f.lower(*args()).as_text()  # the program as written, in its call


def test_gate_opens_above_the_threshold():
    f = hlopass.jit(small, passes="test_spy_gated", threshold="1kB")  # x @ y.T is 8 kB
    f(*args())
    assert RUNS["test_spy_gated"] == 1
    assert [p.ran for p in f.trace(*args()).report.passes] == [True]


def test_default_pipeline_gates():
    """hvp and adjoint act while tracing and remat only over the memory limit: none runs on a
    small program; the passes with no gate of their own still run (they may rewrite small programs)."""
    report = hlopass.jit(small).trace(*args()).report
    ran = {p.name: p.ran for p in report.passes}
    assert ran["hvp"] is False and ran["adjoint"] is False and ran["remat"] is False
    assert ran["split"] is False   # no value over the threshold: no region to split
    assert ran["algebraic"] and ran["matrix_chain"]
    tight = hlopass.jit(small, memory_limit="1kB", threshold="off").trace(*args()).report
    assert {p.name: p.ran for p in tight.passes}["remat"] is True


def test_facts_read_every_value_sub_programs_and_inputs_included():
    def in_scan(x):
        def body(c, row):
            return c + jnp.sum(jnp.exp(row[:, None] * x[None, :])), None  # 4000 x 4000 inside the body only
        return jax.lax.scan(body, 0.0, x.reshape(4, 1000))[0]
    closed = jax.make_jaxpr(in_scan)(jnp.ones(4000))
    assert largest_value_bytes(closed) == 1000 * 4000 * 4
    assert max(v.aval.size * 4 for e in closed.jaxpr.eqns for v in e.outvars) < 1000 * 4000 * 4
    big_input = jax.make_jaxpr(lambda x: x[:2])(jnp.ones(10_000))
    assert ProgramFacts(big_input).largest_bytes == 40_000
    facts = ProgramFacts(closed)
    assert facts.above(1_000_000) and not facts.above(None) and not facts.over(None)


# -- a second process pays nothing extra -------------------------------------------------------------

@pytest.fixture
def cache_dir(tmp_path):
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    try:
        yield tmp_path
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_cache_entry_skips_the_passes(cache_dir):
    first = hlopass.jit(make_small(), passes="test_spy").trace(*args()).report
    assert RUNS["test_spy"] == 1 and not first.from_cache
    assert len(os.listdir(cache_dir / "hlopass")) == 1
    second = hlopass.jit(make_small(), passes="test_spy").trace(*args()).report
    assert RUNS["test_spy"] == 1, "the second trace ran the pass despite the entry"
    assert second.from_cache and [p.ran for p in second.passes] == [False]
    assert "persistent cache" in str(second)
    hlopass.jit(make_small(), passes="test_spy", threshold="1kB").trace(*args()).report  # noqa: B018 - another key
    assert RUNS["test_spy"] == 2


def test_rewritten_programs_are_stored_exported(cache_dir):
    """A rewritten program is stored exported (``jax.export``) beside its report; a later trace of the
    same program and settings runs no pass, lowers the exported program and gives the same numbers."""
    def rewritten():
        return lambda x, y: jnp.sum(jnp.exp(x[:, None, :] - y[None, :, :]), (1, 2))
    f = hlopass.jit(rewritten(), passes="split", threshold="10kB")
    report = f.trace(*args()).report
    assert report.rewrites and not report.from_cache
    assert sorted(p.suffix for p in (cache_dir / "hlopass").iterdir()) == [".exported", ".json"]
    again = hlopass.jit(rewritten(), passes="split", threshold="10kB")
    assert again.trace(*args()).report.from_cache and again.trace(*args()).report.rewrites
    want = jax.jit(rewritten())(*args())
    np.testing.assert_allclose(again(*args()), want, rtol=1e-5)
    np.testing.assert_allclose(f(*args()), want, rtol=1e-5)


def test_a_rewritten_program_kept_by_the_comparison_is_stored(cache_dir, monkeypatch):
    """A rewritten program that still holds a value over the threshold is compared with the program as
    written (never_worse); kept, it is stored exported once the comparison decides, and a later call
    of the same program runs no pass and no comparison, with the same numbers."""
    from hlopass import pipeline

    def program():
        return lambda x, y: ((jnp.exp(x[:, None, :] - y[None, :, :]).reshape(64, 256) @ jnp.ones((256, 4))).sum(1)
                             + jnp.linalg.cholesky(x @ x.T + 64 * jnp.eye(64, dtype=x.dtype)).sum(1))  # stays
    f = hlopass.jit(program(), passes="split", threshold="10kB", never_worse=True)
    first = f(*args())
    result = f.trace(*args())
    assert result.report.rewrites and result.report.comparison is not None
    assert result.report.comparison.kept == "rewritten"
    assert sorted(p.suffix for p in (cache_dir / "hlopass").iterdir()) == [".exported", ".json"]
    runs = []
    run_passes = pipeline._run_passes
    monkeypatch.setattr(pipeline, "_run_passes", lambda *a, **k: runs.append(1) or run_passes(*a, **k))
    again = hlopass.jit(program(), passes="split", threshold="10kB", never_worse=True)
    second = again(*args())
    assert runs == [] and again.trace(*args()).report.from_cache
    want = jax.jit(program())(*args())
    np.testing.assert_allclose(first, want, rtol=1e-5)
    np.testing.assert_allclose(second, want, rtol=1e-5)


def test_stored_gradient_programs_give_jax_jits_gradients(cache_dir, monkeypatch):
    """Under ``jax.jit(jax.grad(...))`` the rewritten hlopass program is stored exported; a fresh function
    reads it (no pass runs) and its gradients, at sizes no chunk divides, are plain JAX's."""
    from hlopass import pipeline
    x = np.random.default_rng(1).standard_normal((301, 7), np.float32)
    y = np.random.default_rng(2).standard_normal((173, 7), np.float32)

    def loss(x, y):
        return jnp.sum(jnp.exp(-jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, -1)) * jnp.arange(173.0))

    def gradient():
        return jax.jit(jax.grad(hlopass.jit(lambda x, y: loss(x, y), passes="split", threshold="40kB"),
                                argnums=(0, 1)))

    want = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, y)
    first = gradient()(x, y)
    assert list((cache_dir / "hlopass").glob("*.exported"))  # the backward program's split
    runs = []
    run_passes = pipeline._run_passes
    monkeypatch.setattr(pipeline, "_run_passes", lambda *a, **k: runs.append(1) or run_passes(*a, **k))
    second = gradient()(x, y)
    assert runs == [], "the stored programs' passes ran again"
    for got in (first, second):
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-5)


def test_sharded_or_effectful_rewrites_are_not_stored(cache_dir):
    from hlopass import pipeline
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(jnp.ones(5))
    report = hlopass.jit(lambda x: x).trace(jnp.ones(5)).report
    assert program_cache.export_rewritten("k1", closed, sharded=True) is None
    stored, blob = program_cache.export_rewritten("k2", closed, sharded=False)
    assert stored.out_avals[0].shape == (5,) and program_cache.write_rewritten("k2", report, blob)
    assert sorted(p.name for p in (cache_dir / "hlopass").glob("k*")) == ["k2.exported", "k2.json"]
    effects = jax.make_jaxpr(lambda x: jax.debug.print("{}", x) or x)(jnp.ones(5))
    assert effects.effects and program_cache.export_rewritten("k3", effects, sharded=False) is None
    assert not pipeline._in_manual_context()


def test_no_cache_without_jax_cache_dir():
    assert jax.config.jax_compilation_cache_dir in (None, "")
    assert program_cache.cache_dir() is None
    closed = jax.make_jaxpr(small)(*args())
    assert program_cache.key(closed, hlopass.jit(small).config(), (), None) is None


def _child(cache: str, passes: str = "test_spy", threshold: str = "1GB", which: str = "plain") -> dict:
    done = subprocess.run([sys.executable, "-m", "tests.core.cache_child", cache, passes, threshold, which], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    rows = [line for line in done.stdout.splitlines() if line.startswith("ROW ")]
    assert rows, done.stderr[-3000:]
    return json.loads(rows[-1][4:])


@pytest.mark.slow
def test_second_process_skips_the_passes(tmp_path):
    first = _child(str(tmp_path))
    assert first["runs"] == {"test_spy": 1} and len(first["entries"]) == 1
    second = _child(str(tmp_path))
    assert second["runs"] == {}, "the second process ran the pass"
    assert second["entries"] == first["entries"]
    for row in (first, second):
        assert row["out"] == row["expected"]
    third = _child(str(tmp_path), threshold="1MB")  # other settings: the pass runs, a second entry
    assert third["runs"] == {"test_spy": 1} and len(third["entries"]) == 2


@pytest.mark.slow
def test_second_process_skips_the_passes_of_a_rewritten_program(tmp_path):
    """A split program: the first process runs the passes and stores the program exported; the second
    runs none, and XLA's persistent cache serves its compile (both lower the exported program)."""
    first = _child(str(tmp_path), passes="split", threshold="20kB")
    assert first["pipeline_runs"] == 1 and first["xla_cache_hits"] == 0
    assert [e.rsplit(".", 1)[1] for e in first["entries"]] == ["exported", "json"]
    second = _child(str(tmp_path), passes="split", threshold="20kB")
    assert second["pipeline_runs"] == 0, "the second process ran the passes"
    assert second["xla_cache_hits"] >= 1, "XLA compiled the program again"
    assert not second["scipy_imported"], "LAPACK's kernels were loaded for a program that calls none"
    for row in (first, second):
        assert row["out"] == pytest.approx(row["expected"], rel=1e-5)


@pytest.mark.slow
def test_programs_differing_only_in_a_sub_programs_constant_are_stored_apart(tmp_path):
    """A jitted helper closing over an array keeps it as a constant of the call's sub-program, which
    ``str(jaxpr)`` does not print: named by their print, the two programs below shared an entry (before
    round 32), and the second process ran the first one's stored program, scale 1 for scale 2."""
    first = _child(str(tmp_path), passes="split", threshold="20kB", which="scaled:1")
    second = _child(str(tmp_path), passes="split", threshold="20kB", which="scaled:2")
    assert second["pipeline_runs"] == 1, "the second program was read from the first one's entry"
    assert len(second["entries"]) == 4
    for row in (first, second):
        assert row["out"] == pytest.approx(row["expected"], rel=1e-5)
    assert first["expected"] != pytest.approx(second["expected"], rel=1e-3)


@pytest.mark.slow
def test_a_stored_program_calling_lapack_loads_its_kernels(tmp_path):
    """The stored program of one that factors a matrix (a LAPACK kernel on CPU) is lowered with
    LAPACK's kernels loaded, as JAX's lowering of an exported call does: the second process's result
    is jax.jit's."""
    first = _child(str(tmp_path), passes="split", threshold="20kB", which="cholesky")
    assert [e.rsplit(".", 1)[1] for e in first["entries"]] == ["exported", "json"]
    second = _child(str(tmp_path), passes="split", threshold="20kB", which="cholesky")
    assert second["pipeline_runs"] == 0 and second["xla_cache_hits"] >= 1 and second["scipy_imported"]
    for row in (first, second):
        assert row["out"] == pytest.approx(row["expected"], rel=1e-5)


# -- long work shows progress ------------------------------------------------------------------------

def test_progress_lines_name_the_pass_and_region(monkeypatch, caplog):
    monkeypatch.setattr(progress, "AFTER_S", 0.1)
    monkeypatch.setattr(progress, "EVERY_S", 60.0)
    with caplog.at_level(logging.INFO, logger="hlopass"):
        hlopass.jit(small, passes="test_spy,test_slow").trace(*args()).report  # noqa: B018
    lines = [r.getMessage() for r in caplog.records if r.name == "hlopass" and r.levelno == logging.INFO]
    running = [line for line in lines if "running for" in line]
    assert len(running) == 1, lines
    assert "pass test_slow (2 of 2)" in running[0] and "at the test's region" in running[0]
    assert any("the passes took" in line and "test_slow" in line for line in lines), lines


def test_quick_passes_say_nothing(caplog):
    with caplog.at_level(logging.INFO, logger="hlopass"):
        hlopass.jit(small, passes="test_spy").trace(*args()).report  # noqa: B018
    assert not [r for r in caplog.records if "running for" in r.getMessage() or "passes took" in r.getMessage()]


def test_regions_named_by_the_engine():
    seen = []

    def listener(work, event):
        seen.append((event, work.current_pass, work.region()))
    progress.listeners.append(listener)
    try:
        fn = lambda x, y: jnp.sum(jnp.exp(x[:, None, :] - y[None, :, :]), (1, 2))  # noqa: E731
        hlopass.jit(fn, passes="split", threshold="10kB").trace(*args()).report  # noqa: B018
    finally:
        progress.listeners.remove(listener)
    assert seen[0][0] == "program" and seen[-1][0] == "done"
    regions = [r for e, p, r in seen if e == "region" and p == "split"]
    assert any(r.startswith("rewriting 1 region (at test_compile_speed.py:") for r in regions), seen


def test_spy_module_registers_its_passes():
    assert {"test_spy", "test_spy_gated", "test_slow"} <= set(hlopass.available_passes())
    assert spy_pass.SlowPass.seconds > 0.1


def test_a_program_measured_again_is_not_compiled_again(monkeypatch):
    """The split pass measures the program it emits under a memory limit, and the final check measures
    the same program again: XLA compiles it once, and each check keeps its own label and limit."""
    from hlopass import memory
    compiled = []
    measure = memory.measure
    monkeypatch.setattr(memory, "measure", lambda c, *a, **k: compiled.append(c) or measure(c, *a, **k))
    monkeypatch.setattr(memory, "_measured", {})
    closed = jax.make_jaxpr(lambda x: jnp.sin(x)[:, None] * x[None])(jnp.ones(301))
    first = memory.footprint(closed, limit=10**9, label="first")
    again = memory.footprint(closed, limit=1000, label="again")
    other = memory.footprint(jax.make_jaxpr(lambda x: jnp.cos(x)[:, None] * x[None])(jnp.ones(301)))
    assert len(compiled) == 2
    assert (first.label, first.limit, again.label, again.limit) == ("first", 10**9, "again", 1000)
    assert first.footprint == again.footprint >= 301 * 301 * 4 and not first.over_limit and again.over_limit
    assert again.largest and not first.largest        # the listing for the warning, over the limit only
    assert other.footprint == first.footprint and other is not first


# -- a rewrite checked by the compile the call makes anyway -------------------------------------------

def _call_results(label: str) -> list:
    """The pipeline results of the programs named ``label`` that run_pipeline holds now."""
    return [r for per in list(pipeline._cache.values()) for r in per.values() if r.report.label.split(".")[-1] == label]


def _footprints(monkeypatch) -> list:
    from hlopass import memory
    calls = []
    footprint = memory.footprint
    monkeypatch.setattr(memory, "footprint", lambda *a, **k: calls.append(a[0]) or footprint(*a, **k))
    for module in ("hlopass.passes.split", "hlopass.passes.remat", "hlopass.never_worse"):
        target = importlib.import_module(module)
        name = "measure_alone" if module.endswith("split") else "footprint"
        monkeypatch.setattr(target, name, memory.footprint)
    return calls


_ATTENTION_INPUTS = tuple(np.random.default_rng(i).standard_normal((1, 2, 384, 16)).astype(np.float32)
                          for i in range(3))


def _called_attention(name: str, **settings):
    """The attention fixture under ``hlopass.jit`` (a function named ``name``) called once, checked
    against ``jax.jit``; the function and the split pass's report of that call."""
    from fixtures.attention import attention

    def called(q, k, v):
        return attention(q, k, v)

    called.__name__ = called.__qualname__ = name
    f = hlopass.jit(called, **settings)
    np.testing.assert_allclose(f(*_ATTENTION_INPUTS), jax.jit(attention)(*_ATTENTION_INPUTS), rtol=1e-5, atol=1e-6)
    (result,) = _call_results(name)
    return f, next(p for p in result.report.passes if p.name == "split")


def test_a_split_that_fits_is_checked_by_the_calls_own_compile(monkeypatch):
    """Called with a memory limit, the split pass does not compile its program to check it: the call
    compiles the whole program and measures it anyway. The report says the fit as if it had."""
    calls = _footprints(monkeypatch)
    f, split = _called_attention("deferred_split", passes="split,remat", threshold="400kB", memory_limit="1MB")
    (check,) = f.memory_checks()
    assert calls == [] and check.footprint <= 1_000_000
    (result,) = _call_results("deferred_split")
    assert [r.kind for r in split.rewrites].count("split") >= 1
    (entry,) = [r for r in split.rewrites if r.kind == "memory_check"]
    assert "the whole program compiled" in entry.summary and entry.details["footprint"] == check.footprint
    assert result.unconfirmed == ()


def test_a_split_over_the_limit_at_the_calls_compile_is_split_again(monkeypatch):
    """When the call's measurement of a split it took as fitting is over the limit, the passes run
    again, checking as they do elsewhere: split again until XLA says it fits."""
    calls = _footprints(monkeypatch)
    f, split = _called_attention("split_again", passes="split", threshold="1MB", memory_limit="350kB")
    assert f.memory_checks()[0].footprint <= 350_000
    assert calls, "the second run of the passes compiles its program to check it"
    assert any(r.kind == "retry" for r in split.rewrites) and any(r.kind == "memory_check" for r in split.rewrites)
    assert np.array_equal(f(*_ATTENTION_INPUTS), f(*_ATTENTION_INPUTS))  # later calls: the checked program


def _compiled_attention(name: str, **settings):
    """As :func:`_called_attention`, ahead of time: ``f.trace(...).lower().compile()``; the ``Lowered``
    and the split pass's report."""
    from fixtures.attention import attention

    def called(q, k, v):
        return attention(q, k, v)

    called.__name__ = called.__qualname__ = name
    f = hlopass.jit(called, **settings)
    lowered = f.trace(*_ATTENTION_INPUTS).lower()
    compiled = lowered.compile()
    np.testing.assert_allclose(compiled(*_ATTENTION_INPUTS), jax.jit(attention)(*_ATTENTION_INPUTS),
                               rtol=1e-5, atol=1e-6)
    return lowered, next(p for p in lowered.report.passes if p.name == "split")


def test_ahead_of_time_a_split_that_fits_is_checked_by_the_compile_of_lowered(monkeypatch):
    """``f.trace(x).lower().compile()`` measures the whole program as a call does: the split pass
    leaves its check to that compile (one XLA compile, not two), and the report says the fit."""
    calls = _footprints(monkeypatch)
    lowered, split = _compiled_attention("aot_deferred_split", passes="split,remat", threshold="400kB",
                                         memory_limit="1MB")
    assert calls == [] and lowered.memory_check.footprint <= 1_000_000
    (entry,) = [r for r in split.rewrites if r.kind == "memory_check"]
    assert "the whole program compiled" in entry.summary
    assert entry.details["footprint"] == lowered.memory_check.footprint


def test_ahead_of_time_a_split_over_the_limit_is_split_again_and_lowered_again(monkeypatch):
    """When the compile of ``Lowered`` finds the split it took as fitting over the limit, the passes
    run again, checking, and the program they give is the one compiled (and ``as_text`` shows)."""
    calls = _footprints(monkeypatch)
    lowered, split = _compiled_attention("aot_split_again", passes="split", threshold="1MB",
                                         memory_limit="350kB")
    assert calls, "the second run of the passes compiles its program to check it"
    assert lowered.memory_check.footprint <= 350_000
    assert any(r.kind == "retry" for r in split.rewrites) and any(r.kind == "memory_check" for r in split.rewrites)
    assert lowered.as_text() == lowered._lowered.as_text()


# -- f.trace(x).report is the report of the program f(x) compiles --------------------------------------

@pytest.mark.parametrize("order", ["call first", "trace first"])
def test_trace_reports_the_program_the_call_compiles(monkeypatch, order):
    """JAX's lowering removes dead code before the passes see a program; ``f.trace(x).report`` runs
    them on the same program: one pipeline run for the call and the trace in either order, one report
    (a report of the traced program, dead code included, named more equations than were compiled)."""
    ran = []
    run_passes = pipeline._run_passes
    monkeypatch.setattr(pipeline, "_run_passes", lambda *a, **k: ran.append(a[0]) or run_passes(*a, **k))

    def nearest(x, y):
        d = jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, -1)
        unused = jnp.exp(d) @ y  # dead: JAX's lowering drops it
        del unused
        return jnp.sum(jnp.min(d, 1))

    x, y = (np.random.default_rng(i).standard_normal((301, 3)).astype(np.float32) for i in range(2))
    f = hlopass.jit(nearest, passes="split", threshold="40kB")
    if order == "call first":
        out = f(x, y)
        report = f.trace(x, y).report
    else:
        report = f.trace(x, y).report
        out = f(x, y)
    np.testing.assert_allclose(out, jax.jit(nearest)(x, y), rtol=1e-5)
    assert len(ran) == 1, "the call and the trace ran the passes on different programs"
    traced = jax.make_jaxpr(nearest)(x, y)
    assert report.equations_before == len(ran[0].jaxpr.eqns) < len(traced.jaxpr.eqns)
    split = next(p for p in report.passes if p.name == "split")
    assert [r.kind for r in split.rewrites].count("split") == 1


def test_rewritten_jaxpr_takes_every_traced_input():
    """An input the program does not read is dropped from what the passes see (JAX's dead-code
    elimination) but not from ``f.trace(...).rewritten_jaxpr``, which still takes every input."""
    def nearest(x, y, ignored):
        return jnp.sum(jnp.min(jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, -1), 1))

    x, y = (np.random.default_rng(i).standard_normal((301, 3)).astype(np.float32) for i in range(2))
    ignored = np.ones(7, np.float32)
    traced = hlopass.jit(nearest, passes="split", threshold="40kB").trace(x, y, ignored)
    rewritten = traced.rewritten_jaxpr
    assert [str(a) for a in rewritten.in_avals] == [str(a) for a in traced.original_jaxpr.in_avals]
    from hlopass import internals as jx
    (got,) = jax.jit(jx.jaxpr_as_fun(rewritten))(x, y, ignored)
    np.testing.assert_allclose(got, jax.jit(nearest)(x, y, ignored), rtol=1e-5)
    assert "split" in [r.kind for p in traced.report.passes for r in p.rewrites]


def test_the_collector_is_paused_while_hlopass_traces_and_runs_the_passes():
    """The cyclic garbage collector is off while the function is traced and the passes run, and back
    on after (pipeline.collector_paused); a collector the user turned off stays off."""
    import gc
    in_trace = []

    def f(x, y):
        in_trace.append(gc.isenabled())
        return small(x, y)

    spy_pass.COLLECTOR.clear()
    assert gc.isenabled()
    jax.block_until_ready(hlopass.jit(f, passes="test_collector_probe")(*args()))
    assert in_trace == [False] and spy_pass.COLLECTOR == [False]
    assert gc.isenabled()
    gc.disable()
    try:
        jax.block_until_ready(hlopass.jit(make_small(), passes="test_collector_probe", threshold=1)(*args()))
        assert not gc.isenabled()
    finally:
        gc.enable()


MACHINERY = ["hlopass.passes.split.driver", "hlopass.passes.remat.loop", "hlopass.passes.algebraic.expansion",
             "hlopass.passes.matrix_chain.network", "hlopass.passes.hvp.regions"]
LIGHT_CHILD = """
import sys, json
import hlopass, jax.numpy as jnp
loaded = {"import": [m for m in MACHINERY if m in sys.modules]}
hlopass.jit(lambda x: jnp.sum(jnp.tanh(x)), passes="split,remat")(jnp.ones(8))
loaded["call"] = [m for m in MACHINERY if m in sys.modules]
print("LOADED", json.dumps(loaded))
"""


def test_importing_hlopass_loads_no_pass_machinery():
    """``import hlopass`` imports the default passes' classes, not their machinery: a pass loads it
    where it runs it, so a first call that runs no pass (here the split and remat passes, nothing
    above a threshold, no memory limit) loads none (``docs/architecture.md``, "A built-in pass's
    package is light")."""
    done = subprocess.run([sys.executable, "-c", f"MACHINERY = {MACHINERY!r}\n" + LIGHT_CHILD], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if not k.startswith("HLOPASS_")})
    lines = [line for line in done.stdout.splitlines() if line.startswith("LOADED ")]
    assert lines, done.stderr[-3000:]
    loaded = json.loads(lines[0][len("LOADED "):])
    assert loaded == {"import": [], "call": []}
    from hlopass.passes import split
    assert split.split_nested.__module__ == "hlopass.passes.split.driver"  # offered lazily, still offered


@pytest.mark.parametrize("program, calls_lapack", [
    (lambda a, b: jnp.sin(a) @ b, False),
    (lambda a, b: jnp.linalg.cholesky(a @ a.T + 4 * jnp.eye(4)) @ b, True),
    (lambda a, b: jax.lax.linalg.triangular_solve(jnp.tril(a) + 4 * jnp.eye(4), b, left_side=True, lower=True), True),
    (lambda a, b: jax.lax.linalg.tridiagonal_solve(a[0], a[1] + 4, a[2], b), True),
])
def test_the_kernel_set_up_is_skipped_only_for_a_stored_program_naming_none_of_its_kernels(program, calls_lapack):
    """What decides whether JAX's LAPACK set-up is skipped when a stored program is lowered (a program
    calling a kernel it did not set up would fail in XLA). The match is conservative: a kernel's name in
    a source location of the module counts too (this test's name, were it to hold one, would)."""
    a, b = jnp.ones((4, 4)), jnp.ones((4, 3))
    exported = jax.export.export(jax.jit(program))(a, b)
    stored = program_cache._callable_jaxpr(exported.serialize(), [jax.typeof(a), jax.typeof(b)])
    assert program_cache.lapack_free(stored) is not calls_lapack
