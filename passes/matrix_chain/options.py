"""The matrix-chain pass's options (its own module: the pass class needs them, not the machinery)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ChainOptions:
    """Tuning of the matrix-chain pass (``MatrixChainPass(max_operands=32)``)."""

    #: Networks with more operands are left alone.
    max_operands: int = 64
    #: The exact search is exponential when a label joins more than two operands
    #: (a batch axis summed away) or when outer products are searched: such
    #: networks get it only up to this many operands, larger ones opt_einsum's greedy search.
    max_exponential_search: int = 10
