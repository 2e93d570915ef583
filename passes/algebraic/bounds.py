"""Which roots an expansion could improve, bounded from the avals in one walk over a level.

:func:`~.match.find_candidate` keeps a root only where its expansion looks
through a value larger than everything it reads and writes (``removed >
kept``), or through a product that is only partly used (a ``dot_general``
at least as large as that). Expanding a root walks its whole polynomial cone,
about a millisecond each on a Transformer block's gradient, where 77 roots
passed the cheaper filters and none was rewritten.

:class:`RemovalBounds` answers "could it?" for every root of a level from one
walk in program order. ``least[v]`` bounds from below the largest leaf under
a value ``v`` wherever the expansion stops (``v`` itself, or the bounds of
the operands of an equation it may look through). A value ``u`` the expansion
looks through lies on a chain of looked-through equations from the root, each
of which reads all its operands: what the root keeps is at least the bound
under every equation of the chain. So each value keeps the pairs ``(bytes of
u, bound along the chain down to u)`` that may still beat it (those where the
first is larger), without the pairs another pair dominates: ``grows`` for any
``u``, ``products`` for a ``dot_general`` (at least as large), ``chained`` for
one reached through the primitives of a plain chain of products only (a sum
of a product), and ``masks``, whether an identity mask is anywhere below (a
trace or diagonal of a product).

A root is left out only where no pair beats what it keeps (its result and the
bound under its operands). An equation with a sub-program (a call, a platform
``cond``) is not bounded: roots reading it are always expanded. The bounds
never exceed what an expansion sees, so no root that
:func:`~.match.find_candidate` would keep, or report, is left out.
"""

from __future__ import annotations

from hlopass import internals as jx

from hlopass.families import CHAIN
from hlopass.jaxpr_utils import aval_nbytes

from .expansion import EXPANSION_RULES

#: Looked-through primitives whose operands the expansion never looks through (it reads the iotas of
#: ``iota == iota`` by pattern); ``integer_pow`` with exponent 0 is a constant too.
_READS_NOTHING = frozenset({"eq"})
#: One that may read none of its operands (``pow`` with exponent 0): nothing bounds what is under it.
_MAY_READ_NOTHING = frozenset({"pow"})
#: Primitives whose expansion enters a sub-program: the walk does not bound them.
_OPAQUE = frozenset(name for name in EXPANSION_RULES if name not in {
    "convert_element_type", "copy", "broadcast_in_dim", "transpose", "reshape", "squeeze", "add", "add_any",
    "sub", "neg", "mul", "div", "integer_pow", "square", "pow", "reduce_sum", "dot_general", "eq", "select_n"})
#: What a sum of a matrix product may look through (:data:`.match.CHAIN_PRIMITIVES`).
_CHAIN = CHAIN - {"mul", "broadcast_in_dim"}


class RemovalBounds:
    """What expanding each root of ``jaxpr`` could remove, bounded (see the module docstring)."""

    def __init__(self, jaxpr: jx.Jaxpr):
        self.least: dict = {}
        self.grows: dict = {}
        self.products: dict = {}
        self.chained: dict = {}
        self.masks: dict = {}
        self.opaque: set = set()
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name not in EXPANSION_RULES:
                continue  # its results are leaves: bounded by their own size, removing nothing below
            operands = [a for a in eqn.invars if isinstance(a, jx.Var)]
            if name in _OPAQUE or any(a in self.opaque for a in operands):
                self.opaque.update(eqn.outvars)
                continue
            reads_none = name in _READS_NOTHING or (name == "integer_pow" and eqn.params["y"] == 0)
            below = [] if reads_none else operands
            under = 0 if name in _MAY_READ_NOTHING else max((self._least(a) for a in below), default=0)
            masks = name == "eq" or any(self.masks.get(a, False) for a in below)
            for var in eqn.outvars:
                size = aval_nbytes(var.aval)
                own = [(size, under)]
                dot = own if name == "dot_general" else []
                self.least[var] = min(size, under)
                self.grows[var] = _frontier(self.grows, below, under, own, strict=True)
                self.products[var] = _frontier(self.products, below, under, dot, strict=False)
                self.chained[var] = _frontier(self.chained, below if name in _CHAIN else [], under, dot, strict=False)
                self.masks[var] = masks

    def _least(self, atom) -> int:
        found = self.least.get(atom)
        return aval_nbytes(atom.aval) if found is None else found

    def may_remove(self, eqn) -> bool:
        """Whether expanding root ``eqn`` (a ``reduce_sum``, ``dot_general`` or platform ``cond``) could
        look through a value larger than all it keeps, or through a partly used product."""
        if eqn.primitive.name not in ("reduce_sum", "dot_general"):
            return True
        operands = [a for a in eqn.invars if isinstance(a, jx.Var)]
        if any(a in self.opaque for a in operands):
            return True
        kept = max([aval_nbytes(v.aval) for v in eqn.outvars] + [self._least(a) for a in operands])

        def beats(table, strict: bool) -> bool:
            return any(size > kept if strict else size >= kept for a in operands for size, _ in table.get(a, ()))

        return beats(self.grows, True) or beats(self.chained, False) or (
            any(self.masks.get(a, False) for a in operands) and beats(self.products, False))


def _frontier(table: dict, operands, under: int, own: list, strict: bool) -> tuple:
    """The pairs ``(bytes, bound along the chain)`` of a value whose equation reads ``operands`` with
    ``under`` bytes at least below it: its operands' pairs, bounded by ``under`` too, and ``own``; those
    that can still beat their bound (``strict``: be larger), none dominated by another."""
    pairs = [(size, max(bound, under)) for a in operands for size, bound in table.get(a, ())] + own
    pairs = [(size, bound) for size, bound in pairs if (size > bound if strict else size >= bound)]
    if len(pairs) < 2:
        return tuple(pairs)
    kept, lowest = [], None
    for size, bound in sorted(pairs, key=lambda p: (-p[0], p[1])):
        if lowest is None or bound < lowest:
            kept.append((size, bound))
            lowest = bound
    return tuple(kept)
