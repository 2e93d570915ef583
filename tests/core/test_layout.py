"""The house: import layers (import-linter), no cycles, packaging, and the map of the code in docs/architecture.md."""

import ast
import os
import re
import subprocess
import sys
import tomllib

import grimp
import networkx as nx

from tests import ROOT

ENGINE = os.path.join(ROOT, "hlopass")
PASSES = os.path.join(ROOT, "passes")


def _package_folders(top: str, installed_as: str) -> set[str]:
    found = set()
    for folder, _, files in os.walk(top):
        if "__init__.py" in files and "__pycache__" not in folder:
            rel = os.path.relpath(folder, top)
            found.add(installed_as if rel == "." else f"{installed_as}.{rel.replace(os.sep, '.')}")
    return found


def test_import_linter_contracts_hold():
    linter = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    done = subprocess.run([linter, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_no_import_cycles_counting_the_registrys_dynamic_loading():
    old_path = list(sys.path)
    sys.path.insert(0, ROOT)
    try:
        graph = grimp.build_graph("hlopass", "passes", cache_dir=None)
    finally:
        sys.path[:] = old_path
    modules = nx.DiGraph()
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            modules.add_edge(importer, imported)
    pass_modules = [m for m in graph.modules if m == "passes" or m.startswith("passes.")]
    modules.add_edges_from(("hlopass.registry", m) for m in pass_modules)  # importlib.import_module
    cycles = list(nx.simple_cycles(modules))
    assert not cycles, cycles[:5]


def test_only_the_registry_loads_the_passes():
    loaders = []
    for folder, _, files in os.walk(ENGINE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as handle:
                    text = handle.read()
                if re.search(r"hlopass\.passes|^\s*(from|import) passes\b", text, re.MULTILINE):
                    loaders.append(os.path.relpath(path, ROOT))
    assert loaders == [os.path.join("hlopass", "registry.py")], loaders


def test_pyproject_installs_every_package_and_maps_passes():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        project = tomllib.load(handle)
    setuptools = project["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"hlopass.passes": "passes"}
    expected = _package_folders(ENGINE, "hlopass") | _package_folders(PASSES, "hlopass.passes")
    assert set(setuptools["packages"]) == expected, "pyproject.toml [tool.setuptools] packages is out of date"


def test_the_explain_function_does_not_shadow_a_module():
    import hlopass
    for name in dir(hlopass):
        if callable(getattr(hlopass, name)) and not name.startswith("_"):
            assert not os.path.exists(os.path.join(ENGINE, f"{name}.py")), name
            assert not os.path.isdir(os.path.join(ENGINE, name)), name


def _readme_tree() -> set[str]:
    """The paths of the map in docs/architecture.md: one name per line, indented two spaces per folder level."""
    with open(os.path.join(ROOT, "docs", "architecture.md")) as handle:
        text = handle.read()
    block = re.search(r"<!-- house:start -->\s*```\n(.*?)```\s*<!-- house:end -->", text, re.DOTALL)
    assert block, "docs/architecture.md lacks the house map between <!-- house:start --> and <!-- house:end -->"
    paths, stack = set(), []
    for line in block.group(1).splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        name = line.split()[0]
        del stack[depth:]
        paths.add("/".join([*stack, name.rstrip("/")]))
        if name.endswith("/"):
            stack.append(name.rstrip("/"))
    return paths


def test_readme_map_names_every_module():
    mapped = _readme_tree()
    actual = set()
    for top in (ENGINE, PASSES):
        for folder, _, files in os.walk(top):
            if "__pycache__" in folder:
                continue
            rel = os.path.relpath(folder, ROOT).replace(os.sep, "/")
            actual.add(rel)
            actual.update(f"{rel}/{name}" for name in files if name.endswith(".py"))
    assert mapped == actual, (f"in docs/architecture.md but not in the tree: {sorted(mapped - actual)}; "
                              f"in the tree but not in docs/architecture.md: {sorted(actual - mapped)}")


def test_every_pass_package_says_what_it_matches_emits_and_leaves_alone():
    for name in sorted(os.listdir(PASSES)):
        init = os.path.join(PASSES, name, "__init__.py")
        if not os.path.exists(init):
            continue
        with open(init) as handle:
            doc = ast.get_docstring(ast.parse(handle.read())) or ""
        lowered = doc.lower()
        assert "matches" in lowered and "emits" in lowered and ("leaves alone" in lowered or
                                                                 "left alone" in lowered), name
