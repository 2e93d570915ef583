"""Model Explorer views (hlopass.inspection.explorer, ``hlopass-dump --explorer``), read back with Model
Explorer's own Python API and MLIR adapter (the ``explorer`` extra is part of the test install: nothing skips)."""

from __future__ import annotations

import json
import os
import sys

import ai_edge_model_explorer_adapter as adapter
import jax
import jax.numpy as jnp
import pytest
from model_explorer import node_data_builder as ndb

import hlopass
from fixtures.kernels import kernel_matvec
from hlopass.inspection import cli, explorer

N = 600
F32 = jnp.float32
KERNEL_ARGS = (jax.ShapeDtypeStruct((N, 3), F32), jax.ShapeDtypeStruct((N, 3), F32), jax.ShapeDtypeStruct((N,), F32))
NODE_DATA = ["before.bytes.json", "before.passes.json", "after.bytes.json", "after.passes.json", "after.chunk.json"]


def load_node_data(path) -> ndb.ModelNodeData:
    """A node data file as Model Explorer's builder classes (unknown fields raise ``TypeError``)."""
    graphs = {}
    for graph_id, data in json.loads(open(path).read()).items():
        graphs[graph_id] = ndb.GraphNodeData(**{
            **data,
            "results": {key: ndb.NodeDataResult(**value) for key, value in data["results"].items()},
            "gradient": [ndb.GradientItem(**item) for item in data.get("gradient", [])],
            "thresholds": [ndb.ThresholdItem(**item) for item in data.get("thresholds", [])],
        })
    return ndb.ModelNodeData(graphsData=graphs)


def converted(path) -> dict[str, dict[str, dict]]:
    """``{graph id: {node id: node}}`` of the MLIR adapter's conversion of a module file."""
    collections = json.loads(adapter.ConvertMlirToJson(adapter.VisualizeConfig(), str(path)))
    return {graph["id"]: {node["id"]: node for node in graph["nodes"]}
            for collection in collections for graph in collection["subgraphs"]}


def values(folder, name) -> dict[tuple[str, str], object]:
    data = json.loads((folder / name).read_text())
    return {(graph, node): result["value"] for graph, results in data.items()
            for node, result in results["results"].items()}


@pytest.fixture(scope="module")
def kernel_view(tmp_path_factory):
    """The default pipeline on the naive kernel mat-vec: algebraic, matrix_chain and a split loop."""
    folder = tmp_path_factory.mktemp("explorer")
    function = hlopass.jit(kernel_matvec, threshold="1MB", split_size="500kB")
    files = explorer.write_explorer(str(folder), function, *KERNEL_ARGS)
    return folder, files, function.trace(*KERNEL_ARGS).report


def test_writes_both_modules_and_their_node_data(kernel_view):
    folder, files, _ = kernel_view
    assert sorted(os.path.basename(f) for f in files) == sorted(
        ["before.stablehlo.mlir", "after.stablehlo.mlir", *NODE_DATA])
    for model in ("before", "after"):
        assert 'kernels.py":27:' in (folder / f"{model}.stablehlo.mlir").read_text()  # source locations kept


def test_the_mlir_adapter_turns_the_modules_into_graphs(kernel_view):
    folder, _, _ = kernel_view
    before, after = converted(folder / "before.stablehlo.mlir"), converted(folder / "after.stablehlo.mlir")
    assert list(before) == ["main"]
    before_ops = [n["label"] for n in before["main"].values()]
    assert "stablehlo.dot_general" in before_ops and "stablehlo.while" not in before_ops
    assert "main" in after and any(n["label"] == "stablehlo.while" for g in after.values() for n in g.values())


def test_node_data_loads_with_model_explorers_builder_api_and_names_adapter_nodes(kernel_view):
    folder, _, _ = kernel_view
    for name in NODE_DATA:
        text = (folder / name).read_text()
        model_data = load_node_data(folder / name)
        assert model_data.to_json_string(indent=2) == text, name  # the builder writes the file back unchanged
        graphs = converted(folder / f"{name.split('.')[0]}.stablehlo.mlir")
        for graph_id, graph_data in model_data.graphsData.items():
            assert graph_data.name == explorer.QUANTITIES[name.split(".")[1]][0]
            assert set(graph_data.results) <= set(graphs[graph_id]), (name, graph_id)


def test_bytes_are_each_ops_result_bytes(kernel_view):
    folder, _, _ = kernel_view
    before, after = converted(folder / "before.stablehlo.mlir"), converted(folder / "after.stablehlo.mlir")
    for model, graphs in (("before", before), ("after", after)):
        for (graph, node), nbytes in values(folder, f"{model}.bytes.json").items():
            shapes = [m["attrs"] for m in graphs[graph][node].get("outputsMetadata", [])]
            types = [a["value"] for attrs in shapes for a in attrs if a["key"] == "tensor_shape"]
            assert nbytes == sum(hlopass.stablehlo.tensor_nbytes(t) for t in types), (model, graph, node)
    assert max(values(folder, "before.bytes.json").values()) == N * N * 3 * 4  # the broadcast difference
    largest_after = max(v for (g, n), v in values(folder, "after.bytes.json").items()
                        if after[g][n]["label"] != "stablehlo.while")
    assert largest_after < N * N * 4


def test_passes_name_the_rewrites_at_each_ops_source_line(kernel_view):
    folder, _, report = kernel_view
    rewriting = {r.pass_name for r in report.rewrites if not r.location.startswith("<")}
    assert {"algebraic", "split"} <= rewriting
    for model in ("before", "after"):
        labels = values(folder, f"{model}.passes.json")
        seen = {name for label in labels.values() for name in label.split(", ")}
        assert seen == rewriting, model
    before = converted(folder / "before.stablehlo.mlir")["main"]
    labels = values(folder, "before.passes.json")
    dot = next(k for k, n in before.items() if n["label"] == "stablehlo.dot_general")
    assert "split" in labels[("main", dot)]  # the product the split pass turned into a loop
    assert not any(before[k]["label"].startswith("input") for (g, k) in labels)


def test_ops_inside_the_split_loop_carry_its_chunk(kernel_view):
    folder, _, report = kernel_view
    split = next(r for r in report.rewrites if r.kind == "split")
    after = converted(folder / "after.stablehlo.mlir")
    chunks = values(folder, "after.chunk.json")
    assert set(chunks.values()) == {split.details["chunk"]}
    loops = [(g, k) for g, nodes in after.items() for k, n in nodes.items() if n["label"] == "stablehlo.while"]
    assert loops and all(loop in chunks for loop in loops)
    body = {(g, k) for g, nodes in after.items() for k, n in nodes.items()
            if n["label"] == "stablehlo.dynamic_slice"}  # only the loop slices its inputs
    assert body and body <= set(chunks)
    outside = [(g, k) for (g, k) in values(folder, "after.bytes.json") if g == "main"]
    assert outside and not any(key in chunks for key in outside)
    passes = values(folder, "after.passes.json")
    assert all("split" in passes[key] for key in chunks)


def test_nested_split_loops_each_carry_their_own_chunk(tmp_path):
    args = (jax.ShapeDtypeStruct((2000, 3), F32),) * 2 + (jax.ShapeDtypeStruct((2000,), F32),)
    function = hlopass.jit(kernel_matvec, threshold="100kB", split_size="4kB", passes="split")
    explorer.write_explorer(str(tmp_path), function, *args)
    splits = [r for r in function.trace(*args).report.rewrites if r.kind == "split"]
    assert [r.details["nested"] for r in splits] == [True, False]
    outer, inner = (r.details["chunk"] for r in splits)
    after = converted(tmp_path / "after.stablehlo.mlir")
    chunks = values(tmp_path, "after.chunk.json")
    loops = [(g, k) for g, nodes in after.items() for k, n in nodes.items() if n["label"] == "stablehlo.while"]
    outer_loops = [loop for loop in loops if loop[0] == "hlopass_kernel_matvec"]  # the other sits in its body
    assert len(loops) == 2 and len(outer_loops) == 1
    assert chunks[outer_loops[0]] == outer and [chunks[loop] for loop in loops if loop not in outer_loops] == [inner]
    inner_slices = [chunks[(g, k)] for g, nodes in after.items() for k, n in nodes.items()
                    if n["label"] == "stablehlo.dot_general" and (g, k) in chunks]
    assert inner in inner_slices


def test_node_ids_match_the_adapter_on_every_construct_of_the_program_zoo(tmp_path):
    from tests.programs import zoo
    for name, function, args in zoo():
        texts, _ = explorer.stablehlo_with_locations(hlopass.jit(function), *args)
        for model, text in texts.items():
            path = tmp_path / f"{name}.{model}.mlir"
            path.write_text(text)
            nodes = explorer.module_nodes(text)
            explorer.check_ids(nodes, str(path))  # raises on any id whose label differs
            graphs = converted(path)
            ops = sum(1 for g in graphs.values() for k, n in g.items()
                      if not k.startswith("pid") and n.get("outputsMetadata"))
            assert len(nodes) == ops, (name, model)


def test_a_different_numbering_is_an_error(kernel_view, monkeypatch):
    folder, _, _ = kernel_view
    text = (folder / "before.stablehlo.mlir").read_text()
    labels = explorer.adapter_labels(str(folder / "before.stablehlo.mlir"))
    shifted = {(g, k): labels.get((g, str(int(k) + 1)), "") if k.isdigit() else v for (g, k), v in labels.items()}
    monkeypatch.setattr(explorer, "adapter_labels", lambda path: shifted)
    with pytest.raises(explorer.ExplorerError, match="numbers the nodes"):
        explorer.check_ids(explorer.module_nodes(text), str(folder / "before.stablehlo.mlir"))


def test_explorer_config_targets_each_models_node_data(kernel_view):
    folder, _, _ = kernel_view
    config = explorer.explorer_config(str(folder))
    assert [os.path.basename(m["url"]) for m in config.model_sources] == ["before.stablehlo.mlir",
                                                                        "after.stablehlo.mlir"]
    targets = dict(zip((os.path.basename(p) for p in config.node_data_sources), config.node_data_target_models))
    assert targets == {name: f"{name.split('.')[0]}.stablehlo.mlir" for name in NODE_DATA}


# -- hlopass-dump --explorer and its errors ------------------------------------------------------

def kernel_cli_args(*extra):
    return ["fixtures.kernels:kernel_matvec", "--arg", f"f32[{N},3]", "--arg", f"f32[{N},3]", "--arg", f"f32[{N}]",
            "--threshold", "1MB", "--split-size", "500kB", *extra]


def test_cli_explorer_writes_the_dumps_modules_with_locations(tmp_path, capsys):
    out, view = tmp_path / "dump", tmp_path / "view"
    assert cli.main(kernel_cli_args("--out", str(out), "--explorer", str(view), "--no-compile")) == 0
    printed = capsys.readouterr().out
    assert f"open them with: python -m hlopass.inspection.explorer {view}" in printed
    for model in ("before", "after"):
        dumped, viewed = converted(out / f"{model}.stablehlo.mlir"), converted(view / f"{model}.stablehlo.mlir")
        assert {g: {k: n["label"] for k, n in nodes.items()} for g, nodes in dumped.items()} == \
               {g: {k: n["label"] for k, n in nodes.items()} for g, nodes in viewed.items()}, model
    assert sorted(p.name for p in view.iterdir()) == sorted(["before.stablehlo.mlir", "after.stablehlo.mlir",
                                                             *NODE_DATA])


def test_cli_explorer_folder_that_is_a_file_is_a_clean_error(tmp_path, capsys):
    target = tmp_path / "taken"
    target.write_text("")
    assert cli.main(kernel_cli_args("--explorer", str(target))) == 2
    assert capsys.readouterr().err == f"hlopass-dump: error: --explorer {str(target)!r} exists and is not a folder\n"
    assert cli.main(kernel_cli_args("--explorer", str(target / "inside"))) == 2
    assert capsys.readouterr().err.startswith(f"hlopass-dump: error: --explorer {str(target / 'inside')!r}: cannot "
                                              f"create the folder")


def test_cli_explorer_without_the_extra_is_a_clean_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "model_explorer", None)  # import model_explorer -> ImportError
    assert cli.main(kernel_cli_args("--explorer", str(tmp_path / "view"))) == 2
    err = capsys.readouterr().err
    assert err.startswith("hlopass-dump: error: --explorer needs Google's Model Explorer")
    assert "pip install 'hlopass[explorer]'" in err
    assert not (tmp_path / "view").exists()


def test_opening_a_folder_without_modules_is_a_clean_error(tmp_path, capsys):
    assert explorer.main([str(tmp_path)]) == 2
    assert "holds no before.stablehlo.mlir" in capsys.readouterr().err
