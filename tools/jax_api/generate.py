"""Write a JAX version's API manifest: every module's names, signatures, classes and primitives, read with ``ast``.

Nothing is imported from JAX: the sources are only parsed, so a manifest can be made for a JAX whose jaxlib
is not installed (or whose sources need a newer Python than the one running hlopass). Run it with a Python that
can parse the sources (JAX 0.11 uses Python 3.12 syntax); the output does not depend on the Python that runs it.

Regenerate the committed manifests (from the repository root)::

    # JAX 0.10.2, from the installed package (tools/setup.sh test installs it into .venv)
    .venv/bin/python -m tools.jax_api.generate .venv/lib/python3.11/site-packages \\
        --out tools/jax_api/manifests/jax-0.10.2.json
    # JAX 0.11.2, from the source tarball (Python 3.12 syntax: run it with Python >= 3.12)
    /root/.pyenv/versions/3.12.1/bin/python3.12 -m tools.jax_api.generate \\
        ../shared/jax-sources/jax-0.11.2.tar.xz --out tools/jax_api/manifests/jax-0.11.2.json

SRC may be a folder holding ``jax/`` (site-packages, an unpacked sdist), the ``jax/`` folder itself, or a
``.tar.xz``/``.tar.gz``/``.tgz``/``.tar``/``.whl``/``.zip`` archive with a ``jax/`` folder somewhere inside.

The manifest (sorted keys, one JSON value per line where short)::

    {"format": 1, "jax_version": "0.10.2",
     "modules": {"jax._src.core": {
         "names": {"Var": {"kind": "class", ...}, "eval_jaxpr": {"kind": "function", "sig": "(jaxpr, consts, *args, propagate_source_info=)"},
                   "config": {"kind": "module", "module": "jax._src.config"},          # import ... as ...
                   "safe_map": {"kind": "import", "module": "jax._src.util", "name": "safe_map"},  # from ... import
                   "x": {"kind": "variable"}, "get_aval": {"kind": "deprecated", "removed": true}},
         "star_imports": ["jaxlib.mlir.ir"], "getattr": true}},      # module-level __getattr__ (names unknowable)
     "primitives": {"add": [{"class": "naryop", "module": "jax._src.lax.lax", "var": "add_p"}]},
     "call_primitives": {"closed_call": ["class ClosedCallPrimitive"], "jit": ["bind(jaxpr=) in jax._src.pjit"]}}

Signatures are strings: ``(a, b, /, c, d=, *args, e, f=, **kwargs)``; ``=`` marks a parameter with a default.
A function's ``decorators`` list their callees (``partial(jit)`` for ``@partial(jit, ...)``); a decorator may change
the signature, so the checker trusts only known signature-preserving ones. A class records ``bases`` (resolved to
``module.Name`` where the base is imported or local), ``methods`` (name -> signature, with ``staticmethod``/
``classmethod``/``property`` kinds), ``properties``, ``slots``, ``attrs`` (class-level assignments), ``annotations``,
``instance_attrs`` (``self.x = ...`` in any method), ``decorators`` and, for NamedTuple/dataclass classes, ``fields``.

Primitives (static, best effort): a call whose callee's name ends in ``Primitive`` (``core.Primitive('add')``,
``CallPrimitive``, ``HiPrimitive``, any class in the module deriving from one) with a string as first argument or
``name=``; and an assignment to a name ending in ``_p`` from a call whose first positional string argument is the
name (``add_p = naryop(..., 'add')``, ``standard_primitive(shape, dtype, 'dot_general')``, ``unop(...)``). Names
built at run time (``core.Primitive(name)`` inside a helper) are not seen.

Call primitives (static heuristic): a primitive made by a class whose name contains ``CallPrimitive`` (CallPrimitive,
ClosedCallPrimitive and subclasses), or one bound somewhere as ``X_p.bind(..., call_jaxpr=...)`` or
``X_p.bind(..., jaxpr=...)`` (also ``bind_with_trace``), or made an equation as ``new_jaxpr_eqn(..., X_p,
dict(jaxpr=...)...)``/``{'jaxpr': ...}``. ``X_p`` is matched by variable name against the primitives found.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import tarfile
import zipfile
from typing import Iterable, Iterator

FORMAT = 1


# --------------------------------------------------------------------------------------------------------------
# Reading the sources


def _read_sources(src: str) -> dict[str, str]:
    """Map each ``jax/...py`` path (relative, '/'-separated, starting at ``jax/``) to its text."""
    files: dict[str, str] = {}

    def add(path: str, data: bytes) -> None:
        path = path.replace(os.sep, "/")
        parts = path.split("/")
        if "jax" not in parts or not path.endswith(".py"):
            return
        rel = "/".join(parts[parts.index("jax"):])
        files.setdefault(rel, data.decode("utf-8"))

    if os.path.isdir(src):
        root = src if os.path.basename(os.path.normpath(src)) == "jax" and os.path.exists(
            os.path.join(src, "version.py")) else os.path.join(src, "jax")
        if not os.path.isdir(root):
            raise SystemExit(f"{src}: no jax/ folder")
        for folder, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(names):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    with open(path, "rb") as handle:
                        rel = "jax/" + os.path.relpath(path, root).replace(os.sep, "/")
                        files[rel] = handle.read().decode("utf-8")
    elif src.endswith((".whl", ".zip")):
        with zipfile.ZipFile(src) as archive:
            for info in archive.infolist():
                add(info.filename, archive.read(info))
    else:
        with tarfile.open(src) as archive:
            for member in archive.getmembers():
                if member.isfile() and member.name.endswith(".py"):
                    add(member.name, archive.extractfile(member).read())
    if "jax/version.py" not in files:
        raise SystemExit(f"{src}: no jax/version.py found")
    return files


def _module_name(rel: str) -> str:
    parts = rel[:-3].split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _wanted(module: str) -> bool:
    """Every module of jax/ except the bulky and irrelevant parts (Pallas kernels' Mosaic/Triton/GPU back ends,
    example libraries, the jax2tf-era tools, experimental code)."""
    skip = ("jax.experimental", "jax.example_libraries", "jax.tools", "jax._src.pallas.mosaic",
            "jax._src.pallas.triton", "jax._src.pallas.mosaic_gpu", "jax._src.tpu", "jax._src.cudnn",
            "jax._src.third_party", "jax._src.internal_test_util")
    return not any(module == s or module.startswith(s + ".") for s in skip)


# --------------------------------------------------------------------------------------------------------------
# Small AST helpers


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _decorator_name(node: ast.AST) -> str:
    if isinstance(node, ast.Call):
        head = _dotted(node.func) or "?"
        if head.split(".")[-1] == "partial" and node.args:
            return f"partial({_dotted(node.args[0]) or '?'})"
        return head
    return _dotted(node) or "?"


def signature(args: ast.arguments) -> str:
    """``(a, b, /, c, d=, *args, e, f=, **kwargs)``."""
    positional = [*args.posonlyargs, *args.args]
    first_default = len(positional) - len(args.defaults)
    out: list[str] = []
    for i, arg in enumerate(positional):
        out.append(arg.arg + ("=" if i >= first_default else ""))
        if args.posonlyargs and i == len(args.posonlyargs) - 1:
            out.append("/")
    if args.vararg is not None:
        out.append("*" + args.vararg.arg)
    elif args.kwonlyargs:
        out.append("*")
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        out.append(arg.arg + ("=" if default is not None else ""))
    if args.kwarg is not None:
        out.append("**" + args.kwarg.arg)
    return "(" + ", ".join(out) + ")"


def parse_signature(sig: str) -> dict:
    """The parts of a signature string: ``posonly``, ``positional`` (all positional names, in order),
    ``defaults`` (the names of positional parameters with defaults), ``vararg``, ``kwonly``, ``kwonly_required``,
    ``kwarg``."""
    body = sig.strip()[1:-1].strip()
    parts = [p.strip() for p in body.split(",")] if body else []
    out = {"posonly": [], "positional": [], "defaults": [], "vararg": None, "kwonly": [], "kwonly_required": [],
           "kwarg": None}
    keyword_only = False
    for part in parts:
        if part == "/":
            out["posonly"] = list(out["positional"])
        elif part == "*":
            keyword_only = True
        elif part.startswith("**"):
            out["kwarg"] = part[2:]
        elif part.startswith("*"):
            out["vararg"] = part[1:]
            keyword_only = True
        else:
            name, has_default = part.rstrip("="), part.endswith("=")
            if keyword_only:
                out["kwonly"].append(name)
                if not has_default:
                    out["kwonly_required"].append(name)
            else:
                out["positional"].append(name)
                if has_default:
                    out["defaults"].append(name)
    return out


def _walk_top(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Top-level statements, descending into if/try/with blocks (both branches, in source order; of
    ``if TYPE_CHECKING:`` only the run-time branch)."""
    for stmt in body:
        if isinstance(stmt, ast.If):
            test = _dotted(stmt.test) or ""
            negated = isinstance(stmt.test, ast.UnaryOp) and isinstance(stmt.test.op, ast.Not)
            if negated:
                test = _dotted(stmt.test.operand) or ""
            if test.split(".")[-1] == "TYPE_CHECKING":  # only what exists at run time
                yield from _walk_top(stmt.orelse if not negated else stmt.body)
                continue
            yield from _walk_top(stmt.body)
            yield from _walk_top(stmt.orelse)
        elif isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
            yield from _walk_top(stmt.body)
            for handler in stmt.handlers:
                yield from _walk_top(handler.body)
            yield from _walk_top(stmt.orelse)
            yield from _walk_top(stmt.finalbody)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            yield from _walk_top(stmt.body)
        else:
            yield stmt


def _targets(target: ast.AST) -> Iterator[str]:
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from _targets(element)
    elif isinstance(target, ast.Starred):
        yield from _targets(target.value)


def _string(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


# --------------------------------------------------------------------------------------------------------------
# One module


class _Module:
    def __init__(self, name: str, is_package: bool, tree: ast.Module, all_modules: set[str]):
        self.name, self.is_package, self.tree, self.all_modules = name, is_package, tree, all_modules
        self.names: dict[str, dict] = {}
        self.star_imports: list[str] = []
        self.has_getattr = False
        # one walk of the tree serves the primitive searches
        self.nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.Call))]
        self.calls = [n for n in self.nodes if isinstance(n, ast.Call)]

    def _absolute(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        package = self.name.split(".") if self.is_package else self.name.split(".")[:-1]
        if node.level > 1:
            package = package[:len(package) - (node.level - 1)]
        return ".".join([*package, *([node.module] if node.module else [])])

    def resolve_local(self, dotted: str) -> str:
        """``core.Primitive`` -> ``jax._src.core.Primitive`` where ``core`` is imported; local names get the
        module's name; anything else stays as written."""
        head, _, rest = dotted.partition(".")
        entry = self.names.get(head)
        if entry is None:
            return dotted
        if entry["kind"] == "module":
            base = entry["module"]
        elif entry["kind"] in ("import", "alias"):
            base = f"{entry['module']}.{entry['name']}"
        else:
            base = f"{self.name}.{head}"
        return f"{base}.{rest}" if rest else base

    def collect(self) -> None:
        for stmt in _walk_top(self.tree.body):
            if isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.asname:
                        self.names[alias.asname] = {"kind": "module", "module": alias.name}
                    else:
                        top = alias.name.split(".")[0]
                        self.names[top] = {"kind": "module", "module": top}
            elif isinstance(stmt, ast.ImportFrom):
                module = self._absolute(stmt)
                for alias in stmt.names:
                    if alias.name == "*":
                        if module not in self.star_imports:
                            self.star_imports.append(module)
                        continue
                    local = alias.asname or alias.name
                    if f"{module}.{alias.name}" in self.all_modules:
                        self.names[local] = {"kind": "module", "module": f"{module}.{alias.name}"}
                    else:
                        self.names[local] = {"kind": "import", "module": module, "name": alias.name}
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                decorators = [_decorator_name(d) for d in stmt.decorator_list]
                if any(d.split(".")[-1] == "overload" for d in decorators):
                    continue
                if stmt.name == "__getattr__":
                    self.has_getattr = True
                entry = {"kind": "function", "sig": signature(stmt.args)}
                if decorators:
                    entry["decorators"] = decorators
                self.names[stmt.name] = entry
            elif isinstance(stmt, ast.ClassDef):
                self.names[stmt.name] = self._class(stmt)
            elif isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    for name in _targets(target):
                        self.names[name] = self._assigned(name, stmt.value)
            elif isinstance(stmt, ast.AnnAssign):
                if isinstance(stmt.target, ast.Name):
                    self.names[stmt.target.id] = self._assigned(stmt.target.id, stmt.value)
            elif isinstance(stmt, ast.AugAssign):
                for name in _targets(stmt.target):
                    self.names.setdefault(name, {"kind": "variable"})
            elif type(stmt).__name__ == "TypeAlias":
                self.names[stmt.name.id] = {"kind": "variable"}
            elif isinstance(stmt, (ast.For, ast.AsyncFor)):
                for name in _targets(stmt.target):
                    self.names[name] = {"kind": "variable"}
            elif isinstance(stmt, ast.Delete):
                for target in stmt.targets:
                    for name in _targets(target):
                        self.names.pop(name, None)
        deprecations = self._deprecations()
        for name, removed in deprecations.items():
            if name not in self.names:
                self.names[name] = {"kind": "deprecated", "removed": removed}

    def _assigned(self, name: str, value: ast.AST | None) -> dict:
        if isinstance(value, ast.Call) and (_dotted(value.func) or "").split(".")[-1] == "namedtuple":
            fields: list[str] = []
            if len(value.args) > 1:
                spec = value.args[1]
                if isinstance(spec, (ast.List, ast.Tuple)):
                    fields = [s for s in (_string(e) for e in spec.elts) if s]
                elif _string(spec):
                    fields = _string(spec).replace(",", " ").split()
            return {"kind": "class", "bases": ["collections.namedtuple"], "fields": fields,
                    "methods": {"__new__": "(_cls, " + ", ".join(fields) + ")" if fields else "(_cls)"}}
        dotted = _dotted(value) if value is not None else None
        if dotted and dotted.split(".")[0] in self.names and dotted != name:
            # X = Y / X = mod.Y: an alias (ClosedJaxpr = Jaxpr; DebugInfo = lu.DebugInfo)
            target = self.resolve_local(dotted)
            module, _, member = target.rpartition(".")
            if module:
                return {"kind": "alias", "module": module, "name": member}
        return {"kind": "variable"}

    def _deprecations(self) -> dict[str, bool]:
        out: dict[str, bool] = {}
        for stmt in _walk_top(self.tree.body):
            if (isinstance(stmt, (ast.Assign, ast.AnnAssign)) and isinstance(stmt.value, ast.Dict)
                    and any(t == "_deprecations" for t in
                            (_targets(stmt.target) if isinstance(stmt, ast.AnnAssign) else
                             (n for t in stmt.targets for n in _targets(t))))):
                for key, value in zip(stmt.value.keys, stmt.value.values):
                    name = _string(key)
                    if name is None:
                        continue
                    removed = (isinstance(value, ast.Tuple) and len(value.elts) > 1
                               and isinstance(value.elts[1], ast.Constant) and value.elts[1].value is None)
                    out[name] = removed
        return out

    def _class(self, node: ast.ClassDef) -> dict:
        bases = [self.resolve_local(d) if d else "?"
                 for d in (_dotted(b.value if isinstance(b, ast.Subscript) else b) for b in node.bases)]
        decorators = [_decorator_name(d) for d in node.decorator_list]
        methods: dict[str, str] = {}
        method_kinds: dict[str, str] = {}
        properties: set[str] = set()
        attrs: set[str] = set()
        annotations: list[str] = []
        annotated_defaults: list[str] = []
        slots: list[str] = []
        instance: set[str] = set()
        for stmt in _walk_top(node.body):
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                decos = [_decorator_name(d) for d in stmt.decorator_list]
                if any(d.split(".")[-1] == "overload" for d in decos):
                    continue
                last = [d.split(".")[-1] for d in decos]
                if "property" in last or "cached_property" in last or any(
                        d.endswith((".setter", ".getter", ".deleter")) for d in decos):
                    properties.add(stmt.name)
                    methods.pop(stmt.name, None)
                else:
                    methods[stmt.name] = signature(stmt.args)
                    if "staticmethod" in last:
                        method_kinds[stmt.name] = "staticmethod"
                    elif "classmethod" in last:
                        method_kinds[stmt.name] = "classmethod"
                    else:
                        method_kinds.pop(stmt.name, None)
                for sub in ast.walk(stmt):
                    targets: list[ast.AST] = []
                    if isinstance(sub, ast.Assign):
                        targets = sub.targets
                    elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
                        targets = [sub.target]
                    for target in targets:
                        for element in (target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]):
                            if (isinstance(element, ast.Attribute) and isinstance(element.value, ast.Name)
                                    and element.value.id == "self"):
                                instance.add(element.attr)
                    if (isinstance(sub, ast.Call) and _dotted(sub.func) in ("object.__setattr__", "setattr")
                            and len(sub.args) >= 2 and isinstance(sub.args[0], ast.Name)
                            and sub.args[0].id == "self" and _string(sub.args[1])):
                        instance.add(_string(sub.args[1]))
            elif isinstance(stmt, ast.ClassDef):
                attrs.add(stmt.name)
            elif isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    for name in _targets(target):
                        if name == "__slots__":
                            slots = self._slots(stmt.value)
                        else:
                            attrs.add(name)
                            methods.pop(name, None)  # a later `name = ...` replaces an earlier def
                            method_kinds.pop(name, None)
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                if stmt.target.id == "__slots__":
                    slots = self._slots(stmt.value)
                else:
                    annotations.append(stmt.target.id)
                    if stmt.value is not None:
                        annotated_defaults.append(stmt.target.id)
                        attrs.add(stmt.target.id)
        entry: dict = {"kind": "class", "bases": bases}
        if decorators:
            entry["decorators"] = decorators
        if methods:
            entry["methods"] = {name: ({"sig": sig, "kind": method_kinds[name]} if name in method_kinds else sig)
                                for name, sig in methods.items()}
        for key, values in (("properties", properties), ("attrs", attrs), ("instance_attrs", instance)):
            if values:
                entry[key] = sorted(values)
        if annotations:
            entry["annotations"] = annotations
        if slots:
            entry["slots"] = slots
        plain = {b.split(".")[-1] for b in bases}
        is_dataclass = any(d.split(".")[-1] == "dataclass" for d in decorators)
        if "NamedTuple" in plain or is_dataclass:
            entry["fields"] = annotations
            if "__init__" not in methods and "__new__" not in methods:
                params = []
                for name in annotations:
                    params.append(name + ("=" if name in annotated_defaults else ""))
                entry["synthesized_init"] = "(self" + "".join(", " + p for p in params) + ")"
        return entry

    @staticmethod
    def _slots(value: ast.AST | None) -> list[str]:
        if isinstance(value, (ast.Tuple, ast.List, ast.Set)):
            return [s for s in (_string(e) for e in value.elts) if s]
        if _string(value):
            return [_string(value)]
        return ["?"]

    def entry(self) -> dict:
        out: dict = {"names": self.names}
        if self.star_imports:
            out["star_imports"] = sorted(self.star_imports)
        if self.has_getattr:
            out["getattr"] = True
        return out

    # -- primitives ------------------------------------------------------------------------------------------

    def primitives(self, primitive_classes: set[str]) -> list[dict]:
        found: list[dict] = []
        seen: set[int] = set()

        def record(call: ast.Call, var: str | None, via: str) -> None:
            name = None
            if call.args:
                name = _string(call.args[0])
            for kw in call.keywords:
                if kw.arg == "name" and _string(kw.value):
                    name = _string(kw.value)
            if name is None and via != "class":
                name = next((s for s in (_string(a) for a in call.args) if s), None)
            if name is None:
                return
            seen.add(id(call))
            callee = (_dotted(call.func) or "?").split(".")[-1]
            found.append({"name": name, "module": self.name, "var": var, "class": callee})

        def is_primitive_class(call: ast.Call) -> bool:
            dotted = _dotted(call.func)
            if not dotted:
                return False
            return dotted.endswith("Primitive") or self.resolve_local(dotted) in primitive_classes

        # assignments first (they know the variable), then every other constructor call
        top_level = {id(s) for s in _walk_top(self.tree.body)}
        for node in self.nodes:
            value, names = None, []
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                value, names = node.value, [n for t in node.targets for n in _targets(t)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Call) and isinstance(
                    node.target, ast.Name):
                value, names = node.value, [node.target.id]
            if value is None or len(names) != 1:
                continue
            var = names[0] if id(node) in top_level else None
            if is_primitive_class(value):
                record(value, var, "class")
            elif names[0].endswith("_p") and var is not None:
                record(value, var, "helper")
        for node in self.calls:
            if id(node) not in seen and is_primitive_class(node):
                record(node, None, "class")
        return found

    def bound_with_jaxpr(self) -> list[tuple[str, str]]:
        """(variable, reason) for ``X_p.bind(..., call_jaxpr=/jaxpr=)`` and ``new_jaxpr_eqn(.., X_p, dict(jaxpr=..))``."""
        out: list[tuple[str, str]] = []
        for node in self.calls:
            dotted = _dotted(node.func) or ""
            head, _, method = dotted.rpartition(".")
            if method in ("bind", "bind_with_trace") and head:
                for kw in node.keywords:
                    if kw.arg in ("call_jaxpr", "jaxpr"):
                        out.append((head.split(".")[-1], f"{method}({kw.arg}=) in {self.name}"))
            elif dotted.split(".")[-1] == "new_jaxpr_eqn" and len(node.args) >= 4:
                prim, params = node.args[2], node.args[3]
                keys: list[str] = []
                if isinstance(params, ast.Call) and _dotted(params.func) == "dict":
                    keys = [kw.arg for kw in params.keywords if kw.arg]
                elif isinstance(params, ast.Dict):
                    keys = [s for s in (_string(k) for k in params.keys) if s]
                key = next((k for k in keys if k in ("call_jaxpr", "jaxpr")), None)
                if key and _dotted(prim):
                    out.append((_dotted(prim).split(".")[-1], f"new_jaxpr_eqn({key}=) in {self.name}"))
        return out


# --------------------------------------------------------------------------------------------------------------
# The manifest


def build(src: str) -> dict:
    files = _read_sources(src)
    version = None
    for stmt in ast.parse(files["jax/version.py"]).body:
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = [stmt.target] if isinstance(stmt, ast.AnnAssign) else stmt.targets
            if any(isinstance(t, ast.Name) and t.id == "_version" for t in targets):
                version = _string(stmt.value)
    if version is None:
        raise SystemExit("jax/version.py has no _version = '...'")
    names = {_module_name(rel): rel for rel in files}
    all_modules = set(names)
    modules: dict[str, _Module] = {}
    for module, rel in sorted(names.items()):
        if not _wanted(module):
            continue
        try:
            tree = ast.parse(files[rel], filename=rel)
        except SyntaxError as error:
            raise SystemExit(f"{rel}: {error}; run the generator with a Python that parses this JAX "
                             f"(JAX 0.11 needs Python >= 3.12)") from None
        m = _Module(module, rel.endswith("__init__.py"), tree, all_modules)
        m.collect()
        modules[module] = m

    # classes deriving (within jax) from core.Primitive, by full name
    bases = {f"{m.name}.{n}": e.get("bases", []) for m in modules.values() for n, e in m.names.items()
             if e["kind"] == "class"}
    alias = {f"{m.name}.{n}": f"{e['module']}.{e['name']}" for m in modules.values() for n, e in m.names.items()
             if e["kind"] in ("import", "alias")}

    def canonical(name: str) -> str:
        for _ in range(20):
            if name not in alias:
                break
            name = alias[name]
        return name

    def derives(name: str, root: str, depth: int = 0) -> bool:
        name = canonical(name)
        if name == root:
            return True
        return depth < 30 and any(derives(b, root, depth + 1) for b in bases.get(name, []))

    primitive_classes = {c for c in bases if derives(c, "jax._src.core.Primitive")}
    call_classes = {c for c in bases if derives(c, "jax._src.core.CallPrimitive")}
    primitive_classes |= {a for a in alias if canonical(a) in primitive_classes}

    primitives: dict[str, list[dict]] = {}
    for m in modules.values():
        for found in m.primitives(primitive_classes):
            entry = {k: v for k, v in found.items() if k != "name" and v is not None}
            primitives.setdefault(found["name"], [])
            if entry not in primitives[found["name"]]:
                primitives[found["name"]].append(entry)
    for name in primitives:
        primitives[name].sort(key=lambda e: (e["module"], e.get("var") or "", e["class"]))

    call_primitives: dict[str, set[str]] = {}
    call_class_names = {c.split(".")[-1] for c in call_classes}
    for name, entries in primitives.items():
        for entry in entries:
            if entry["class"] in call_class_names or "CallPrimitive" in entry["class"]:
                call_primitives.setdefault(name, set()).add(f"class {entry['class']}")
    by_var: dict[str, set[str]] = {}
    for name, entries in primitives.items():
        for entry in entries:
            if entry.get("var"):
                by_var.setdefault(entry["var"], set()).add(name)
    for m in modules.values():
        for var, reason in m.bound_with_jaxpr():
            for name in by_var.get(var, ()):
                call_primitives.setdefault(name, set()).add(reason)

    return {
        "format": FORMAT,
        "jax_version": version,
        "modules": {name: m.entry() for name, m in sorted(modules.items())},
        "primitives": primitives,
        "call_primitives": {name: sorted(reasons) for name, reasons in sorted(call_primitives.items())},
    }


def dumps(manifest: dict) -> str:
    """Sorted keys, one line per name (a short JSON value stays on its line), so diffs between versions read well."""
    lines: list[str] = []

    def emit(value, indent: int, prefix: str, last: bool) -> None:
        comma = "" if last else ","
        flat = json.dumps(value, sort_keys=True, separators=(", ", ": "))
        if not isinstance(value, dict) or not value or len(flat) + indent + len(prefix) <= 110 or indent >= 6:
            lines.append(" " * indent + prefix + flat + comma)
            return
        lines.append(" " * indent + prefix + "{")
        keys = sorted(value)
        for i, key in enumerate(keys):
            emit(value[key], indent + 1, json.dumps(key) + ": ", i == len(keys) - 1)
        lines.append(" " * indent + "}" + comma)

    emit(manifest, 0, "", True)
    return "\n".join(lines) + "\n"


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="site-packages folder, jax/ folder, or sdist/wheel archive")
    parser.add_argument("--out", help="output JSON (default: stdout)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    text = dumps(build(args.src))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
