"""One vocabulary: every primitive name hlopass matches on is a primitive of a supported JAX version.

The families (``hlopass/families.py``) and the passes' per-primitive tables (the split rules, the algebraic
expansion rules, the guards' sets, the matrix chain's links, remat's cost sets...) are found by walking the
modules: every public upper-case module attribute that is a set of strings or a dict keyed by strings. A
misspelled or retired name (``pjit``, ``checkpoint``, ``expand_dims``) would make a rule silently dead, so it
fails here. The manifests (``tools/jax_api/manifests``) say which primitives each version defines.
"""

from __future__ import annotations

import importlib
import pkgutil
import types

import pytest

from tools.jax_api.check import call_primitives, check_primitive_names, load_manifests

#: hlopass's own primitives, defined by no JAX version.
OWN = ("hlopass_call",)

#: Modules outside the passes whose tables are keyed by primitive names.
ENGINE_MODULES = ("hlopass.families", "hlopass.internals", "hlopass.interpreter")

#: Upper-case tables of those modules that are not keyed by primitive names.
NOT_PRIMITIVE_TABLES = frozenset({"hlopass.internals.ATTRIBUTES_READ", "hlopass.internals.ATTRIBUTES_OPTIONAL"})

#: Call primitives (by the manifests' evidence: a call primitive class, or bound with ``call_jaxpr=``) that
#: hlopass deliberately does not inline, and why.
NOT_INLINED = {
    "composite": "jax.lax.composite: a named decomposition lowered as one stablehlo.composite, which a backend "
                 "may replace; inlining would lose the name",
    "program_order": "JAX 0.11's program_order (jax._src.pjit): it pins its body's order against the rest of "
                     "the program, which inlining would drop",
    "call": "JAX 0.10's core.call_p: its body is an open jaxpr under call_jaxpr, which jaxpr_utils.call_body "
            "does not read (jax.jit binds jit, closed programs closed_call)",
}


@pytest.fixture(scope="module")
def manifests() -> list[dict]:
    found = load_manifests()
    assert {m["jax_version"] for m in found} >= {"0.10.2", "0.11.2"}
    return found


def _tables(module: types.ModuleType) -> dict[str, frozenset]:
    """``{"module.NAME": names}`` for each public upper-case set of strings or dict keyed by strings."""
    out = {}
    for name, value in vars(module).items():
        if name.startswith("_") or not name.isupper():
            continue
        if isinstance(value, (set, frozenset)) and value and all(isinstance(v, str) for v in value):
            out[f"{module.__name__}.{name}"] = frozenset(value)
        elif isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
            out[f"{module.__name__}.{name}"] = frozenset(value)
    return out


def _modules() -> list[types.ModuleType]:
    passes = importlib.import_module("hlopass.passes")
    names = list(ENGINE_MODULES) + [m.name for m in pkgutil.walk_packages(passes.__path__, "hlopass.passes.")]
    return [importlib.import_module(name) for name in names]


def _dead_names(tables: dict[str, frozenset], manifests) -> dict[str, list[str]]:
    """The names of each table that no supported version defines as a primitive (and hlopass does not own)."""
    out = {}
    for where, names in tables.items():
        problems = check_primitive_names(names, manifests, allow=OWN)
        if problems:
            out[where] = [p.message for p in problems]
    return out


def test_every_table_names_primitives_of_a_supported_version(manifests):
    tables = {}
    for module in _modules():
        tables.update(_tables(module))
    for name in NOT_PRIMITIVE_TABLES:
        tables.pop(name)
    # the walk finds the families and the passes' rule tables
    assert {"hlopass.families.LAYOUT", "hlopass.families.CHAIN", "hlopass.families.INLINABLE",
            "hlopass.internals.OPEN_BODIES", "hlopass.passes.split.rules.AXIS_RULES",
            "hlopass.passes.split.rules.CHUNK_PARAMS", "hlopass.passes.split.online.PASS_THROUGH",
            "hlopass.passes.algebraic.expansion.EXPANSION_RULES", "hlopass.passes.algebraic.guards.ZERO_KEEPING",
            "hlopass.passes.algebraic.match.LOOKED_THROUGH", "hlopass.passes.matrix_chain.network.LINK_PRIMITIVES",
            "hlopass.passes.remat.cost.TRANSCENDENTAL"} <= set(tables)
    assert _dead_names(tables, manifests) == {}


def test_a_misspelled_name_in_a_table_fails(manifests):
    table = types.ModuleType("hlopass.passes.synthetic")
    table.RULES = {"reduce_sum": None, "reduce_summ": None}
    table.LOOKED_THROUGH = frozenset({"transpose", "expand_dims"})
    table._PRIVATE = frozenset({"not_a_table"})
    assert _dead_names(_tables(table), manifests) == {
        "hlopass.passes.synthetic.RULES": ["primitive 'reduce_summ' is defined in no supported version"],
        "hlopass.passes.synthetic.LOOKED_THROUGH": ["primitive 'expand_dims' is defined in no supported version"],
    }


def test_the_inlined_calls_cover_every_versions_plain_calls(manifests):
    from hlopass import families
    for manifest in manifests:
        calls = call_primitives(manifest, reasons=("class", "call_jaxpr"))
        missing = calls - set(NOT_INLINED) - families.INLINABLE
        assert not missing, (manifest["jax_version"], sorted(missing))
    every = set().union(*(call_primitives(m, reasons=("class", "call_jaxpr")) for m in manifests))
    assert set(NOT_INLINED) <= every  # each exception is a call primitive of some version
    assert not set(NOT_INLINED) & families.INLINABLE


def test_the_families_layout_and_chain():
    from hlopass import families
    assert families.LAYOUT <= families.CHEAP_TO_RECOMPUTE
    assert families.CHAIN - families.LAYOUT == {"dot_general", "reduce_sum", "mul"}
    assert "expand_dims" not in families.LAYOUT  # jnp.expand_dims binds broadcast_in_dim
