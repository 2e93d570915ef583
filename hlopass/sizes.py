"""Byte sizes: parsing human spellings ("1.5GB", "512 MiB") and printing them."""

from __future__ import annotations

import re

from hlopass.errors import ConfigError

UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
OFF_SPELLINGS = ("off", "none", "inf", "never")
ACCEPTED_FORMS = (
    "bare bytes (e.g. 1000000), decimal units kB/MB/GB/TB (powers of 1000) or "
    "binary units KiB/MiB/GiB/TiB (powers of 1024), case-insensitive, optional "
    "space and decimals (e.g. '1.5GB', '512 MiB')"
)
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(value, setting: str, *, allow_off: bool = False) -> int | None:
    """Parse ``value`` into a number of bytes.

    ``value`` may be an int, a float or a string in one of ``ACCEPTED_FORMS``.
    With ``allow_off``, the spellings in ``OFF_SPELLINGS`` (and ``None``) give
    ``None``, meaning "no limit". ``setting`` names the variable or argument in
    the error message.
    """
    accepted = ACCEPTED_FORMS + (f", or one of {', '.join(OFF_SPELLINGS)} to turn it off" if allow_off else "")
    if value is None:
        if allow_off:
            return None
        raise ConfigError(f"{setting}: a size is required; accepted forms: {accepted}")
    if isinstance(value, bool):
        raise ConfigError(f"{setting}={value!r} is not a size; accepted forms: {accepted}")
    if isinstance(value, (int, float)):
        if value != value or value in (float("inf"),):
            if allow_off and value == float("inf"):
                return None
            raise ConfigError(f"{setting}={value!r} is not a size; accepted forms: {accepted}")
        if value < 0:
            raise ConfigError(f"{setting}={value!r}: a size must not be negative; accepted forms: {accepted}")
        return int(value)
    if not isinstance(value, str):
        raise ConfigError(f"{setting}={value!r} is not a size; accepted forms: {accepted}")
    text = value.strip()
    if allow_off and text.lower() in OFF_SPELLINGS:
        return None
    if text.startswith("-"):
        raise ConfigError(f"{setting}={value!r}: a size must not be negative; accepted forms: {accepted}")
    match = _SIZE_RE.match(text)
    if not match or match.group(2).lower() not in UNITS:
        raise ConfigError(f"{setting}={value!r} is not a size; accepted forms: {accepted}")
    number, unit = match.groups()
    return int(float(number) * UNITS[unit.lower()])


def format_size(nbytes: int | float | None) -> str:
    """Format a byte count for people: ``format_size(1.5e9) == '1.50 GB'``."""
    if nbytes is None:
        return "off"
    nbytes = float(nbytes)
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"
