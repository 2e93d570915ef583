"""Pictures in the dump (hlopass.inspection.draw) and the liveness analysis behind the memory timeline."""

from __future__ import annotations

import glob
import os
import sys

import graphviz  # noqa: F401 - the plot extra is part of the test install: no test here may skip
import jax
import jax.numpy as jnp
import matplotlib  # noqa: F401
import pytest
from jax import lax

import hlopass
from fixtures.kernels import kernel_matvec
from hlopass.inspection import cli, draw, liveness
from hlopass.interpreter import Replacement, rewrite
from hlopass.pass_base import Pass

N = 600
BLOCK = 100
F32 = jnp.float32
KERNEL_ARGS = (jax.ShapeDtypeStruct((N, 3), F32), jax.ShapeDtypeStruct((N, 3), F32), jax.ShapeDtypeStruct((N,), F32))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@hlopass.register_pass
class RowBlockPass(Pass):
    """Test-only: replaces the whole kernel mat-vec by ``lax.map`` over blocks of rows of ``x``.

    Gives the drawing tests a real rewrite (a loop, smaller tensors, a report
    entry with a source line) without depending on the split pass.
    """

    name = "test_draw_rowblock"
    recursive = False

    def run_level(self, closed, config, report):
        jaxpr = closed.jaxpr
        dots = [i for i, eqn in enumerate(jaxpr.eqns) if eqn.primitive.name == "dot_general"]
        if not dots:
            return closed

        def build(x, y, v):
            out = lax.map(lambda rows: kernel_matvec(rows, y, v), x.reshape(-1, BLOCK, x.shape[1]))
            return [out.reshape(-1)]

        report.rewrite("rowblock", jaxpr.eqns[dots[-1]], f"mapped over blocks of {BLOCK} rows")
        replacement = Replacement(range(len(jaxpr.eqns)), jaxpr.invars, jaxpr.outvars, build, anchor=dots[-1])
        return rewrite(closed, [replacement])


@pytest.fixture(scope="module")
def explanation():
    function = hlopass.jit(kernel_matvec, passes="test_draw_rowblock", threshold="1MB")
    return hlopass.explain(function, *KERNEL_ARGS)


# -- liveness ---------------------------------------------------------------------------------

def test_liveness_counts_arguments_outputs_and_frees_dead_values():
    jaxpr = jax.make_jaxpr(lambda x: (jnp.sin(x) * 2.0).sum())(jnp.ones(1000, F32))
    line = liveness.timeline(jaxpr)
    assert [p.primitive for p in line.points] == ["sin", "mul", "reduce_sum"]
    # sin: x + sin(x); mul: x + sin(x) + the product; reduce_sum: x + the product + a scalar
    assert [p.live_bytes for p in line.points] == [8000, 12000, 8004]
    assert line.peak_bytes == 12000 and line.peak_point.primitive == "mul"
    assert line.argument_bytes == 4000 and line.output_bytes == 4


def test_liveness_counts_the_peak_inside_a_loop_body():
    def body(carry, row):
        big = jnp.outer(row, row)  # 400 x 400 floats = 640 kB, only inside the body
        return carry + big.sum(), None

    jaxpr = jax.make_jaxpr(lambda xs: lax.scan(body, 0.0, xs)[0])(jnp.ones((5, 400), F32))
    line = liveness.timeline(jaxpr)
    scan = next(p for p in line.points if p.primitive == "scan")
    assert scan.inner_bytes >= 400 * 400 * 4
    assert line.peak_bytes >= 400 * 400 * 4 + 5 * 400 * 4


def test_liveness_shows_the_rewrite_lowering_the_peak(explanation):
    before = liveness.timeline(explanation.original_jaxpr).peak_bytes
    after = liveness.timeline(explanation.rewritten_jaxpr).peak_bytes
    assert before >= 2 * N * N * 3 * 4  # the (n, n, 3) difference and its square live together
    assert after < before / 4


# -- graph pictures ---------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["png", "svg"])
def test_draw_explanation_writes_graphs_and_timeline(explanation, tmp_path, fmt):
    files = draw.draw_explanation(explanation, str(tmp_path), fmt)
    names = sorted(os.path.basename(f) for f in files)
    assert names == sorted(["graph_before.dot", f"graph_before.{fmt}", "graph_after.dot", f"graph_after.{fmt}",
                            f"memory.{fmt}"])
    for name in (f"graph_before.{fmt}", f"graph_after.{fmt}", f"memory.{fmt}"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG_MAGIC) if fmt == "png" else b"<svg" in data[:2000]
        assert len(data) > 2000


def test_graphs_label_large_tensors_highlight_rewrites_and_cluster_loops(explanation, tmp_path):
    draw.draw_explanation(explanation, str(tmp_path), "svg")
    before = (tmp_path / "graph_before.dot").read_text()
    after = (tmp_path / "graph_after.dot").read_text()
    big = f"f32[{N},{N},3]"
    assert big in before and hlopass.format_size(N * N * 3 * 4) in before  # the large tensor, with its size
    assert draw.LARGE_EDGE in before
    assert draw.REWRITTEN_FILL in before  # the replaced dot_general is highlighted
    assert "cluster_" in after and "loop: scan" in after  # the new loop is a cluster
    assert draw.REWRITTEN_FILL in after
    assert big not in after and f"f32[{BLOCK},{N},3]" in after
    svg = (tmp_path / "graph_after.svg").read_text()
    assert "loop: scan" in svg


def test_long_elementwise_chains_are_collapsed(tmp_path):
    def chain(x):
        return jnp.tanh(jnp.exp(jnp.sin(jnp.cos(x) * 2.0) + 1.0)).sum()

    closed = jax.make_jaxpr(chain)(jnp.ones(100, F32))
    level = draw.build_level(closed, "chain", set())
    labels = [n.label for n in level.nodes.values()]
    assert any(label.startswith("6 elementwise ops") for label in labels), labels
    assert sum(n.kind in ("eqn", "chain") for n in level.nodes.values()) == 2  # the chain and the sum
    assert draw.auto_min_bytes(level) == draw.SCALAR_BYTES  # small graph: only scalar bookkeeping is hidden
    files = draw.draw_graph(closed, str(tmp_path / "chain"), "svg", "chain", set())
    assert "elementwise ops" in open(files[0]).read()


def test_size_filter_hides_small_equations_and_keeps_paths():
    def wide(x, y):
        small = [jnp.sin(x[i]) for i in range(60)]  # 60 tiny equations, then a big product
        return jnp.outer(sum(small), y).sum()

    closed = jax.make_jaxpr(wide)(jnp.ones((60, 8), F32), jnp.ones(20000, F32))
    level = draw.build_level(closed, "wide", set())
    threshold = draw.auto_min_bytes(level, max_nodes=20)
    filtered = draw.filter_small(level, threshold)
    assert threshold > 0
    assert len(filtered.nodes) <= 20 < len(level.nodes)
    assert "hidden" in filtered.title
    kinds = {n.kind for n in filtered.nodes.values()}
    assert "input" in kinds and "output" in kinds
    # the big outer product survives and is still reached from the inputs
    outer = [k for k, n in filtered.nodes.items() if f"f32[8,20000]" in n.label]
    assert outer and any(dst == outer[0] for _, dst in filtered.edges)


# -- optional tools missing -----------------------------------------------------------------

def test_missing_graphviz_package_warns_and_still_draws_the_timeline(explanation, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "graphviz", None)  # import graphviz -> ImportError
    with pytest.warns(draw.MissingToolWarning, match="pip install graphviz"):
        files = draw.draw_explanation(explanation, str(tmp_path), "png")
    assert [os.path.basename(f) for f in files] == ["memory.png"]
    assert (tmp_path / "memory.png").read_bytes().startswith(PNG_MAGIC)


def test_missing_renderer_warns_and_writes_the_source(explanation, tmp_path, monkeypatch):
    monkeypatch.setattr(draw, "find_renderer", lambda: None)  # neither dot nor graphviz-pure installed
    with pytest.warns(draw.MissingToolWarning, match="'dot' program .* graphviz-pure"):
        files = draw.draw_explanation(explanation, str(tmp_path), "svg")
    assert sorted(os.path.basename(f) for f in files) == ["graph_after.dot", "graph_before.dot", "memory.svg"]


def test_renderer_is_graphviz_pure_next_to_python_when_no_dot_is_on_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    renderer = draw.find_renderer()
    assert renderer == os.path.join(os.path.dirname(sys.executable), "graphviz-pure")
    png = draw.render('digraph { a -> b [label="f32[600,600,3]"] }', "png", renderer)
    assert png.startswith(PNG_MAGIC) and len(png) > 1000
    svg = draw.render("digraph { a -> b }", "svg", renderer).decode()
    assert "<svg" in svg and ">a</text>" in svg and ">b</text>" in svg


def test_a_system_dot_is_preferred(tmp_path, monkeypatch):
    folder = tmp_path / "bin"
    folder.mkdir()
    fake_dot = folder / "dot"
    fake_dot.write_text("#!/bin/sh\nexit 0\n")
    fake_dot.chmod(0o755)
    monkeypatch.setenv("PATH", str(folder))
    assert draw.find_renderer() == str(fake_dot)


def test_a_failing_renderer_is_an_error_with_its_message():
    with pytest.raises(RuntimeError, match="syntax error"):
        draw.render("digraph { a -> }", "svg", draw.find_renderer())


def test_unknown_format_is_refused(explanation, tmp_path):
    with pytest.raises(ValueError, match="svg"):
        draw.draw_explanation(explanation, str(tmp_path), "jpeg")


# -- entry points: hlopass-dump and HLOPASS_DUMP_TO --------------------------------------------

def test_cli_format_png_draws_pictures(tmp_path, capsys):
    args = ["fixtures.kernels:kernel_matvec", "--arg", f"f32[{N},3]", "--arg", f"f32[{N},3]", "--arg", f"f32[{N}]",
            "--passes", "test_draw_rowblock", "--threshold", "1MB", "--out", str(tmp_path), "--format", "png"]
    assert cli.main(args) == 0
    for name in ("graph_before.png", "graph_after.png", "memory.png", "report.txt"):
        assert (tmp_path / name).exists(), name
    assert "mapped over blocks" in capsys.readouterr().out


def test_dump_to_with_dump_format_draws_pictures(tmp_path, monkeypatch):
    monkeypatch.setenv("HLOPASS_DUMP_FORMAT", "svg")
    function = hlopass.jit(kernel_matvec, passes="test_draw_rowblock", threshold="1MB", dump_to=str(tmp_path))
    x = jnp.linspace(0, 1, N * 3, dtype=F32).reshape(N, 3)
    result = function(x, x[::-1], jnp.ones(N, F32))
    expected = jax.jit(kernel_matvec)(x, x[::-1], jnp.ones(N, F32))
    assert jnp.allclose(result, expected, rtol=1e-5)
    pictures = sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "*" / "*.svg")))
    assert pictures == ["graph_after.svg", "graph_before.svg", "memory.svg"]


def test_everything_inside_a_loop_emitted_by_a_rewrite_is_highlighted(explanation):
    level = draw.build_level(explanation.rewritten_jaxpr, "after", draw.rewritten_locations(explanation.report))
    loop = next(n for n in level.nodes.values() if n.kind == "cluster")
    assert loop.highlighted and loop.sub
    body_equations = [n for n in loop.sub[0].nodes.values() if n.kind in ("eqn", "chain")]
    assert body_equations and all(n.highlighted for n in body_equations)
    untouched = draw.build_level(explanation.rewritten_jaxpr, "after", set())
    assert not any(n.highlighted for n in draw._all_nodes(untouched))


def test_every_construct_of_the_program_zoo_can_be_drawn(tmp_path):
    from tests.programs import zoo
    for name, function, args in zoo():
        explanation = hlopass.explain(hlopass.jit(function), *args, compile=False)
        files = draw.draw_explanation(explanation, str(tmp_path / name), "svg")
        assert len(files) == 5, name
        assert liveness.timeline(explanation.rewritten_jaxpr).peak_bytes > 0, name
