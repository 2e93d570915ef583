"""Check hlopass's door to JAX's internals (``hlopass/internals.py``) against every supported JAX version's manifest.

Run it from the repository root: ``python -m tools.jax_api.check [--door hlopass/internals.py]`` checks the door
against every ``tools/jax_api/manifests/jax-*.json`` and exits 1 when it finds problems (one line each: the JAX
version(s), the door's line, the message). Nothing is imported: the door is parsed, the manifests are read.

The door's conventions, which the checker relies on:

* JAX modules are imported as aliases: ``from jax._src import core as _core``, ``from jax._src.interpreters import
  partial_eval as _pe``, ``import jax.extend.core as _xcore``, ``from jax._src.lib.mlir import ir as _ir``; or names
  directly: ``from jax._src.util import safe_map``. Each imported module must exist, and each name imported directly
  must exist in its module (following re-exports such as ``from jax._src.core import Var as Var``) in EVERY
  supported version. An import inside a ``try:`` whose handler catches ImportError, AttributeError (or Exception),
  or inside such a handler (the fallback), needs the name in AT LEAST ONE version.
* Attribute chains on a module alias (``_core.Var``, ``_pe.dce_jaxpr(...)``, ``_ad.primitive_jvps[p]``, nested
  ``_mlir.ir.Context``, ``_core.Primitive.bind``) must resolve in EVERY version; the chain is followed through
  modules, re-exports and class members, and stops at anything else (a variable, a function, a name inside
  jaxlib, a module with a star import from outside JAX or a module-level ``__getattr__``: those are not checked).
  Inside ``try:`` (handler catching AttributeError/ImportError/Exception) or under ``if hasattr(_mod, "name")``
  (either branch; also with ``and``/``or``/``not``), ``_mod.name`` is optional: it must exist in at least one version.
  So is every chain on an alias imported under such a ``try:`` (``try: from jax._src import flattree as _ft`` /
  ``except ImportError: _ft = None``, then ``_ft.flatten(...)`` anywhere).
  Assignments (``_mod.name = ...``, monkey-patching) are checked like reads.
* Feature checks name optional things: ``getattr(_mod, "name", default)``, ``hasattr(_mod, "name")`` and the door's
  helper ``_optional(_mod, "name")`` need the name in AT LEAST ONE version (otherwise the code is dead: reported).
  ``getattr(_mod, "name")`` without a default is a plain read (every version). ``hasattr(obj, "attr")`` on anything
  that is not a module alias needs ``attr`` to be a member of some JAX class (or a NamedTuple member, or a
  top-level name of a JAX module) in at least one version (best effort; dunder names are not checked;
  ``getattr(obj, "attr", default)`` on non-modules is not checked: it is too often used on hlopass's own objects).
* Calls whose callee resolves to a function or class (``_pe.dce_jaxpr(j, used, instantiate=True)``,
  ``_core.Var(aval)``, ``safe_map(f, xs)``) are checked against the signature in every version where the callee
  exists: number of positional arguments, keyword names (unknown ones, positional-only ones, ones filled twice)
  and missing required parameters. ``*args`` in the call turns off the positional count and the missing-parameter
  check, ``**kw`` the missing-parameter check. A class call checks ``__init__`` (or ``__new__``; a NamedTuple's or
  dataclass's fields), found along the bases within JAX. Functions whose decorators may change the signature
  (anything but cache/lru_cache/weakref_lru_cache/api_boundary/contextmanager/wraps/jit/partial(jit)/...) are not
  checked.
* ``ATTRIBUTES_READ = {"jax._src.core.Jaxpr": ("eqns", "invars"), ...}`` (a module-level dict literal of string
  keys and tuples/lists of strings): each class must exist and each attribute be a member (methods, properties,
  ``__slots__``, class attributes, annotations, ``self.x = ...`` in any method, NamedTuple/dataclass fields,
  following bases within JAX) in EVERY version. ``ATTRIBUTES_OPTIONAL`` (same shape): a member in AT LEAST ONE
  version (and the class in at least one). A class with a base outside JAX (other than object/typing/abc/enum
  classes) may inherit the member from there: a missing member of such a class is not reported.

Also: :func:`check_primitive_names` (primitive names the door or the passes match on must be defined in at least
one version, or be hlopass's own) and :func:`call_primitives` (a version's call primitives, for a test that the
door's list of inlinable call primitives covers them).
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import os
import sys
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from tools.jax_api.generate import parse_signature

HERE = os.path.dirname(os.path.abspath(__file__))
MANIFESTS = os.path.join(HERE, "manifests")

#: decorators that keep the wrapped function's signature (matched on the last dotted component)
TRANSPARENT_DECORATORS = frozenset({
    "cache", "lru_cache", "weakref_lru_cache", "api_boundary", "contextmanager", "wraps", "staticmethod",
    "classmethod", "jit", "partial(jit)", "partial(api_boundary)", "deprecated", "memoize", "final",
    "abstractmethod", "override", "cached_property", "use_cpp_method", "export", "annotate_function",
    "custom_jvp", "custom_vjp", "register_lowering", "register_lowering_rule", "partial(weakref_lru_cache)",
    "partial(lru_cache)", "partial(cache)", "partial(custom_jvp)", "partial(custom_vjp)",
})

#: bases from outside JAX that add no members a door would read
PLAIN_BASES = frozenset({
    "object", "Generic", "Protocol", "ABC", "abc.ABC", "enum.Enum", "Enum", "enum.IntEnum", "IntEnum",
    "NamedTuple", "typing.NamedTuple", "Exception", "ValueError", "TypeError", "RuntimeError", "threading.local",
    "collections.namedtuple", "str", "int", "tuple", "dict", "list", "typing.Generic", "typing.Protocol",
})

NAMEDTUPLE_MEMBERS = ("_replace", "_fields", "_asdict", "_make", "_field_defaults", "count", "index")

EXTERNAL = "external"  # a lookup that left JAX's sources (jaxlib, numpy, a star import, a __getattr__)


@dataclass(frozen=True)
class Problem:
    version: str  # "0.11.2", or several joined by "+" for rules over all versions
    line: int
    message: str

    def __str__(self) -> str:
        return f"jax {self.version}: line {self.line}: {self.message}"


# --------------------------------------------------------------------------------------------------------------
# Looking names up in a manifest


class Api:
    """One manifest, with lookups that follow re-exports."""

    def __init__(self, manifest: Mapping):
        self.manifest = manifest
        self.version = manifest["jax_version"]
        self.modules: Mapping[str, Mapping] = manifest["modules"]

    def is_jax(self, module: str) -> bool:
        return module == "jax" or module.startswith("jax.")

    def module_exists(self, module: str) -> bool | str:
        if module in self.modules:
            return True
        return False if self.is_jax(module) else EXTERNAL

    def member(self, module: str, name: str, depth: int = 0):
        """The entry of ``module.name``: a dict (``{"kind": ..}``; modules as ``{"kind": "module", "module": m}``),
        ``EXTERNAL`` when it cannot be known, or ``None`` when it does not exist."""
        if depth > 30:
            return EXTERNAL
        if module not in self.modules:
            # ``jax._src.lib.utils`` where ``utils`` is a name inside jax._src.lib (imported there from jaxlib)
            parts = module.split(".")
            for cut in range(len(parts) - 1, 0, -1):
                if ".".join(parts[:cut]) in self.modules:
                    return self.resolve_chain(".".join(parts[:cut]), [*parts[cut:], name], depth + 1)
            return None if self.is_jax(module) else EXTERNAL
        info = self.modules[module]
        entry = info["names"].get(name)
        if entry is not None:
            if entry["kind"] in ("import", "alias"):
                if f"{entry['module']}.{entry['name']}" in self.modules:
                    return {"kind": "module", "module": f"{entry['module']}.{entry['name']}"}
                found = self.member(entry["module"], entry["name"], depth + 1)
                return found
            if entry["kind"] == "deprecated" and entry.get("removed"):
                return None
            return entry
        if f"{module}.{name}" in self.modules:  # a submodule, reachable once imported
            return {"kind": "module", "module": f"{module}.{name}"}
        unknown = False
        for star in info.get("star_imports", ()):
            found = self.member(star, name, depth + 1)
            if found is EXTERNAL:
                unknown = True
            elif found is not None and not name.startswith("_"):
                return found
        if unknown or info.get("getattr"):
            return EXTERNAL
        return None

    def class_entry(self, dotted: str, depth: int = 0):
        """``jax._src.core.Jaxpr`` -> (full name, class entry), or ``EXTERNAL``/``None``."""
        parts = dotted.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            module = ".".join(parts[:cut])
            if module in self.modules:
                entry = self.resolve_chain(module, parts[cut:])
                if isinstance(entry, dict) and entry.get("kind") == "class":
                    return entry
                return entry if entry is EXTERNAL else None
        return None if self.is_jax(dotted) else EXTERNAL

    def resolve_chain(self, module: str, attrs: Sequence[str], depth: int = 0):
        entry = {"kind": "module", "module": module}
        for attr in attrs:
            if entry is EXTERNAL or entry is None:
                return entry
            kind = entry["kind"]
            if kind == "module":
                entry = self.member(entry["module"], attr, depth + 1)
            elif kind == "class":
                member = self.class_member(entry, attr)
                if member is None or member is EXTERNAL:
                    return member
                entry = {"kind": "member", **member}
            else:
                return EXTERNAL
        return entry

    def class_member(self, cls: Mapping, attr: str, depth: int = 0):
        """``{"what": "method"|"property"|..., "sig": ...}``; ``EXTERNAL`` when a base outside JAX may have it;
        ``None`` when no JAX class along the bases has it."""
        methods = cls.get("methods", {})
        if attr in methods:
            value = methods[attr]
            if isinstance(value, dict):
                return {"what": value["kind"], "sig": value["sig"]}
            return {"what": "method", "sig": value}
        for key in ("properties", "slots", "attrs", "annotations", "instance_attrs", "fields"):
            if attr in cls.get(key, ()):
                return {"what": key}
        if "NamedTuple" in {b.split(".")[-1] for b in cls.get("bases", ())} or "collections.namedtuple" in cls.get(
                "bases", ()):
            if attr in NAMEDTUPLE_MEMBERS:
                return {"what": "namedtuple"}
        if attr in ("__init__", "__new__", "__class__", "__dict__", "__doc__", "__name__", "__module__"):
            return {"what": "builtin"}
        unknown = False
        for base in cls.get("bases", ()):
            if base in PLAIN_BASES:
                continue
            if depth > 30:
                return EXTERNAL
            found = self.class_entry(base)
            if found is EXTERNAL or found is None:
                unknown = True
                continue
            member = self.class_member(found, attr, depth + 1)
            if member is EXTERNAL:
                unknown = True
            elif member is not None:
                return member
        return EXTERNAL if unknown else None

    def constructor(self, cls: Mapping, depth: int = 0) -> tuple[str, bool] | None:
        """(signature, drop_first) of the class's ``__init__``/``__new__`` along JAX bases; None if unknown."""
        methods = cls.get("methods", {})
        for name in ("__init__", "__new__"):
            if name in methods:
                value = methods[name]
                sig = value["sig"] if isinstance(value, dict) else value
                return sig, True
        if "synthesized_init" in cls:
            return cls["synthesized_init"], True
        for base in cls.get("bases", ()):
            if base in PLAIN_BASES:
                continue
            found = self.class_entry(base)
            if not isinstance(found, dict) or depth > 30:
                return None
            return self.constructor(found, depth + 1)
        return None

    def all_member_names(self) -> set[str]:
        names: set[str] = set(NAMEDTUPLE_MEMBERS)
        for info in self.modules.values():
            for name, entry in info["names"].items():
                names.add(name)
                if entry["kind"] == "class":
                    for key in ("methods", "properties", "slots", "attrs", "annotations", "instance_attrs", "fields"):
                        names.update(entry.get(key, ()))
        return names


# --------------------------------------------------------------------------------------------------------------
# Calls against signatures


def call_problems(sig: str, call: ast.Call, drop_first: bool = False) -> list[str]:
    """What is wrong with ``call`` against the signature string ``sig`` (empty: nothing seen)."""
    s = parse_signature(sig)
    positional = list(s["positional"])
    posonly = list(s["posonly"])
    if drop_first and positional:
        if posonly:
            posonly.pop(0)
        positional.pop(0)
    starred = any(isinstance(a, ast.Starred) for a in call.args)
    spread = any(kw.arg is None for kw in call.keywords)
    npos = sum(1 for a in call.args if not isinstance(a, ast.Starred))
    out: list[str] = []
    if not starred and s["vararg"] is None and npos > len(positional):
        out.append(f"{npos} positional arguments, at most {len(positional)} accepted")
    filled = set(positional[:npos])
    keywords = [kw.arg for kw in call.keywords if kw.arg is not None]
    accepted = (set(positional) - set(posonly)) | set(s["kwonly"])
    for kw in keywords:
        if kw in posonly and s["kwarg"] is None:
            out.append(f"keyword {kw}= names a positional-only parameter")
        elif kw not in accepted and s["kwarg"] is None:
            out.append(f"unknown keyword {kw}=")
        elif kw in filled and not starred:
            out.append(f"{kw} given positionally and as {kw}=")
    if not starred and not spread:
        required = [p for p in positional if p not in s["defaults"]]
        missing = [p for p in required if p not in filled and p not in keywords]
        missing += [p for p in s["kwonly_required"] if p not in keywords]
        if missing:
            out.append("missing " + ", ".join(missing))
    return out


def _decorator_key(decorator: str) -> str:
    """``functools.lru_cache`` -> ``lru_cache``; ``partial(api.jit)`` -> ``partial(jit)``."""
    if decorator in ("lu.cache", "linear_util.cache"):  # caches a WrappedFun transformation: (fun, *args)
        return decorator
    if decorator.startswith("partial(") and decorator.endswith(")"):
        return f"partial({decorator[8:-1].split('.')[-1]})"
    return decorator.split(".")[-1]


def _signature_trusted(entry: Mapping) -> bool:
    return all(_decorator_key(d) in TRANSPARENT_DECORATORS for d in entry.get("decorators", ()))


# --------------------------------------------------------------------------------------------------------------
# Reading the door


_GUARD_EXCEPTIONS = {"ImportError", "ModuleNotFoundError", "AttributeError", "Exception", "BaseException"}


def _dotted(node: ast.AST) -> list[str] | None:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else [*head, node.attr]
    return None


def _string(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _catches_guard(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any((_dotted(t) or [""])[-1] in _GUARD_EXCEPTIONS for t in types)


@dataclass
class _Use:
    kind: str  # "module" | "from" | "chain" | "optional" | "anyattr" | "call" | "attributes"
    line: int
    optional: bool
    data: tuple


class _DoorReader(ast.NodeVisitor):
    """Collects what the door uses; the version-dependent judgement is done afterwards, per manifest."""

    def __init__(self, tree: ast.Module):
        self.aliases: dict[str, str] = {}  # alias -> module (imported as a module)
        self.names: dict[str, tuple[str, str]] = {}  # local name -> (module, name) (imported from a module)
        self.uses: list[_Use] = []
        self.guards: list[bool] = []  # inside try/except ImportError...
        self.hasattr_guards: list[set[tuple[str, str]]] = []
        self.optional_roots: set[str] = set()  # names imported under a guarding try: (or its handler)
        self._collect_imports(tree)
        self.visit(tree)

    # imports: all of them, anywhere, first (aliases are used before definition order matters)
    def _collect_imports(self, tree: ast.Module) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Try) and any(_catches_guard(h) for h in node.handlers):
                for part in (*node.body, *node.handlers):
                    for sub in ast.walk(part):
                        if isinstance(sub, (ast.Import, ast.ImportFrom)):
                            self.optional_roots.update(
                                (a.asname or a.name.split(".")[0]) for a in sub.names if a.name != "*")
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "jax" or alias.name.startswith("jax."):
                        self.aliases[alias.asname or alias.name.split(".")[0]] = (
                            alias.name if alias.asname else alias.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level and (
                    node.module == "jax" or node.module.startswith("jax.")):
                for alias in node.names:
                    if alias.name != "*":
                        # a module or a name: decided per version (the manifest knows the modules)
                        self.names[alias.asname or alias.name] = (node.module, alias.name)

    @property
    def guarded(self) -> bool:
        return any(self.guards)

    def _hasattr_guarded(self, chain: list[str]) -> bool:
        if len(chain) < 2:
            return False
        key = (".".join(chain[:-1]), chain[-1])
        return any(key in guard for guard in self.hasattr_guards)

    def visit_Try(self, node: ast.Try) -> None:
        self.guards.append(any(_catches_guard(h) for h in node.handlers))
        for stmt in node.body:
            self.visit(stmt)
        self.guards.pop()
        guarding = any(_catches_guard(h) for h in node.handlers)
        for handler in node.handlers:  # the fallback of a guarded import runs where the first one failed
            self.guards.append(guarding)
            self.visit(handler)
            self.guards.pop()
        for part in (*node.orelse, *node.finalbody):
            self.visit(part)

    visit_TryStar = visit_Try

    def visit_If(self, node: ast.If) -> None:
        keys: set[tuple[str, str]] = set()
        for sub in ast.walk(node.test):
            if isinstance(sub, ast.Call) and _dotted(sub.func) in (["hasattr"], ["getattr"], ["_optional"]) and len(
                    sub.args) >= 2 and _dotted(sub.args[0]) and _string(sub.args[1]):
                keys.add((".".join(_dotted(sub.args[0])), _string(sub.args[1])))
        self.visit(node.test)
        self.hasattr_guards.append(keys)
        for stmt in (*node.body, *node.orelse):
            self.visit(stmt)
        self.hasattr_guards.pop()

    def visit_IfExp(self, node: ast.IfExp) -> None:
        keys = {(".".join(_dotted(s.args[0])), _string(s.args[1])) for s in ast.walk(node.test)
                if isinstance(s, ast.Call) and _dotted(s.func) in (["hasattr"], ["getattr"], ["_optional"])
                and len(s.args) >= 2 and _dotted(s.args[0]) and _string(s.args[1])}
        self.visit(node.test)
        self.hasattr_guards.append(keys)
        self.visit(node.body)
        self.visit(node.orelse)
        self.hasattr_guards.pop()

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == "jax" or alias.name.startswith("jax."):
                self.uses.append(_Use("module", node.lineno, self.guarded, (alias.name,)))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not node.module or not (node.module == "jax" or node.module.startswith("jax.")):
            return
        for alias in node.names:
            if alias.name == "*":
                self.uses.append(_Use("module", node.lineno, self.guarded, (node.module,)))
            else:
                self.uses.append(_Use("from", node.lineno, self.guarded, (node.module, alias.name)))

    def _root(self, name: str) -> tuple[str, list[str]] | None:
        """The module and the attribute path a door name stands for."""
        if name in self.aliases:
            return self.aliases[name], []
        if name in self.names:
            module, member = self.names[name]
            return module, [member]
        return None

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain = _dotted(node)
        if chain and (root := self._root(chain[0])) is not None:
            module, path = root
            attrs = [*path, *chain[1:]]
            optional = self.guarded or self._hasattr_guarded(chain) or chain[0] in self.optional_roots
            self.uses.append(_Use("chain", node.lineno, optional, (module, tuple(attrs), ".".join(chain))))
            return
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = _dotted(node.func)
        if func in (["getattr"], ["hasattr"], ["_optional"]) and len(node.args) >= 2 and _string(node.args[1]):
            target = _dotted(node.args[0])
            root = self._root(target[0]) if target else None
            name = _string(node.args[1])
            if root is not None:
                module, path = root
                attrs = (*path, *target[1:], name)
                required = func == ["getattr"] and len(node.args) == 2 and not self.guarded
                self.uses.append(_Use("chain" if required else "optional", node.lineno, not required,
                                      (module, attrs, ".".join([*target, name]))))
            elif func == ["hasattr"]:
                self.uses.append(_Use("anyattr", node.lineno, True, (name, func[0])))
            for arg in node.args:
                self.visit(arg)
            for kw in node.keywords:
                self.visit(kw.value)
            return
        if func and (root := self._root(func[0])) is not None:
            module, path = root
            optional = self.guarded or self._hasattr_guarded(func) or func[0] in self.optional_roots
            self.uses.append(_Use("call", node.lineno, optional, (module, (*path, *func[1:]), ".".join(func), node)))
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        # a directly imported name used bare: the import itself is checked; nothing more here
        return


def _attribute_dicts(tree: ast.Module) -> dict[str, list[tuple[int, str, str]]]:
    out: dict[str, list[tuple[int, str, str]]] = {"ATTRIBUTES_READ": [], "ATTRIBUTES_OPTIONAL": []}
    for stmt in tree.body:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(
            stmt, ast.AnnAssign) else []
        for target in targets:
            if isinstance(target, ast.Name) and target.id in out and isinstance(stmt.value, ast.Dict):
                for key, value in zip(stmt.value.keys, stmt.value.values):
                    cls = _string(key)
                    if cls is None or not isinstance(value, (ast.Tuple, ast.List, ast.Set)):
                        out[target.id].append((getattr(key, "lineno", stmt.lineno), "?", "?"))
                        continue
                    for element in value.elts:
                        attr = _string(element)
                        out[target.id].append((element.lineno, cls, attr if attr is not None else "?"))
    return out


# --------------------------------------------------------------------------------------------------------------
# The check


def _as_list(manifests) -> list[Mapping]:
    if isinstance(manifests, Mapping):
        return [manifests]
    return list(manifests)


def check(door_source: str, manifests) -> list[Problem]:
    """Problems of the door against one manifest (a dict) or several (an iterable of dicts: the supported range).

    Rules needing a name in EVERY version are checked against each manifest (the problem names that version);
    rules needing it in AT LEAST ONE are checked against the whole set given (the problem names all of them)."""
    apis = [Api(m) for m in _as_list(manifests)]
    tree = ast.parse(door_source)
    reader = _DoorReader(tree)
    problems: list[Problem] = []
    everyone = "+".join(a.version for a in apis)
    names_cache: dict[int, set[str]] = {}

    def member_names(api: Api) -> set[str]:
        if id(api) not in names_cache:
            names_cache[id(api)] = api.all_member_names()
        return names_cache[id(api)]

    def required_or_optional(line: int, optional: bool, exists_in, subject: str) -> None:
        """exists_in(api) -> True/False/EXTERNAL/None; report per version (required) or once (optional)."""
        results = [(api, exists_in(api)) for api in apis]
        if optional:
            if all(r is False or r is None for _, r in results):
                problems.append(Problem(everyone, line, f"{subject} exists in no supported version"))
        else:
            for api, r in results:
                if r is False or r is None:
                    problems.append(Problem(api.version, line, f"{subject} does not exist"))

    for use in reader.uses:
        if use.kind == "module":
            (module,) = use.data
            required_or_optional(use.line, use.optional, lambda api: api.module_exists(module),
                                 f"module {module}")
        elif use.kind == "from":
            module, name = use.data
            required_or_optional(
                use.line, use.optional,
                lambda api: api.module_exists(module) and api.member(module, name) is not None,
                f"{module}.{name} (from {module} import {name})")
            for api in apis:
                entry = api.member(module, name)
                if isinstance(entry, dict) and entry.get("kind") == "deprecated":
                    problems.append(Problem(api.version, use.line, f"{module}.{name} is deprecated"))
        elif use.kind in ("chain", "optional"):
            module, attrs, text = use.data

            def resolves(api, module=module, attrs=attrs):
                if not api.module_exists(module):
                    return False
                return api.resolve_chain(module, attrs) is not None

            label = "feature check of" if use.kind == "optional" else "attribute"
            required_or_optional(use.line, use.optional, resolves,
                                 f"{label} {text} ({'.'.join([module, *attrs])})")
            for api in apis:
                entry = api.resolve_chain(module, attrs) if module in api.modules else None
                if isinstance(entry, dict) and entry.get("kind") == "deprecated":
                    problems.append(Problem(api.version, use.line, f"{'.'.join([module, *attrs])} is deprecated"))
        elif use.kind == "anyattr":
            name, func = use.data
            if name.startswith("__") and name.endswith("__"):
                continue
            if not any(name in member_names(api) for api in apis):
                problems.append(Problem(everyone, use.line, f"{func}(..., {name!r}): {name} exists in no supported "
                                        f"version (as a member of a JAX class or a name in a JAX module)"))
        elif use.kind == "call":
            module, attrs, text, call = use.data
            for api in apis:
                if module not in api.modules:
                    continue
                entry = api.resolve_chain(module, attrs)
                if not isinstance(entry, dict):
                    continue
                sig, drop_first = None, False
                if entry["kind"] == "function" and _signature_trusted(entry):
                    sig = entry["sig"]
                elif entry["kind"] == "class":
                    found = api.constructor(entry)
                    if found:
                        sig, drop_first = found
                elif entry["kind"] == "member" and entry.get("sig"):
                    what = entry.get("what")
                    sig, drop_first = entry["sig"], what == "classmethod"
                if sig is None:
                    continue
                for message in call_problems(sig, call, drop_first):
                    problems.append(Problem(api.version, use.line, f"call {text}{sig}: {message}"))

    attribute_dicts = _attribute_dicts(tree)
    for key, optional in (("ATTRIBUTES_READ", False), ("ATTRIBUTES_OPTIONAL", True)):
        for line, cls, attr in attribute_dicts[key]:
            if cls == "?" or attr == "?":
                problems.append(Problem(everyone, line, f"{key}: keys must be strings and values tuples of strings"))
                continue

            def has_class(api, cls=cls):
                return api.class_entry(cls) is not None

            def has_member(api, cls=cls, attr=attr):
                entry = api.class_entry(cls)
                if entry is EXTERNAL:
                    return EXTERNAL
                if entry is None:
                    return None
                return api.class_member(entry, attr)

            required_or_optional(line, optional, has_class, f"{key}: class {cls}")
            if optional:
                if any(has_class(api) for api in apis):
                    required_or_optional(line, True, has_member, f"{key}: member {cls}.{attr}")
            else:
                for api in apis:
                    if has_class(api) and has_member(api) is None:
                        problems.append(Problem(api.version, line, f"{key}: member {cls}.{attr} does not exist"))
    unique: list[Problem] = []
    for problem in problems:
        if problem not in unique:
            unique.append(problem)
    return sorted(unique, key=lambda p: (p.line, p.version, p.message))


# --------------------------------------------------------------------------------------------------------------
# Primitives


def check_primitive_names(names: Iterable[str], manifests, allow: Iterable[str] = ()) -> list[Problem]:
    """Each name must be a primitive defined in at least one of the manifests, or be in ``allow`` (hlopass's own
    primitives)."""
    manifests = _as_list(manifests)
    allowed = set(allow)
    everyone = "+".join(m["jax_version"] for m in manifests)
    return [Problem(everyone, 0, f"primitive {name!r} is defined in no supported version")
            for name in sorted(set(names)) if name not in allowed
            and not any(name in m["primitives"] for m in manifests)]


def call_primitives(manifest: Mapping, reasons: Iterable[str] = ("class", "call_jaxpr", "jaxpr")) -> set[str]:
    """The version's call primitives by the generator's static heuristic (see generate.py). ``reasons`` picks
    which evidence counts: ``class`` (made by a CallPrimitive/ClosedCallPrimitive class), ``call_jaxpr`` (bound
    with ``call_jaxpr=``), ``jaxpr`` (bound or made an equation with ``jaxpr=``; this also finds scan, reduce,
    run_state and the like, whose bodies are not simply inlined)."""
    wanted = set(reasons)
    out = set()
    for name, evidence in manifest["call_primitives"].items():
        for reason in evidence:
            kind = "class" if reason.startswith("class ") else reason.split("(", 1)[1].split("=", 1)[0]
            if kind in wanted:
                out.add(name)
    return out


# --------------------------------------------------------------------------------------------------------------


def load_manifests(folder: str = MANIFESTS) -> list[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "jax-*.json"))):
        with open(path, encoding="utf-8") as handle:
            out.append(json.load(handle))
    return out


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check hlopass's door to JAX internals against the manifests.")
    parser.add_argument("--door", default="hlopass/internals.py")
    parser.add_argument("--manifests", default=MANIFESTS, help="folder of jax-*.json manifests")
    args = parser.parse_args(list(argv) if argv is not None else None)
    with open(args.door, encoding="utf-8") as handle:
        source = handle.read()
    manifests = load_manifests(args.manifests)
    if not manifests:
        print(f"no manifests in {args.manifests}", file=sys.stderr)
        return 2
    problems = check(source, manifests)
    for problem in problems:
        print(f"{args.door}:{problem.line}: jax {problem.version}: {problem.message}")
    versions = ", ".join(m["jax_version"] for m in manifests)
    print(f"{len(problems)} problem(s); checked {args.door} against JAX {versions}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
