"""One door to JAX's internals: ``hlopass/internals.py`` alone imports them, and what it finds
there behaves on the installed JAX as hlopass expects."""

from __future__ import annotations

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hlopass import internals as jx

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOOR = ROOT / "hlopass" / "internals.py"
INTERNAL = ("jax._src", "jax.interpreters", "jax.extend", "jaxlib")
#: JAX's own test files, vendored unchanged for the peer-test subset.
VENDORED = ROOT / "tests" / "fuzz" / "jax_peer"


def _internal(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in INTERNAL)


def _dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def internal_uses(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` for every import of a JAX internal in ``source``, and every use of one
    through ``jax.`` attributes (``jax.extend.core.Var``)."""
    found = []
    tree = ast.parse(source)
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _internal(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if _internal(node.module):
                found.append((node.lineno, node.module))
            elif node.module == "jax":
                found += [(node.lineno, f"jax.{a.name}") for a in node.names if _internal(f"jax.{a.name}")]
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            name = _dotted(node)
            if name and _internal(name) and not isinstance(getattr(node, "ctx", None), ast.Store):
                found.append((node.lineno, name))
    return found


def _project_files():
    for folder in ("hlopass", "passes", "tools", "fixtures", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path != DOOR and VENDORED not in path.parents and ".venv" not in path.parts:
                yield path


def test_no_module_but_the_door_imports_jax_internals():
    offenders = [f"{path.relative_to(ROOT)}:{line}: {name}"
                 for path in _project_files() for line, name in internal_uses(path.read_text())]
    assert not offenders, "import JAX internals through hlopass.internals only:\n" + "\n".join(offenders)


@pytest.mark.parametrize("source, expected", [
    ("from jax._src import core", "jax._src"),
    ("import jax._src.api as api", "jax._src.api"),
    ("from jax.extend.core import Primitive", "jax.extend.core"),
    ("from jax import extend", "jax.extend"),
    ("import jax\nx = jax.extend.core.Var", "jax.extend.core.Var"),
    ("def f():\n    from jax.interpreters import mlir", "jax.interpreters"),
])
def test_the_check_finds_every_spelling(source, expected):
    assert [name for _, name in internal_uses(source)] == [expected]


def test_public_jax_is_not_an_internal():
    assert internal_uses("import jax\nfrom jax import lax\nx = jax.core.Tracer\nfrom jax.sharding import Mesh") == []


def test_the_door_is_the_lowest_layer():
    """It imports nothing of hlopass, so every module can use it."""
    tree = ast.parse(DOOR.read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m.startswith(("hlopass", "passes"))]


# -- the feature-checked helpers, on the installed JAX ---------------------------------------

def _closed(f, *args):
    return jax.make_jaxpr(f)(*args)


def test_linearize_jaxpr_has_its_first_form():
    closed = _closed(lambda x, y: [jnp.sin(x) * y], jnp.ones(3), jnp.ones(3))
    primal, num_res, nzs_out, in_fwd, tangent = jx.linearize_jaxpr(closed, [True, True], is_vjp=True)
    assert isinstance(num_res, int)
    assert len(primal.out_avals) == 1 + num_res
    assert list(nzs_out) == [True]
    x, y = np.arange(3.0, dtype=np.float32), np.full(3, 2.0, np.float32)
    outs = jx.jaxpr_as_fun(primal)(x, y)
    computed = iter(outs[1:])
    residuals = [next(computed) if f is None else [*closed.consts, x, y][f] for f in in_fwd]
    dx, dy = np.ones(3, np.float32), np.zeros(3, np.float32)
    (t,) = jx.jaxpr_as_fun(tangent)(*residuals, dx, dy)
    np.testing.assert_allclose(t, np.cos(x) * y, rtol=1e-6)


def test_open_and_closed_bodies_are_told_apart():
    closed = _closed(lambda x: [jax.checkpoint(jnp.sin)(x) * 2], 1.0)
    remat = next(e for e in closed.jaxpr.eqns if e.primitive.name in jx.OPEN_BODIES)
    assert jx.is_open_body(remat.primitive.name, "jaxpr", remat.params["jaxpr"])
    assert not jx.is_open_body("pjit", "jaxpr", closed)
    assert jx.is_closed_jaxpr(closed)


def test_flatten_tree_round_trips():
    tree = ([[1.0, 2.0], [3.0]], {})
    flat = jx.flatten_tree(tree)
    assert list(flat.unflatten()[0][0]) == [1.0, 2.0]


@pytest.mark.parametrize("monoid, expected", [("add", 0), ("mul", 1), ("max", -np.inf), ("min", np.inf)])
def test_reduction_identities(monoid, expected):
    assert float(jx.reduction_identity(monoid, np.dtype(np.float32))) == expected
