"""Settings: keywords checked when ``hlopass.jit`` is applied; the environment read and checked when
a function is called (traced), keywords overriding it.

| setting | environment variable | keyword |
|---|---|---|
| size above which a tensor is a split candidate | ``HLOPASS_TENSOR_SIZE_THRESHOLD`` | ``threshold=`` |
| largest chunk a split may produce | ``HLOPASS_TENSOR_SPLIT_SIZE`` | ``split_size=`` |
| what the compiled program is checked against | ``HLOPASS_MEMORY_LIMIT`` | ``memory_limit=`` |
| passes to run, in order | ``HLOPASS_PASSES`` | ``passes=`` |
| folder to dump every compiled function to | ``HLOPASS_DUMP_TO`` | ``dump_to=`` |
| raise instead of warn when over the limit | ``HLOPASS_STRICT`` | ``strict=`` |
| smallest multiply-add ratio for which products are reordered | ``HLOPASS_MIN_GAIN`` | ``min_gain=`` |
| keep the original program when the rewritten one is not better | ``HLOPASS_NEVER_WORSE`` | ``never_worse=`` |

Every bad value is a :class:`~hlopass.ConfigError` naming the setting, the value and the accepted
forms. An ``HLOPASS_*`` environment variable that hlopass does not know (a misspelling) is warned
about once (:class:`~hlopass.errors.ConfigWarning`), naming the known ones.
"""

from __future__ import annotations

import difflib
import os
import warnings
from typing import Mapping

from hlopass.config import DEFAULT_MIN_GAIN, Config, default_threshold, device_memory_bytes
from hlopass.errors import ConfigError, ConfigWarning
from hlopass.pipeline import ENV_CHECK, ENV_RAISE
from hlopass.registry import resolve_passes
from hlopass.sizes import ACCEPTED_FORMS, OFF_SPELLINGS, parse_size

ENV_THRESHOLD = "HLOPASS_TENSOR_SIZE_THRESHOLD"
ENV_SPLIT_SIZE = "HLOPASS_TENSOR_SPLIT_SIZE"
ENV_MEMORY_LIMIT = "HLOPASS_MEMORY_LIMIT"
ENV_PASSES = "HLOPASS_PASSES"
ENV_DUMP_TO = "HLOPASS_DUMP_TO"
ENV_STRICT = "HLOPASS_STRICT"
ENV_MIN_GAIN = "HLOPASS_MIN_GAIN"
ENV_NEVER_WORSE = "HLOPASS_NEVER_WORSE"
#: Picture format of the ``HLOPASS_DUMP_TO`` dumps (read by :mod:`hlopass.inspection.dump`).
ENV_DUMP_FORMAT = "HLOPASS_DUMP_FORMAT"
DUMP_FORMATS = ("text", "svg", "png")

#: keyword -> environment variable, for every setting
SETTINGS = {"threshold": ENV_THRESHOLD, "split_size": ENV_SPLIT_SIZE, "memory_limit": ENV_MEMORY_LIMIT,
            "passes": ENV_PASSES, "dump_to": ENV_DUMP_TO, "strict": ENV_STRICT, "min_gain": ENV_MIN_GAIN,
            "never_worse": ENV_NEVER_WORSE}
#: Environment variables hlopass reads besides the settings.
OTHER_VARIABLES = (ENV_DUMP_FORMAT, ENV_RAISE, ENV_CHECK)

MIN_GAIN_FORMS = ("a number at least 1: the factor by which a reordering must cut multiply-adds "
                  "(e.g. 1.25; 1 reorders for any gain)")
POSITIVE_SIZE_FORMS = (f"a size of at least 1 byte: {ACCEPTED_FORMS}, or one of {', '.join(OFF_SPELLINGS)} "
                       "to turn it off")
DUMP_TO_FORMS = "a folder path (a str or os.PathLike; created when missing), or empty for no dumps"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")
_UNSET = object()
_warned_variables: set[str] = set()


def check_keywords(overrides: Mapping[str, object]) -> None:
    """Check keyword settings on their own (the environment is not read): what ``hlopass.jit``
    does when it is applied. Raises ``ConfigError`` naming the keyword."""
    unknown = set(overrides) - set(SETTINGS)
    if unknown:
        raise ConfigError(f"unknown hlopass setting(s) {sorted(unknown)}; accepted: {', '.join(SETTINGS)}")
    sizes = {}
    for key in ("threshold", "split_size", "memory_limit"):
        if key in overrides:
            sizes[key] = _parse_positive_size(overrides[key], key)
    if sizes.get("split_size") is not None and "threshold" in sizes:
        _check_split(sizes["threshold"], sizes["split_size"], overrides["split_size"], "split_size")
    if "passes" in overrides:
        resolve_passes(overrides["passes"], "passes")
    if "dump_to" in overrides:
        check_folder(overrides["dump_to"], "dump_to")
    if "strict" in overrides:
        _parse_bool(overrides["strict"], "strict")
    if "min_gain" in overrides:
        _parse_gain(overrides["min_gain"], "min_gain")
    if "never_worse" in overrides:
        _parse_bool(overrides["never_worse"], "never_worse")


def resolve(overrides: Mapping[str, object] | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """Build the ``Config`` for one function: keyword ``overrides`` win over the environment.

    Keys of ``overrides``: ``threshold``, ``split_size``, ``memory_limit``, ``passes``,
    ``dump_to``, ``strict``, ``min_gain``, ``never_worse``. Raises ``ConfigError`` naming the setting for any bad
    value; warns once about unknown ``HLOPASS_*`` variables of the process environment.
    """
    overrides = dict(overrides or {})
    if environ is None:
        environ = os.environ
        warn_unknown_variables(environ)
    unknown = set(overrides) - set(SETTINGS)
    if unknown:
        raise ConfigError(f"unknown hlopass setting(s) {sorted(unknown)}; accepted: {', '.join(SETTINGS)}")

    def pick(key):
        if key in overrides:
            return overrides[key], key
        env_name = SETTINGS[key]
        if env_name in environ:
            return environ[env_name], env_name
        return _UNSET, env_name

    raw, name = pick("memory_limit")
    memory_limit = device_memory_bytes() if raw is _UNSET else _parse_positive_size(raw, name)

    raw, name = pick("threshold")
    threshold = default_threshold(memory_limit) if raw is _UNSET else _parse_positive_size(raw, name)

    raw, split_name = pick("split_size")
    if raw is _UNSET:
        split_size = threshold
    else:
        split_size = _parse_positive_size(raw, split_name)
        if split_size is not None and threshold is None:
            raise ConfigError(f"{split_name}={raw!r} is set but the threshold is off; set {ENV_THRESHOLD} "
                              f"(or threshold=) too; accepted forms: {POSITIVE_SIZE_FORMS}, at most the threshold")
        if split_size is None:
            split_size = threshold
        _check_split(threshold, split_size, raw, split_name)

    raw, name = pick("passes")
    passes = resolve_passes(None if raw is _UNSET else raw, name)

    raw, name = pick("dump_to")
    dump_to = None if raw is _UNSET else check_folder(raw, name)

    raw, name = pick("strict")
    strict = False if raw is _UNSET else _parse_bool(raw, name)

    raw, name = pick("min_gain")
    min_gain = DEFAULT_MIN_GAIN if raw is _UNSET else _parse_gain(raw, name)

    raw, name = pick("never_worse")
    never_worse = True if raw is _UNSET else _parse_bool(raw, name)

    if ENV_DUMP_FORMAT in environ and environ[ENV_DUMP_FORMAT].strip().lower() not in DUMP_FORMATS:
        raise ConfigError(f"{ENV_DUMP_FORMAT}={environ[ENV_DUMP_FORMAT]!r} is not a picture format; "
                          f"accepted forms: {', '.join(DUMP_FORMATS)}")

    return Config(threshold=threshold, split_size=split_size, memory_limit=memory_limit,
                  passes=passes, dump_to=dump_to, strict=strict, min_gain=min_gain, never_worse=never_worse)


def warn_unknown_variables(environ: Mapping[str, str]) -> None:
    """Warn once per name about ``HLOPASS_*`` variables that are neither settings nor known variables."""
    known = (*SETTINGS.values(), *OTHER_VARIABLES)
    for name in environ:
        if name.startswith("HLOPASS_") and name not in known and name not in _warned_variables:
            _warned_variables.add(name)
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            warnings.warn(f"{name} is not a hlopass variable and is ignored{hint}; known variables: "
                          f"{', '.join(known)}", ConfigWarning, stacklevel=2)


def _parse_positive_size(value, setting: str) -> int | None:
    nbytes = parse_size(value, setting, allow_off=True)
    if nbytes == 0:
        raise ConfigError(f"{setting}={value!r} is zero bytes; accepted forms: {POSITIVE_SIZE_FORMS}")
    return nbytes


def _check_split(threshold, split_size, raw, setting: str) -> None:
    if split_size is not None and threshold is not None and split_size > threshold:
        raise ConfigError(f"{setting}={raw!r} is larger than the threshold ({threshold} bytes); "
                          f"accepted forms: {POSITIVE_SIZE_FORMS}, at most the threshold")


def _parse_bool(value, setting: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower() if isinstance(value, (str, int)) else None
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"{setting}={value!r} is not a boolean; accepted forms: True, False, "
                      f"{', '.join(_TRUE)} or {', '.join(repr(f) for f in _FALSE)}")


def check_folder(value, setting: str) -> str | None:
    """``value`` as a usable folder path (``None`` for empty): an existing folder, or a path that can
    be created under one. Raises ``ConfigError`` naming ``setting`` otherwise."""
    if value is None or value == "":
        return None
    if isinstance(value, bytes) or not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"{setting}={value!r} is not a folder path; accepted forms: {DUMP_TO_FORMS}")
    path = os.fspath(value)
    if not isinstance(path, str):
        raise ConfigError(f"{setting}={value!r} is not a folder path; accepted forms: {DUMP_TO_FORMS}")
    absolute = os.path.abspath(path)
    if os.path.exists(absolute):
        if not os.path.isdir(absolute):
            raise ConfigError(f"{setting}={value!r} is an existing file, not a folder; accepted forms: {DUMP_TO_FORMS}")
        existing = absolute
    else:
        existing = os.path.dirname(absolute)
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            raise ConfigError(f"{setting}={value!r} cannot be created: {existing} is a file; "
                              f"accepted forms: {DUMP_TO_FORMS}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{setting}={value!r} cannot be written: {existing} is not writable; "
                          f"accepted forms: {DUMP_TO_FORMS}")
    return path


def _parse_gain(value, setting: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{setting}={value!r} is not a gain; accepted forms: {MIN_GAIN_FORMS}")
    try:
        gain = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise ConfigError(f"{setting}={value!r} is not a gain; accepted forms: {MIN_GAIN_FORMS}") from None
    if not gain >= 1.0 or gain == float("inf"):
        raise ConfigError(f"{setting}={value!r} is not a gain; accepted forms: {MIN_GAIN_FORMS}")
    return gain
