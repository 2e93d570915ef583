"""Built-in hlopass passes, one module each.

``BUILTIN`` maps a pass name to ``"module:Class"``; ``DEFAULT_PIPELINE`` is the
order they run in when the user configures nothing.
"""

BUILTIN: dict[str, str] = {
    "hvp": "passes.hvp:HvpPass",
    "algebraic": "passes.algebraic:AlgebraicPass",
    "split": "passes.split:SplitPass",
    "matrix_chain": "passes.matrix_chain:MatrixChainPass",
}

#: Rewrites that change the maths come first (they remove large tensors
#: outright), reordering next, splitting last (it handles what remains).
_ORDER = ("hvp", "algebraic", "matrix_chain", "split")
DEFAULT_PIPELINE: tuple[str, ...] = tuple(name for name in _ORDER if name in BUILTIN) + tuple(
    name for name in BUILTIN if name not in _ORDER)
