"""The pass registry: names to pass classes, and parsing of pass lists.

The built-in passes live in the ``hlopass.passes`` package (its ``BUILTIN``
table), loaded here and nowhere else in the engine; users add their own
with :func:`register_pass`.
"""

from __future__ import annotations

import importlib
import os
from typing import Iterable

from hlopass import internals as jx

from hlopass.errors import ConfigError
from hlopass.pass_base import Pass

_USER_PASSES: dict[str, type] = {}
PASS_LIST_FORMS = (
    "a comma-separated list of pass names in order (e.g. 'algebraic,split'), "
    "'default' for the default pipeline, '-NAME' to drop a pass from it "
    "(e.g. '-split' or 'default,-split'), or 'none' (or empty) for no passes; "
    "as a keyword also a sequence of names and configured passes (e.g. [SplitPass(max_rounds=4)])"
)


def register_pass(cls: type) -> type:
    """Register a pass class under ``cls.name``; usable as a decorator."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls!r} needs a non-empty string attribute 'name'")
    if not (isinstance(cls, type) and issubclass(cls, Pass)):
        raise TypeError(f"{cls!r} must be a subclass of hlopass.Pass")
    _USER_PASSES[name] = cls
    return cls


def _builtin_table() -> tuple[dict[str, str], tuple[str, ...]]:
    builtin = importlib.import_module("hlopass.passes")
    _exclude_frames(builtin)
    return builtin.BUILTIN, builtin.DEFAULT_PIPELINE


def _exclude_frames(builtin) -> None:
    """The passes' frames are JAX-internal too: source lines name the user's code. Registered when
    hlopass is imported (the package itself imports no pass): JAX compiles the pattern of excluded
    paths again after each registration, 0.03-0.04 s, and registered at the first call that was inside
    the user's first call, where ``jax.jit``'s was compiled earlier, at the first trace of the program."""
    if builtin.__name__ not in _FRAMES_EXCLUDED:
        jx.register_exclusion(os.path.dirname(os.path.abspath(builtin.__file__)) + os.sep)
        _FRAMES_EXCLUDED.add(builtin.__name__)


_FRAMES_EXCLUDED: set[str] = set()
_exclude_frames(importlib.import_module("hlopass.passes"))


def import_default_passes() -> None:
    """Import the default pipeline's pass classes with hlopass: every first call needs them (its
    program is keyed by them and traced under their contexts), and their packages are light (each
    imports its machinery where it runs it, see :mod:`hlopass.pass_base`). Imported at the first
    call instead, they were 0.02 s of it (0.008 s once light): a fifth of a cached ``jax.jit`` call."""
    for name in default_pipeline():
        pass_class(name)


def builtin_folder() -> str:
    """The folder of the built-in passes' package (its frames are hlopass's, not the user's)."""
    return os.path.dirname(os.path.abspath(importlib.import_module("hlopass.passes").__file__))


def available_passes() -> list[str]:
    """Names of every pass that can be asked for, built-in first."""
    builtin, _ = _builtin_table()
    return [*builtin, *(n for n in _USER_PASSES if n not in builtin)]


def default_pipeline() -> tuple[str, ...]:
    """The passes run when nothing is configured."""
    return _builtin_table()[1]


def pass_class(name: str) -> type:
    """The pass class registered as ``name``."""
    if name in _USER_PASSES:
        return _USER_PASSES[name]
    builtin, _ = _builtin_table()
    if name not in builtin:
        raise ConfigError(f"unknown pass {name!r}; available passes: {', '.join(available_passes())}")
    module_name, class_name = builtin[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def get_pass(name: str) -> Pass:
    """An instance of the pass registered as ``name``, with default options."""
    return pass_class(name)()


def resolve_pass_names(value, setting: str = "passes") -> tuple[str, ...]:
    """Turn a pass-list setting (string or sequence of names; ``None`` = default) into names.

    Raises ``ConfigError`` naming ``setting`` for unknown names or bad forms.
    """
    return tuple(p if isinstance(p, str) else p.name for p in _resolve(value, setting, allow_instances=False))


def resolve_passes(value, setting: str = "passes") -> tuple[Pass, ...]:
    """Like :func:`resolve_pass_names`, but the passes themselves; configured passes
    (``SplitPass(max_rounds=4)``) may stand in a sequence."""
    return tuple(p if isinstance(p, Pass) else get_pass(p) for p in _resolve(value, setting, allow_instances=True))


def _resolve(value, setting: str, allow_instances: bool) -> list:
    if value is None:
        return list(default_pipeline())
    if isinstance(value, str):
        items = [item.strip() for item in value.split(",")]
        items = [item for item in items if item]
        if len(items) == 1 and items[0].lower() == "none":
            return []
    elif isinstance(value, Iterable) and not isinstance(value, (bytes, bytearray)):
        items = list(value)
        allowed = (str, Pass) if allow_instances else (str,)
        if not all(isinstance(item, allowed) for item in items):
            raise ConfigError(f"{setting}={value!r}: pass names must be strings; accepted forms: {PASS_LIST_FORMS}")
    else:
        raise ConfigError(f"{setting}={value!r} is not a pass list; accepted forms: {PASS_LIST_FORMS}")

    known = available_passes()
    result: list = list(default_pipeline()) if items and isinstance(items[0], str) and items[0].startswith("-") else []
    for item in items:
        if isinstance(item, Pass):
            result.append(item)
            continue
        if item == "default":
            result.extend(n for n in default_pipeline() if n not in result)
            continue
        name = item[1:] if item.startswith("-") else item
        if name not in known:
            raise ConfigError(
                f"{setting}={value!r}: unknown pass {name!r}; available passes: {', '.join(known)}; "
                f"accepted forms: {PASS_LIST_FORMS}")
        if item.startswith("-"):
            result = [n for n in result if (n if isinstance(n, str) else n.name) != name]
        else:
            result.append(name)
    return result
