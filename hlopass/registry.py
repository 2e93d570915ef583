"""The pass registry: names to pass classes, and parsing of pass lists.

Built-in passes live in the top-level ``passes`` package (``passes.BUILTIN``);
users add their own with :func:`register_pass`.
"""

from __future__ import annotations

import importlib
from typing import Iterable

from hlopass.errors import ConfigError

_USER_PASSES: dict[str, type] = {}
PASS_LIST_FORMS = (
    "a comma-separated list of pass names in order (e.g. 'algebraic,split'), "
    "'default' for the default pipeline, '-NAME' to drop a pass from it "
    "(e.g. '-split' or 'default,-split'), or 'none' (or empty) for no passes"
)


def register_pass(cls: type) -> type:
    """Register a pass class under ``cls.name``; usable as a decorator."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls!r} needs a non-empty string attribute 'name'")
    _USER_PASSES[name] = cls
    return cls


def _builtin_table() -> tuple[dict[str, str], tuple[str, ...]]:
    import passes
    return passes.BUILTIN, passes.DEFAULT_PIPELINE


def available_passes() -> list[str]:
    """Names of every pass that can be asked for, built-in first."""
    builtin, _ = _builtin_table()
    return [*builtin, *(n for n in _USER_PASSES if n not in builtin)]


def default_pipeline() -> tuple[str, ...]:
    """The passes run when nothing is configured."""
    return _builtin_table()[1]


def get_pass(name: str):
    """Return an instance of the pass registered as ``name``."""
    if name in _USER_PASSES:
        return _USER_PASSES[name]()
    builtin, _ = _builtin_table()
    if name not in builtin:
        raise ConfigError(f"unknown pass {name!r}; available passes: {', '.join(available_passes())}")
    module_name, class_name = builtin[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)()


def resolve_pass_names(value, setting: str = "passes") -> tuple[str, ...]:
    """Turn a pass-list setting (string or sequence of names; ``None`` = default) into names.

    Raises ``ConfigError`` naming ``setting`` for unknown names or bad forms.
    """
    if value is None:
        return default_pipeline()
    if isinstance(value, str):
        items = [item.strip() for item in value.split(",")]
        items = [item for item in items if item]
        if len(items) == 1 and items[0].lower() == "none":
            return ()
    elif isinstance(value, Iterable):
        items = list(value)
        if not all(isinstance(item, str) for item in items):
            raise ConfigError(f"{setting}={value!r}: pass names must be strings; accepted forms: {PASS_LIST_FORMS}")
    else:
        raise ConfigError(f"{setting}={value!r} is not a pass list; accepted forms: {PASS_LIST_FORMS}")

    known = available_passes()
    result: list[str] = list(default_pipeline()) if items and items[0].startswith("-") else []
    for item in items:
        if item == "default":
            result.extend(n for n in default_pipeline() if n not in result)
            continue
        name = item[1:] if item.startswith("-") else item
        if name not in known:
            raise ConfigError(
                f"{setting}={value!r}: unknown pass {name!r}; available passes: {', '.join(known)}; "
                f"accepted forms: {PASS_LIST_FORMS}")
        if item.startswith("-"):
            result = [n for n in result if n != name]
        else:
            result.append(name)
    return tuple(result)
