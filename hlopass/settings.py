"""Settings: read from the environment at trace time, overridden per function.

| setting | environment variable | keyword |
|---|---|---|
| size above which a tensor is a split candidate | ``HLOPASS_TENSOR_SIZE_THRESHOLD`` | ``threshold=`` |
| largest chunk a split may produce | ``HLOPASS_TENSOR_SPLIT_SIZE`` | ``split_size=`` |
| what the compiled program is checked against | ``HLOPASS_MEMORY_LIMIT`` | ``memory_limit=`` |
| passes to run, in order | ``HLOPASS_PASSES`` | ``passes=`` |
| folder to dump every compiled function to | ``HLOPASS_DUMP_TO`` | ``dump_to=`` |
| raise instead of warn when over the limit | ``HLOPASS_STRICT`` | ``strict=`` |
| smallest multiply-add ratio for which products are reordered | ``HLOPASS_MIN_GAIN`` | ``min_gain=`` |
"""

from __future__ import annotations

import os
from typing import Mapping

from hlopass.config import DEFAULT_MIN_GAIN, Config, default_threshold, device_memory_bytes
from hlopass.errors import ConfigError
from hlopass.registry import resolve_passes
from hlopass.sizes import parse_size

ENV_THRESHOLD = "HLOPASS_TENSOR_SIZE_THRESHOLD"
ENV_SPLIT_SIZE = "HLOPASS_TENSOR_SPLIT_SIZE"
ENV_MEMORY_LIMIT = "HLOPASS_MEMORY_LIMIT"
ENV_PASSES = "HLOPASS_PASSES"
ENV_DUMP_TO = "HLOPASS_DUMP_TO"
ENV_STRICT = "HLOPASS_STRICT"
ENV_MIN_GAIN = "HLOPASS_MIN_GAIN"

#: keyword -> environment variable, for every setting
SETTINGS = {"threshold": ENV_THRESHOLD, "split_size": ENV_SPLIT_SIZE, "memory_limit": ENV_MEMORY_LIMIT,
            "passes": ENV_PASSES, "dump_to": ENV_DUMP_TO, "strict": ENV_STRICT, "min_gain": ENV_MIN_GAIN}
MIN_GAIN_FORMS = ("a number at least 1: the factor by which a reordering must cut multiply-adds "
                  "(e.g. 1.25; 1 reorders for any gain)")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")
_UNSET = object()


def _parse_bool(value, setting: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"{setting}={value!r} is not a boolean; accepted forms: {', '.join(_TRUE)} or {', '.join(repr(f) for f in _FALSE)}")


def resolve(overrides: Mapping[str, object] | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """Build the ``Config`` for one function: keyword ``overrides`` win over the environment.

    Keys of ``overrides``: ``threshold``, ``split_size``, ``memory_limit``, ``passes``,
    ``dump_to``, ``strict``. Raises ``ConfigError`` naming the setting for any bad value.
    """
    overrides = dict(overrides or {})
    environ = os.environ if environ is None else environ
    unknown = set(overrides) - set(SETTINGS)
    if unknown:
        raise ConfigError(f"unknown hlopass setting(s) {sorted(unknown)}; accepted: {', '.join(SETTINGS)}")

    def pick(key, env_name):
        if key in overrides:
            return overrides[key], f"{key}="
        if env_name in environ:
            return environ[env_name], env_name
        return _UNSET, env_name

    raw, name = pick("memory_limit", ENV_MEMORY_LIMIT)
    memory_limit = device_memory_bytes() if raw is _UNSET else parse_size(raw, name, allow_off=True)

    raw, name = pick("threshold", ENV_THRESHOLD)
    threshold = default_threshold(memory_limit) if raw is _UNSET else parse_size(raw, name, allow_off=True)

    raw, split_name = pick("split_size", ENV_SPLIT_SIZE)
    split_size = threshold if raw is _UNSET else parse_size(raw, split_name, allow_off=True)
    if split_size is not None and threshold is None and raw is not _UNSET:
        raise ConfigError(f"{split_name}={raw!r} is set but the threshold is off; set {ENV_THRESHOLD} (or threshold=) too")
    if split_size is None and threshold is not None:
        split_size = threshold
    if split_size is not None and threshold is not None and split_size > threshold:
        raise ConfigError(
            f"{split_name}={raw!r} is larger than the threshold ({threshold} bytes); "
            "the split size must be at most the threshold")
    if split_size == 0:
        raise ConfigError(f"{split_name}={raw!r}: the split size must be positive")

    raw, name = pick("passes", ENV_PASSES)
    passes = resolve_passes(None if raw is _UNSET else raw, name)

    raw, _ = pick("dump_to", ENV_DUMP_TO)
    dump_to = None if raw is _UNSET or raw in ("", None) else os.fspath(raw)

    raw, name = pick("strict", ENV_STRICT)
    strict = False if raw is _UNSET else _parse_bool(raw, name)

    raw, name = pick("min_gain", ENV_MIN_GAIN)
    min_gain = DEFAULT_MIN_GAIN if raw is _UNSET else _parse_gain(raw, name)

    return Config(threshold=threshold, split_size=split_size, memory_limit=memory_limit,
                  passes=passes, dump_to=dump_to, strict=strict, min_gain=min_gain)


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
