"""Google's Model Explorer on a function before and after the passes (``hlopass-dump --explorer DIR``).

:func:`write_explorer` writes to a folder

* ``before.stablehlo.mlir``, ``after.stablehlo.mlir``: what ``jax.jit`` and
  ``hlopass.jit`` hand to XLA, printed with their source locations (the dump's
  copies have none), which Model Explorer's MLIR adapter reads;
* node data, one file per model and quantity, written with Model Explorer's
  ``node_data_builder``: ``*.bytes.json`` (bytes of each op's results),
  ``*.passes.json`` (the passes that rewrote code at the op's source line, and
  ``split`` for everything inside a loop the split pass emitted) and
  ``after.chunk.json`` (for ops inside a split loop, the loop's chunk: the
  slice length along the split axis).

Node data is keyed by the graph and node ids the MLIR adapter gives: one graph
per function (its symbol name), ``argK`` for the function's arguments, and for
ops a counter over the function's ops in pre-order, region terminators
included. :func:`write_explorer` checks each id against the adapter's own
conversion of the written module, so a different numbering is an error, never
node data on the wrong nodes.

``python -m hlopass.inspection.explorer DIR`` opens both models with their node
data in Model Explorer (the ``explorer`` extra).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import sys

from hlopass.report import Rewrite
from hlopass.stablehlo import describe_location, tensor_nbytes

MODELS = ("before", "after")
#: Node data files per model: quantity -> (title shown in Model Explorer, models that have it).
QUANTITIES = {
    "bytes": ("bytes of the op's results", MODELS),
    "passes": ("passes that rewrote the op's source line", MODELS),
    "chunk": ("split loop's chunk (slice length along the split axis)", ("after",)),
}
REWRITTEN_FILL = "#ffb347"
LOOP_FILL = "#9ec5fe"
_LOCATION_RE = re.compile(r"^(.*?:\d+)")


class ExplorerError(Exception):
    """A Model Explorer view cannot be written (extra missing, bad folder); the message says why."""


@dataclasses.dataclass(frozen=True)
class OpNode:
    """One node of a StableHLO function as Model Explorer's MLIR adapter draws it.

    ``label`` is what the adapter shows (the op name, ``input_K`` for an argument);
    ``location`` is ``file.py:LINE`` of the user's source; ``loop`` is the split
    rewrite whose loop holds the op.
    """

    graph: str
    node_id: str
    label: str
    nbytes: int
    location: str
    loop: Rewrite | None = None


def require_model_explorer():
    """Import Model Explorer's Python package, or raise :class:`ExplorerError` naming the extra."""
    try:
        from model_explorer import node_data_builder
        import ai_edge_model_explorer_adapter  # noqa: F401 - the MLIR adapter that checks the node ids
    except ImportError as err:
        raise ExplorerError(f"--explorer needs Google's Model Explorer: pip install 'hlopass[explorer]' "
                            f"(ai-edge-model-explorer and its MLIR adapter) ({err})") from err
    return node_data_builder


def prepare_folder(folder: str) -> str:
    """Create ``folder`` (and parents) if needed; :class:`ExplorerError` if it cannot hold files."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ExplorerError(f"--explorer {folder!r} exists and is not a folder")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        raise ExplorerError(f"--explorer {folder!r}: cannot create the folder: {err.strerror}") from err
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ExplorerError(f"--explorer {folder!r}: the folder is not writable")
    return folder


def stablehlo_with_locations(function, *args, config=None, **kwargs) -> tuple[dict[str, str], list[Rewrite]]:
    """``({"before": text, "after": text}, rewrites)`` for a ``hlopass.jit`` ``function`` at ``args``:
    the modules ``jax.jit`` and ``hlopass.jit`` lower to, printed with source locations, and the
    rewrites the passes reported (``config``: the function's own settings by default)."""
    import jax
    before = jax.jit(function._fun, **function._jit_kwargs).lower(*args, **kwargs)
    traced = function.trace_with(config or function.config(), *args, **kwargs)
    after = traced.lower()
    texts = {"before": before.as_text(debug_info=True), "after": after.as_text(debug_info=True)}
    return texts, list(traced.report.rewrites)


def source_location(rewrite_location: str) -> str | None:
    """``file.py:LINE`` of a report location ``file.py:LINE (function)``; ``None`` for ``<...>``."""
    if rewrite_location.startswith("<"):
        return None
    match = _LOCATION_RE.match(rewrite_location)
    return match.group(1) if match else None


def module_nodes(module_text: str, split_loops: list[Rewrite] = ()) -> list[OpNode]:
    """The nodes of every function of a StableHLO module, with the adapter's ids.

    ``split_loops`` are the split pass's rewrites: the ``n``-th ``while`` at a
    rewrite's source line, in program order (functions entered at their first
    call from ``main``), is that line's ``n``-th rewrite's loop, and every op
    inside it (called functions included) gets it as ``loop``.
    """
    from hlopass import internals as jx

    pending: dict[str, list[Rewrite]] = {}
    for rewrite in split_loops:
        where = source_location(rewrite.location)
        if where:
            pending.setdefault(where, []).append(rewrite)
    nodes: list[OpNode] = []
    with jx.make_ir_context():
        module = jx.ir.Module.parse(module_text)
        functions = {jx.ir.StringAttr(op.attributes["sym_name"]).value: op for op in module.body.operations
                     if op.operation.name == "func.func"}
        visited: set[str] = set()

        def visit_function(name: str, loop: Rewrite | None) -> None:
            visited.add(name)
            function = functions[name]
            for k, argument in enumerate(function.regions[0].blocks[0].arguments):
                nodes.append(OpNode(name, f"arg{k}", f"input_{k}", tensor_nbytes(str(argument.type)), "<unknown>",
                                    loop))
            counter = itertools.count()
            for op in function.regions[0].blocks[0].operations:
                visit_op(op.operation, name, counter, loop)

        def visit_op(op, graph: str, counter, loop: Rewrite | None) -> None:
            node_id = str(next(counter))
            where = describe_location(str(op.location))[1]
            if op.name.endswith(".while") and pending.get(where):
                loop = pending[where].pop(0)
            if op.results:
                nbytes = sum(tensor_nbytes(str(result.type)) for result in op.results)
                nodes.append(OpNode(graph, node_id, op.name, nbytes, where, loop))
            for region in op.regions:
                for block in region.blocks:
                    for child in block.operations:
                        visit_op(child.operation, graph, counter, loop)
            if op.name == "func.call":
                callee = jx.ir.FlatSymbolRefAttr(op.attributes["callee"]).value
                if callee in functions and callee not in visited:
                    visit_function(callee, loop)

        for name in ["main", *functions]:
            if name in functions and name not in visited:
                visit_function(name, None)
    return nodes


def adapter_labels(module_path: str) -> dict[tuple[str, str], str]:
    """``{(graph id, node id): label}`` of Model Explorer's MLIR adapter's conversion of a module file."""
    import ai_edge_model_explorer_adapter as adapter
    converted = json.loads(adapter.ConvertMlirToJson(adapter.VisualizeConfig(), module_path))
    return {(graph["id"], node["id"]): node["label"]
            for collection in converted for graph in collection["subgraphs"] for node in graph["nodes"]}


def check_ids(nodes: list[OpNode], module_path: str) -> None:
    """Raise :class:`ExplorerError` unless every node's id names a node with its label in the adapter's graphs."""
    labels = adapter_labels(module_path)
    wrong = [(n.graph, n.node_id, n.label, labels.get((n.graph, n.node_id))) for n in nodes
             if labels.get((n.graph, n.node_id)) != n.label]
    if wrong:
        import ai_edge_model_explorer_adapter as adapter
        raise ExplorerError(f"Model Explorer's MLIR adapter {adapter.__version__} numbers the nodes of "
                            f"{module_path} differently from hlopass (graph, id, expected, adapter's): {wrong[:3]}")


def passes_at(node: OpNode, rewrites_at: dict[str, list[str]]) -> str:
    """The passes that rewrote ``node``: those with a rewrite at its source line, and the pass whose
    loop holds it; empty when none."""
    names = list(rewrites_at.get(node.location, []))
    if node.loop is not None and node.loop.pass_name not in names:
        names.append(node.loop.pass_name)
    return ", ".join(names)


def node_data(nodes: list[OpNode], rewrites: list[Rewrite], quantity: str, builder):
    """The ``ModelNodeData`` of ``quantity`` (a key of :data:`QUANTITIES`) for ``nodes``."""
    rewrites_at: dict[str, list[str]] = {}
    for rewrite in rewrites:
        where = source_location(rewrite.location)
        if where and rewrite.pass_name not in rewrites_at.setdefault(where, []):
            rewrites_at[where].append(rewrite.pass_name)
    results: dict[str, dict] = {}
    for node in nodes:
        if quantity == "bytes":
            result = builder.NodeDataResult(value=node.nbytes)
        elif quantity == "passes":
            names = passes_at(node, rewrites_at)
            result = builder.NodeDataResult(value=names, bgColor=REWRITTEN_FILL) if names else None
        else:
            chunk = node.loop.details.get("chunk") if node.loop is not None else None
            result = builder.NodeDataResult(value=chunk, bgColor=LOOP_FILL) if chunk is not None else None
        if result is not None:
            results.setdefault(node.graph, {})[node.node_id] = result
    title = QUANTITIES[quantity][0]
    gradient = ([builder.GradientItem(stop=0, bgColor="#ffffff", textColor="#000000"),
                 builder.GradientItem(stop=1, bgColor="#c0392b", textColor="#ffffff")]
                if quantity == "bytes" else [])
    return builder.ModelNodeData(graphsData={
        graph: builder.GraphNodeData(results=values, name=title, gradient=gradient)
        for graph, values in results.items()})


def write_explorer(folder: str, function, *args, config=None, **kwargs) -> list[str]:
    """Write the Model Explorer view of ``function`` (a ``hlopass.jit`` function) at ``args`` to
    ``folder``: both modules and their node data (see the module's docstring). Returns the files written.

    Raises :class:`ExplorerError` without the ``explorer`` extra or when ``folder`` cannot be written.
    """
    builder = require_model_explorer()
    prepare_folder(folder)
    written = []
    texts, rewrites = stablehlo_with_locations(function, *args, config=config, **kwargs)
    for model, text in texts.items():
        module_path = os.path.join(folder, f"{model}.stablehlo.mlir")
        with open(module_path, "w") as handle:
            handle.write(text)
        written.append(module_path)
        nodes = module_nodes(text, [r for r in rewrites if r.kind == "split"] if model == "after" else [])
        check_ids(nodes, module_path)
        for quantity, (_, models) in QUANTITIES.items():
            if model in models:
                path = os.path.join(folder, f"{model}.{quantity}.json")
                node_data(nodes, rewrites, quantity, builder).save_to_file(path)
                written.append(path)
    return written


def node_data_files(folder: str) -> dict[str, list[str]]:
    """``{model file name: [its node data files]}`` of a folder :func:`write_explorer` wrote."""
    return {f"{model}.stablehlo.mlir": [os.path.join(folder, f"{model}.{quantity}.json")
                                        for quantity, (_, models) in QUANTITIES.items() if model in models]
            for model in MODELS}


def explorer_config(folder: str):
    """A ``model_explorer.ModelExplorerConfig`` with both modules of ``folder`` and each one's node data."""
    import model_explorer
    config = model_explorer.config()
    for model, data in node_data_files(folder).items():
        path = os.path.join(folder, model)
        if not os.path.exists(path):
            raise ExplorerError(f"{folder!r} holds no {model}; write it with hlopass-dump ... --explorer {folder}")
        config.add_model_from_path(path)
        for data_path in data:
            config.add_node_data_from_path(data_path, model_name=model)
    return config


def open_command(folder: str) -> str:
    """The shell command that opens ``folder``'s modules side by side with their node data."""
    return f"python -m hlopass.inspection.explorer {folder}"


def main(argv=None) -> int:
    """``python -m hlopass.inspection.explorer DIR``: open a folder written by ``--explorer`` in Model Explorer."""
    parser = argparse.ArgumentParser(prog="python -m hlopass.inspection.explorer",
                                     description="Open the StableHLO before and after the passes, with hlopass's "
                                                 "node data, in Google's Model Explorer.")
    parser.add_argument("folder", help="a folder written by hlopass-dump ... --explorer DIR")
    parser.add_argument("--port", type=int, default=8080, help="port of the local server (default: 8080 or the "
                                                               "next free one)")
    parser.add_argument("--no-browser", action="store_true", help="only print the address")
    options = parser.parse_args(argv)
    try:
        require_model_explorer()
        config = explorer_config(options.folder)
    except ExplorerError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    import model_explorer
    model_explorer.visualize_from_config(config, port=options.port, no_open_in_browser=options.no_browser)
    return 0


if __name__ == "__main__":
    sys.exit(main())
