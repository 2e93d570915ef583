"""Contraction orders for einsum-like products, with a cap on intermediate sizes (opt_einsum).

Shared by every pass that emits products of several operands, so that all of
them search orders the same way and handle an infeasible cap the same way.
"""

from __future__ import annotations

import functools

import opt_einsum


def cheapest_order(inputs, output, sizes, memory_limit: int | None = None, search_outer: bool = False):
    """The pairwise contraction order with the fewest multiply-adds (opt_einsum's dynamic
    programming), every intermediate within ``memory_limit`` elements when given.

    ``inputs`` are the operands' label sets, ``output`` the result's, ``sizes``
    each label's extent. Returns opt_einsum's linear path (a list of tuples),
    or ``None`` when no pairwise order keeps within the cap. Searches are cached by their
    arguments: a deep network repeats the same product in every layer.
    """
    key = (tuple(frozenset(i) for i in inputs), frozenset(output), frozenset(dict(sizes).items()))
    path = _cached_order(key, memory_limit, search_outer)
    return None if path is None else list(path)


@functools.lru_cache(maxsize=4096)
def _cached_order(key, memory_limit: int | None, search_outer: bool):
    inputs, output, sizes = key
    optimizer = opt_einsum.paths.DynamicProgramming(minimize="flops", cost_cap=True, search_outer=search_outer)
    try:
        path = optimizer([set(i) for i in inputs], set(output), dict(sizes), memory_limit)
    except RuntimeError:  # "No contraction found for given memory_limit"
        return None
    path = tuple(tuple(step) for step in path)
    if len(inputs) > 1 and any(len(step) > 2 for step in path):
        return None
    return path


def einsum_order(spec: str, shapes, memory_limit: int | None = None) -> list[tuple]:
    """An order for ``jnp.einsum(spec, ...)``: the cheapest within ``memory_limit`` elements when one
    exists, else the cheapest without a cap."""
    terms, out = spec.split("->")
    inputs = terms.split(",")
    sizes = {c: int(n) for term, shape in zip(inputs, shapes) for c, n in zip(term, shape)}
    if len(inputs) == 1:
        return [(0,)]
    path = cheapest_order(inputs, out, sizes, memory_limit) if memory_limit is not None else None
    if path is None:
        path = cheapest_order(inputs, out, sizes, None, search_outer=True)
    return path
