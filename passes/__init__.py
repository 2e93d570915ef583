"""The built-in hlopass passes, one package each (installed as ``hlopass.passes``).

``BUILTIN`` maps a pass name to ``"module:Class"``; ``DEFAULT_PIPELINE`` is
the order they run in when the user configures nothing. A new pass is one new
folder here and one line in ``BUILTIN``.
"""

BUILTIN: dict[str, str] = {
    "hvp": "hlopass.passes.hvp:HvpPass",
    "adjoint": "hlopass.passes.adjoint:AdjointPass",
    "algebraic": "hlopass.passes.algebraic:AlgebraicPass",
    "matrix_chain": "hlopass.passes.matrix_chain:MatrixChainPass",
    "split": "hlopass.passes.split:SplitPass",
    "remat": "hlopass.passes.remat:RematPass",
}

#: Rewrites that change the maths come first (the adjoint method for linear recurrences right after
#: forward-over-reverse Hessian products: both change how a gradient is taken) (they remove large tensors
#: outright), reordering next, splitting next (it handles what remains of
#: large tensors), rematerialisation last (it trades the time of recomputing
#: forward values for the memory of keeping them, only when the program is
#: still over the memory limit).
DEFAULT_PIPELINE: tuple[str, ...] = ("hvp", "adjoint", "algebraic", "matrix_chain", "split", "remat")
