"""The static API check of hlopass's door to JAX internals (tools/jax_api): the committed manifests, the checker's
rules on synthetic doors, the real door against every supported version, and the manifests against the installed
JAX (names, signatures, primitives; regenerating reproduces the committed file)."""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import os
import sys

import pytest

from tests import ROOT
from tools.jax_api import check as api_check
from tools.jax_api import generate

MANIFESTS = os.path.join(ROOT, "tools", "jax_api", "manifests")
DOOR = os.path.join(ROOT, "hlopass", "internals.py")


def _load(version: str) -> dict:
    with open(os.path.join(MANIFESTS, f"jax-{version}.json"), encoding="utf-8") as handle:
        return json.load(handle)


@pytest.fixture(scope="module")
def m010() -> dict:
    return _load("0.10.2")


@pytest.fixture(scope="module")
def m011() -> dict:
    return _load("0.11.2")


@pytest.fixture(scope="module")
def both(m010, m011) -> list[dict]:
    return [m010, m011]


def _messages(problems, version=None) -> list[str]:
    return [p.message for p in problems if version is None or p.version == version]


# ---------------------------------------------------------------------------------------------------------------
# The manifests


def test_a_manifest_per_supported_version(both):
    assert [m["jax_version"] for m in both] == ["0.10.2", "0.11.2"]
    assert sorted(os.listdir(MANIFESTS)) == ["jax-0.10.2.json", "jax-0.11.2.json"]
    for m in both:
        assert os.path.getsize(os.path.join(MANIFESTS, f"jax-{m['jax_version']}.json")) < 2_000_000
        for module in ("jax", "jax.core", "jax.extend.core", "jax._src.core", "jax._src.interpreters.partial_eval",
                       "jax._src.interpreters.mlir", "jax._src.lib.mlir", "jax._src.pjit", "jax.tree_util"):
            assert module in m["modules"], (m["jax_version"], module)


def test_the_door_passes_against_every_supported_version(both):
    if not os.path.exists(DOOR):
        pytest.skip("hlopass/internals.py (the door to JAX internals) does not exist yet")
    with open(DOOR, encoding="utf-8") as handle:
        problems = api_check.check(handle.read(), both)
    assert not problems, "\n".join(map(str, problems))


def test_every_module_reaching_into_jax_internals_checks_clean_against_the_installed_version(both):
    """Each hlopass module that imports ``jax._src`` today (the door, once it exists, included), checked as if it
    were the door: nothing against 0.10.2 (which the test suite runs on) and nothing but the two known breakages
    against 0.11.2. This keeps the checker honest about false positives on real code, door or not."""
    checked = 0
    for top in ("hlopass", "passes"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                with open(os.path.join(folder, name), encoding="utf-8") as handle:
                    source = handle.read()
                if "jax._src" not in source:
                    continue
                checked += 1
                for problem in api_check.check(source, both):
                    assert problem.version == "0.11.2", (name, str(problem))
                    assert "FlatTree" in problem.message or "convert_const_himutables" in problem.message, (
                        name, str(problem))
    assert checked >= 1


def test_the_cli_checks_a_door_against_every_manifest(tmp_path, capsys):
    door = tmp_path / "door.py"
    door.write_text("from jax._src.interpreters import partial_eval as _pe\n_pe.dce_jaxpr\n")
    assert api_check.main(["--door", str(door)]) == 0
    door.write_text("from jax._src.interpreters import partial_eval as _pe\n_pe.convert_const_himutables\n")
    assert api_check.main(["--door", str(door)]) == 1
    out = capsys.readouterr().out
    assert "jax 0.11.2" in out and ":2:" in out and "jax 0.10.2" not in out


# ---------------------------------------------------------------------------------------------------------------
# The checker's rules


def test_the_two_real_breakages_of_0_11_2_are_reported_against_it_only(m010, m011):
    door = ("from jax._src.tree_util import FlatTree\n"
            "from jax._src.interpreters import partial_eval as _pe\n"
            "def lower(j):\n"
            "    return _pe.convert_const_himutables(j)\n")
    assert api_check.check(door, m010) == []
    problems = api_check.check(door, m011)
    assert [(p.version, p.line) for p in problems] == [("0.11.2", 1), ("0.11.2", 4)], problems
    assert "FlatTree" in problems[0].message and "convert_const_himutables" in problems[1].message
    assert {(p.version, p.line) for p in api_check.check(door, [m010, m011])} == {("0.11.2", 1), ("0.11.2", 4)}


def test_the_new_home_of_flattree_exists_only_in_0_11_2(m010, m011):
    door = "from jax._src import flattree as _ft\n_ft.FlatTree\n"
    assert api_check.check(door, m011) == []
    assert len(api_check.check(door, m010)) == 2  # the module, and the attribute on it


def test_a_keyword_added_in_0_11_2_is_reported_against_0_10_2(both):
    # mlir.core_call_lowering gained inline_jax_late= in 0.11.2; ad.backward_pass gained return_logs=
    door = ("from jax._src.interpreters import mlir as _mlir, ad as _ad\n"
            "def rule(ctx, *args, name, jaxpr):\n"
            "    _ad.backward_pass(jaxpr, (), [], args, [], return_logs=False)\n"
            "    return _mlir.core_call_lowering(ctx, *args, name=name, call_jaxpr=jaxpr, inline_jax_late=True)\n")
    problems = api_check.check(door, both)
    assert {(p.version, p.line) for p in problems} == {("0.10.2", 3), ("0.10.2", 4)}, problems
    assert all("unknown keyword" in p.message for p in problems)


def test_signature_changes_in_a_synthetic_manifest_are_reported(m010):
    door = ("from jax._src.interpreters import partial_eval as _pe\n"
            "_pe.dce_jaxpr(j, used, instantiate=True)\n"
            "_pe.dce_jaxpr(j, used, True)\n"
            "_pe.dce_jaxpr(*args)\n")
    assert api_check.check(door, m010) == []
    edited = copy.deepcopy(m010)
    edited["jax_version"] = "9.9.9"
    edited["modules"]["jax._src.interpreters.partial_eval"]["names"]["dce_jaxpr"] = {
        "kind": "function", "sig": "(jaxpr, used_outputs, /, *, prune=, keep)"}
    problems = api_check.check(door, edited)
    messages = [(p.line, p.message.split(": ", 1)[1]) for p in problems]
    assert (2, "unknown keyword instantiate=") in messages
    assert (2, "missing keep") in messages
    assert (3, "3 positional arguments, at most 2 accepted") in messages
    assert not any(line == 4 for line, _ in messages)  # *args: nothing can be said


def test_calls_check_keywords_positional_only_and_missing_arguments(m011):
    door = ("from jax._src import core as _core\n"
            "_core.Var(aval, initial_qdd=None)\n"     # 0.11.2's Var(aval): the keyword is gone
            "_core.Var()\n"
            "_core.JaxprEqn(1, 2, 3, 4, 5, 6, 7)\n"   # a class call checks __init__
            "_core.eval_jaxpr(j, [], 1, 2, propagate_source_info=False)\n")
    messages = _messages(api_check.check(door, m011))
    assert any("unknown keyword initial_qdd=" in m for m in messages)
    assert any("missing aval" in m for m in messages)
    assert len(messages) == 2, messages


def test_optional_names_need_one_version_and_are_reported_when_in_none(both):
    door = ("from jax._src.interpreters import partial_eval as _pe\n"
            "from jax._src import tree_util as _tu\n"
            "def _optional(module, name):\n"
            "    return getattr(module, name, None)\n"
            "A = _optional(_pe, 'convert_const_himutables')\n"       # 0.10.2 only: fine
            "B = getattr(_tu, 'FlatTree', None)\n"                   # 0.10.2 only: fine
            "C = hasattr(_pe, 'convert_const_himutables')\n"
            "D = _optional(_pe, 'convert_const_nothing')\n"          # nowhere: dead code
            "E = getattr(_tu, 'NoSuchTree', None)\n"                 # nowhere
            "if hasattr(_pe, 'convert_const_himutables'):\n"
            "    F = _pe.convert_const_himutables\n"                 # guarded: fine
            "try:\n"
            "    from jax._src.tree_util import FlatTree\n"          # guarded import: fine
            "except ImportError:\n"
            "    from jax._src.flattree import FlatTree\n"           # 0.11.2 only: fine
            "try:\n"
            "    from jax._src.tree_util import NoSuchTree\n"        # guarded, but nowhere
            "except (ImportError, AttributeError):\n"
            "    pass\n"
            "G = hasattr(object(), 'eqns')\n"                        # a JAX class member: fine
            "H = hasattr(object(), 'no_such_member_anywhere')\n")
    problems = api_check.check(door, both)
    assert sorted(p.line for p in problems) == [8, 9, 17, 21], problems  # line 15: the fallback import
    assert all(p.version == "0.10.2+0.11.2" and "no supported version" in p.message for p in problems)


def test_chains_on_a_module_imported_under_a_guard_are_optional(both):
    door = ("from jax._src import tree_util as _tu\n"
            "try:\n"
            "    from jax._src import flattree as _ft\n"             # 0.11.2 only
            "except ImportError:\n"
            "    _ft = None\n"
            "def flatten(tree):\n"
            "    if _ft is None:\n"
            "        return _tu.FlatTree.flatten(tree)\n"            # 0.10.2 only, not guarded: reported
            "    return _ft.flatten(tree)\n"                          # 0.11.2 only, guarded import: fine
            "def unflatten(x):\n"
            "    return _ft.no_such_function(x)\n")                   # nowhere
    problems = api_check.check(door, both)
    assert sorted((p.line, p.version) for p in problems) == [(8, "0.11.2"), (11, "0.10.2+0.11.2")], problems


def test_attributes_read_on_jax_objects(both):
    door = ("ATTRIBUTES_READ = {\n"
            "    'jax._src.core.Jaxpr': ('eqns', 'invars', 'constvars', 'outvars', 'effects', 'debug_info'),\n"
            "    'jax._src.core.ClosedJaxpr': ('jaxpr', 'consts', 'in_avals', 'out_avals', 'in_aval_qdds'),\n"
            "    'jax._src.core.JaxprEqn': ('primitive', 'params', 'invars', 'outvars', 'source_info', 'ctx'),\n"
            "    'jax._src.core.Var': ('aval', 'initial_qdd'),\n"
            "    'jax.extend.core.Literal': ('val', 'aval'),\n"           # via the public re-export
            "    'jax._src.interpreters.partial_eval.JaxprTracer': ('pval', 'recipe', 'aval'),\n"  # aval: from Tracer
            "}\n"
            "ATTRIBUTES_OPTIONAL = {\n"
            "    'jax._src.core.Jaxpr': ('consts', 'map_jaxpr', 'no_such_member'),\n"
            "    'jax._src.core.NoSuchClass': ('x',),\n"
            "}\n")
    problems = api_check.check(door, both)
    got = sorted((p.line, p.version, p.message) for p in problems)
    # 0.11.2's ClosedJaxpr is Jaxpr: ClosedJaxpr.in_aval_qdds of 0.10.2 is gone; so is Var.initial_qdd
    assert got == [
        (3, "0.11.2", "ATTRIBUTES_READ: member jax._src.core.ClosedJaxpr.in_aval_qdds does not exist"),
        (5, "0.11.2", "ATTRIBUTES_READ: member jax._src.core.Var.initial_qdd does not exist"),
        (10, "0.10.2+0.11.2", "ATTRIBUTES_OPTIONAL: member jax._src.core.Jaxpr.no_such_member exists in no "
                              "supported version"),
        (11, "0.10.2+0.11.2", "ATTRIBUTES_OPTIONAL: class jax._src.core.NoSuchClass exists in no supported version"),
    ], got


def test_attribute_chains_follow_modules_reexports_and_classes(both):
    door = ("import jax.extend.core as _xcore\n"
            "from jax._src.interpreters import mlir as _mlir\n"
            "from jax._src.lib.mlir import ir as _ir\n"
            "from jax._src import core as _core\n"
            "from jax._src.util import safe_map\n"             # jaxlib's, re-exported by jax._src.util
            "_xcore.Jaxpr\n"
            "_mlir.ir.Context()\n"                              # jaxlib: not checkable, not reported
            "_ir.Module\n"
            "_core.Primitive.bind\n"
            "_core.Primitive.no_such_method\n"
            "import jax.no_such_module as _nope\n")
    problems = api_check.check(door, both)
    assert sorted({(p.line, p.version) for p in problems}) == [
        (10, "0.10.2"), (10, "0.11.2"), (11, "0.10.2"), (11, "0.11.2")], problems


def test_primitive_names(both):
    assert api_check.check_primitive_names(["add", "dot_general", "jit", "closed_call", "reduce_sum"], both) == []
    assert api_check.check_primitive_names(["program_order"], both) == []  # 0.11.2 only
    problems = api_check.check_primitive_names(["pjit", "hlopass_call", "no_such_primitive"], both,
                                               allow={"hlopass_call"})
    assert [p.message for p in problems] == ["primitive 'no_such_primitive' is defined in no supported version",
                                             "primitive 'pjit' is defined in no supported version"]


def test_call_primitives(both):
    m010, m011 = both
    for m in both:
        calls = api_check.call_primitives(m)
        assert {"jit", "custom_jvp_call", "custom_vjp_call", "remat2"} <= calls, m["jax_version"]
        assert "add" not in calls and "dot_general" not in calls
        assert api_check.call_primitives(m, reasons=("class",)) <= calls
    assert {"closed_call", "call"} <= api_check.call_primitives(m010, reasons=("class",))
    assert "closed_call" not in m011["primitives"]  # 0.11.2: closed_call_p = call_p = eval_jaxpr_p


# ---------------------------------------------------------------------------------------------------------------
# The manifests against the installed JAX (0.10.2)


def _installed() -> dict:
    jax = pytest.importorskip("jax")
    if jax.__version__ != "0.10.2":
        pytest.skip(f"the installed JAX is {jax.__version__}, not 0.10.2")
    return _load("0.10.2")


def _runtime_signature(fn) -> str | None:
    try:
        sig = inspect.signature(fn, follow_wrapped=True)
    except (TypeError, ValueError):
        return None
    out, posonly_done, kwonly_started = [], False, False
    params = list(sig.parameters.values())
    for i, p in enumerate(params):
        default = "=" if p.default is not inspect.Parameter.empty else ""
        if p.kind is p.POSITIONAL_ONLY:
            out.append(p.name + default)
            if i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY:
                out.append("/")
        elif p.kind is p.POSITIONAL_OR_KEYWORD:
            out.append(p.name + default)
        elif p.kind is p.VAR_POSITIONAL:
            out.append("*" + p.name)
            kwonly_started = True
        elif p.kind is p.KEYWORD_ONLY:
            if not kwonly_started:
                out.append("*")
                kwonly_started = True
            out.append(p.name + default)
        else:
            out.append("**" + p.name)
    del posonly_done
    return "(" + ", ".join(out) + ")"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("module", ["jax._src.core", "jax._src.interpreters.partial_eval", "jax._src.interpreters.ad",
                                    "jax._src.interpreters.mlir", "jax._src.util", "jax.extend.core", "jax.core"])
def test_recorded_names_exist_in_the_installed_jax(module):
    manifest = _installed()
    imported = importlib.import_module(module)
    names = manifest["modules"][module]["names"]
    missing = [name for name, entry in names.items()
               if not (entry["kind"] == "deprecated" and entry.get("removed")) and not hasattr(imported, name)]
    assert not missing, missing
    removed = [name for name, entry in names.items() if entry["kind"] == "deprecated" and entry.get("removed")]
    assert not [name for name in removed if hasattr(imported, name)]


@pytest.mark.parametrize("module", ["jax._src.core", "jax._src.interpreters.partial_eval", "jax._src.interpreters.ad",
                                    "jax._src.interpreters.batching", "jax._src.api_util", "jax._src.pjit"])
def test_recorded_signatures_match_inspect(module):
    manifest = _installed()
    imported = importlib.import_module(module)
    compared, wrong = 0, []
    for name, entry in manifest["modules"][module]["names"].items():
        if entry["kind"] == "function":
            if not api_check._signature_trusted(entry):  # e.g. lu.transformation2: the checker skips those too
                continue
            runtime = _runtime_signature(getattr(imported, name))
            if runtime is None or (entry.get("decorators") and runtime == "(*args, **kwargs)"):
                continue
            compared += 1
            if runtime != entry["sig"]:
                wrong.append((name, entry["sig"], runtime, entry.get("decorators")))
        elif entry["kind"] == "class":
            cls = getattr(imported, name)
            for method, sig in entry.get("methods", {}).items():
                dunder = method.startswith("__") and method not in ("__init__", "__new__")
                if isinstance(sig, dict) or cls.__dict__.get(method) is None or dunder:  # dunders: patched later
                    continue
                runtime = _runtime_signature(cls.__dict__[method])
                if runtime is None:
                    continue
                compared += 1
                if runtime != sig:
                    wrong.append((f"{name}.{method}", sig, runtime))
    assert compared > 10
    assert not wrong, wrong


def test_recorded_class_members_exist_in_the_installed_jax():
    manifest = _installed()
    core = importlib.import_module("jax._src.core")
    for cls_name in ("Jaxpr", "ClosedJaxpr", "JaxprEqn", "Var", "Literal", "Primitive", "ShapedArray", "Tracer"):
        entry = manifest["modules"]["jax._src.core"]["names"][cls_name]
        cls = getattr(core, cls_name)
        for key in ("methods", "properties", "attrs"):
            for member in entry.get(key, ()):
                assert hasattr(cls, member), (cls_name, member)
        for member in entry.get("slots", ()):
            assert member in cls.__slots__, (cls_name, member)


def test_recorded_primitives_are_the_installed_ones():
    manifest = _installed()
    checked = 0
    for name, entries in manifest["primitives"].items():
        for entry in entries:
            module = sys.modules.get(entry["module"])
            if module is None or "var" not in entry:
                continue
            value = getattr(module, entry["var"], None)
            assert value is not None, (name, entry)
            assert value.name == name, (name, entry, value.name)
            checked += 1
    assert checked > 100


def test_regenerating_reproduces_the_committed_manifest(tmp_path):
    _installed()
    import jax
    site = os.path.dirname(os.path.dirname(os.path.abspath(jax.__file__)))
    out = tmp_path / "jax.json"
    assert generate.main([site, "--out", str(out)]) == 0
    with open(os.path.join(MANIFESTS, "jax-0.10.2.json"), encoding="utf-8") as handle:
        committed = handle.read()
    assert out.read_text(encoding="utf-8") == committed, (
        "tools/jax_api/manifests/jax-0.10.2.json is stale: regenerate it (see tools/jax_api/generate.py)")
