"""Built-in hlopass passes, one module each.

``BUILTIN`` maps a pass name to ``"module:Class"``; ``DEFAULT_PIPELINE`` is the
order they run in when the user configures nothing.
"""

BUILTIN: dict[str, str] = {
}

DEFAULT_PIPELINE: tuple[str, ...] = tuple(BUILTIN)
