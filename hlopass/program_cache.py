"""The pipeline's decisions kept across processes, next to JAX's persistent compilation cache.

With JAX's persistent compilation cache on (``jax_compilation_cache_dir``, or the
``JAX_COMPILATION_CACHE_DIR`` variable), a program for which the passes changed nothing, or for
which XLA's figures kept the program as written (:func:`hlopass.never_worse.decide`), is
remembered under ``<cache dir>/hlopass/<key>.json``: the decision and the report. The key is a
digest of the program (its printed jaxpr and the user's source lines), the settings, the notes the
passes made while tracing, how the inputs are sharded, and the versions of hlopass (with its source
files' sizes and times), JAX and jaxlib and the backend. A second process that traces the same
program finds the entry, skips the passes (and the never-worse comparison), and lowers the program
as written: the same module as the first process's, which XLA's cache then serves.

A program the passes rewrote is stored too (once the never-worse comparison keeps it, where it
needs one): the rewritten program exported with ``jax.export`` (``<key>.exported``, beside the entry),
when it can be (one device, no sharded inputs or manual axes, no effects, and the ``flatbuffers``
package that ``jax.export`` serialises with, in the ``cache`` extra). Both processes then lower the
exported program (:func:`export_rewritten` hands the first process the same form it stores): the
second skips the passes and lowers the same module, which XLA's cache serves (for a module naming none
of LAPACK's kernels, without the LAPACK set-up JAX's lowering of an exported call makes: :func:`lowering`).
Without an export the
second process runs the passes again. Writing or reading an entry never breaks a call: a failure is
logged at debug level and the passes run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import sys
import tempfile
import threading
import weakref
from typing import Any, Iterator

import jax
from hlopass import internals as jx

from hlopass.jaxpr_utils import UnnamedProgram, iter_eqns, program_text
from hlopass.patches import Patches
from hlopass.report import Comparison, PassReport, PipelineReport, Rewrite, Skip, source_line

logger = logging.getLogger("hlopass")

#: The folder under JAX's cache folder that holds hlopass's entries.
FOLDER = "hlopass"
#: Bumped when the entries' format changes.
FORMAT = 1


def cache_dir() -> str | None:
    """``<jax_compilation_cache_dir>/hlopass`` when JAX's persistent cache is on, else ``None``."""
    base = jax.config.jax_compilation_cache_dir
    if not base or not jax.config.jax_enable_compilation_cache:
        return None
    return os.path.join(os.fspath(base), FOLDER)


@functools.lru_cache(maxsize=None)
def _code_stamp(folder: str) -> str:
    """A digest of the ``.py`` files under ``folder``: names, sizes and modification times (a
    change of hlopass's or a pass's code is a change of key, versions or not)."""
    stamp = hashlib.sha256()
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                info = os.stat(path)
                stamp.update(f"{os.path.relpath(path, folder)}:{info.st_size}:{info.st_mtime_ns}\n".encode())
    return stamp.hexdigest()


def _module_stamp(module_name: str) -> str:
    """The code a module stands for: a package's folder (:func:`_code_stamp`), a module's file."""
    path = getattr(sys.modules.get(module_name), "__file__", None)
    if not path:
        return ""
    path = os.path.realpath(path)
    if os.path.basename(path) == "__init__.py":
        return _code_stamp(os.path.dirname(path))
    info = os.stat(path)
    return f"{path}:{info.st_size}:{info.st_mtime_ns}"


@functools.lru_cache(maxsize=None)
def _versions() -> str:
    """hlopass's version and code, JAX's and jaxlib's versions, the backend's platform."""
    version = getattr(sys.modules.get("hlopass"), "__version__", "?")
    try:
        jaxlib = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        jaxlib = "?"
    return (f"hlopass {version} {_module_stamp('hlopass')}; jax {jax.__version__}; "
            f"jaxlib {jaxlib}; {jax.default_backend()} {jax.devices()[0].device_kind}")


def _pass_identity(pass_) -> str:
    """A pass's class (module and name), its options and its code (a built-in pass's whole package)."""
    module = type(pass_).__module__
    parts = module.split(".")
    package = ".".join(parts[:3]) if parts[:2] == ["hlopass", "passes"] else module
    return f"{module}.{type(pass_).__qualname__}({pass_.options!r}) {_module_stamp(package)}"


def key(closed: jx.ClosedJaxpr, config, notes: tuple, shards) -> str | None:
    """The entry's name for ``closed`` with these settings, notes and input shards; ``None`` when
    the persistent cache is off or the program cannot be named (a constant that is not an array)."""
    if cache_dir() is None:
        return None
    try:
        program = program_text(closed)
    except UnnamedProgram:
        return None
    digest = hashlib.sha256()
    settings = dataclasses.replace(config, passes=())
    for part in (_versions(), repr(settings), *map(_pass_identity, config.passes), repr(tuple(notes)),
                 repr(shards), program):
        digest.update(part.encode())
        digest.update(b"\0")
    digest.update("\n".join(source_line(eqn) for eqn in iter_eqns(closed)).encode())
    return digest.hexdigest()


@dataclasses.dataclass
class Entry:
    """What :func:`load` found: the report, and for a rewritten program the program to lower (the
    exported one, as a jaxpr of one call), else ``None``: the program goes to XLA as written."""

    report: PipelineReport
    program: jx.ClosedJaxpr | None = None


def load(name: str | None, in_avals=()) -> Entry | None:
    """The entry stored under ``name`` (its report's passes marked as not run here), or ``None``.
    ``in_avals``: the program's inputs, at which an exported program is called."""
    folder = cache_dir()
    if name is None or folder is None:
        return None
    path = os.path.join(folder, f"{name}.json")
    try:
        with open(path, encoding="utf-8") as f:
            entry = json.load(f)
        if entry.get("format") != FORMAT or entry.get("program") not in ("as_written", "rewritten"):
            return None
        program = None
        if entry["program"] == "rewritten":
            with open(os.path.join(folder, f"{name}.exported"), "rb") as f:
                program = _callable_jaxpr(f.read(), in_avals)
        return Entry(_report_from_dict(entry["report"]), program)
    except FileNotFoundError:
        return None
    except Exception as err:  # noqa: BLE001 - a damaged entry: run the passes
        logger.debug("hlopass: could not read %s: %s: %s", path, type(err).__name__, err)
        return None


def store(name: str | None, report: PipelineReport) -> None:
    """Remember under ``name`` that the program goes to XLA as written, with ``report``."""
    _write(name, {"format": FORMAT, "program": "as_written", "report": report.to_dict()})


def export_rewritten(name: str | None, rewritten: jx.ClosedJaxpr, sharded: bool) -> tuple[jx.ClosedJaxpr, bytes] | None:
    """``rewritten`` exported: ``(the program calling it, its serialised bytes)`` for :func:`write_rewritten`
    (the program is what the first process lowers in its place, as :func:`load` gives it to a later one);
    ``None`` when it cannot be exported (``sharded``: its inputs are sharded or it lies in a
    ``shard_map``) or the cache is off."""
    if name is None or cache_dir() is None or sharded or jax.device_count() != 1 or rewritten.effects:
        return None
    try:
        from jax import export
        exported = export.export(jax.jit(jx.jaxpr_as_fun(rewritten)))(*rewritten.in_avals)
        blob = exported.serialize()
        program = _callable_jaxpr(blob, rewritten.in_avals)
    except Exception as err:  # noqa: BLE001 - not exportable (or no flatbuffers): not stored
        logger.debug("hlopass: the rewritten program is not stored (%s: %s)", type(err).__name__, err)
        return None
    return program, bytes(blob)


def write_rewritten(name: str, report: PipelineReport, blob: bytes) -> bool:
    """Write the entry of a rewritten program exported as ``blob`` (:func:`export_rewritten`); whether it was."""
    return _write(name, {"format": FORMAT, "program": "rewritten", "report": report.to_dict()}, {".exported": blob})


def _callable_jaxpr(blob: bytes, in_avals) -> jx.ClosedJaxpr:
    """The jaxpr calling the exported program serialised in ``blob``, at ``in_avals`` (marked
    :func:`lapack_free` when no LAPACK kernel's name appears in it)."""
    from jax import export
    exported = export.deserialize(bytearray(blob))
    program = jax.make_jaxpr(exported.call)(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in in_avals])
    if not any(name in blob for name in jx.lapack_kernel_names()):
        _LAPACK_FREE.add(program)
    return program


#: Stored programs calling no LAPACK kernel (a kernel's name, ``lapack_spotrf_ffi``, is written in
#: the serialised module whenever the program calls it; :func:`hlopass.internals.lapack_kernel_names`).
_LAPACK_FREE: weakref.WeakSet = weakref.WeakSet()
_skipping = threading.local()


def lapack_free(program: jx.ClosedJaxpr) -> bool:
    """Whether ``program`` is a stored program calling no LAPACK kernel (see :func:`lowering`)."""
    return program in _LAPACK_FREE


def _ensure_backends(module, name: str, current):
    def ensure_backends_initialized(platforms):
        if not getattr(_skipping, "depth", 0):
            current(platforms)
    return ensure_backends_initialized


_BACKENDS = Patches(lambda: [(jx.export_backends, "_ensure_backends_initialized")], _ensure_backends)


@contextlib.contextmanager
def lowering(program: jx.ClosedJaxpr) -> Iterator[None]:
    """Around the lowering of ``program``: for a stored program calling no LAPACK kernel, JAX's lowering
    of the exported call does not load LAPACK's kernels (importing scipy, 0.06 s of a second process's
    first call on CPU, for a program that never calls them). Only this thread's lowering skips it."""
    if jx.export_backends is None or not lapack_free(program):
        yield
        return
    with _BACKENDS.active():
        _skipping.depth = getattr(_skipping, "depth", 0) + 1
        try:
            yield
        finally:
            _skipping.depth -= 1


def _write(name: str | None, entry: dict, beside: dict | None = None) -> bool:
    """Write ``entry`` as ``<name>.json`` (and each ``beside`` suffix's bytes as ``<name><suffix>``,
    first); whether it was written."""
    folder = cache_dir()
    if name is None or folder is None:
        return False
    try:
        os.makedirs(folder, exist_ok=True)
        for suffix, data in (beside or {}).items():
            handle, temporary = tempfile.mkstemp(dir=folder, suffix=".tmp")
            with os.fdopen(handle, "wb") as f:
                f.write(data)
            os.replace(temporary, os.path.join(folder, f"{name}{suffix}"))
        handle, temporary = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(handle, "w", encoding="utf-8") as f:
            json.dump(entry, f, default=_jsonable)
        os.replace(temporary, os.path.join(folder, f"{name}.json"))  # atomic: readers see all or nothing
        return True
    except Exception as err:  # noqa: BLE001 - the cache must never break a call
        logger.debug("hlopass: could not write to %s: %s: %s", folder, type(err).__name__, err)
        return False


def _jsonable(value: Any):
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)


def _report_from_dict(data: dict) -> PipelineReport:
    passes = []
    for p in data["passes"]:
        passes.append(PassReport(
            p["name"], [Rewrite(**r) for r in p["rewrites"]], [Skip(**s) for s in p["skipped"]],
            seconds=0.0, ran=False))
    comparison = Comparison(**data["comparison"]) if data.get("comparison") else None
    return PipelineReport(
        label=data["label"], config_line=data["config"], passes=passes,
        equations_before=data["equations_before"], equations_after=data["equations_after"],
        largest_before=[tuple(row) for row in data["largest_before"]],
        largest_after=[tuple(row) for row in data["largest_after"]], comparison=comparison, from_cache=True)
