"""Joining a ``shard_map`` to the one that reads its large per-device results, so that one body holds both.

A gradient of a ``shard_map`` runs two of them in its backward program: the forward body computed
again, then the transposed body, which reads the forward's per-device values (the residuals). A
residual passed from one ``shard_map`` to the next is an output of one body and an input of the
other, so neither body's split can keep it out of memory. Joined into one ``shard_map``, the value
is computed and read inside one body, where the split pass grows a region across it.

Matches: a ``shard_map`` *B* reading a result of an earlier ``shard_map`` *A* that is over the
threshold on one device, where both have the same mesh, manual axes and varying-axes checking
(on), no effects, every such result is passed with the same spec on both sides and the same type
in both bodies, and every other input of *B* is defined before *A*.

Emits: one ``shard_map`` at *A*'s place whose body is *A*'s followed by *B*'s (reading *A*'s
values directly); its results are *B*'s and those of *A* read elsewhere. Each device computes the
same values as before: a block passed out with a spec and back in with the same spec is that
device's own block.

Leaves alone: every other ``shard_map``, and pairs whose large values do not cross between them.
"""

from __future__ import annotations

from hlopass import internals as jx

from hlopass.graph import DataflowGraph
from hlopass.jaxpr_utils import aval_nbytes


def fuse_shard_maps(closed: jx.ClosedJaxpr, threshold: int) -> tuple[jx.ClosedJaxpr, int]:
    """``closed`` with each matching pair of ``shard_map`` s joined (see the module); and how many were."""
    jaxpr, joined = closed.jaxpr, 0
    for _ in range(len(jaxpr.eqns)):
        found = _find_pair(jaxpr, threshold)
        if found is None:
            break
        jaxpr = _join(jaxpr, *found)
        joined += 1
    if not joined:
        return closed, 0
    return jx.ClosedJaxpr(jaxpr, closed.consts), joined


def _compatible(a: jx.JaxprEqn, b: jx.JaxprEqn) -> bool:
    pa, pb = a.params, b.params
    names = pa["mesh"].axis_names
    effects = lambda eqn: jx.filter_named_axis_effects(eqn.params["jaxpr"].effects, names)  # noqa: E731 - collectives are no effect here
    return (pa["mesh"] == pb["mesh"] and pa.get("newly_manual_axes") == pb.get("newly_manual_axes")
            and pa.get("check_vma") is True and pb.get("check_vma") is True
            and not a.effects and not b.effects and not pa["jaxpr"].constvars and not pb["jaxpr"].constvars
            and not effects(a) and not effects(b))


def _find_pair(jaxpr: jx.Jaxpr, threshold: int):
    producer = {v: i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars if not isinstance(v, jx.DropVar)}
    for j, b in enumerate(jaxpr.eqns):
        if b.primitive.name != "shard_map":
            continue
        for i in sorted({producer[v] for v in b.invars if isinstance(v, jx.Var) and v in producer}):
            a = jaxpr.eqns[i]
            if a.primitive.name != "shard_map" or not _compatible(a, b):
                continue
            crossing = [(pos, a.outvars.index(v)) for pos, v in enumerate(b.invars)
                        if isinstance(v, jx.Var) and producer.get(v) == i]
            body_a, body_b = a.params["jaxpr"], b.params["jaxpr"]
            if not any(aval_nbytes(body_b.invars[pos].aval) > threshold for pos, _ in crossing):
                continue
            if any(b.params["in_specs"][pos] != a.params["out_specs"][k]
                   or str(body_b.invars[pos].aval) != str(body_a.outvars[k].aval)
                   or not isinstance(body_a.outvars[k], jx.Var) for pos, k in crossing):
                continue
            if all(not isinstance(v, jx.Var) or producer.get(v, -1) < i or producer.get(v) == i for v in b.invars):
                return i, j
    return None


def _join(jaxpr: jx.Jaxpr, i: int, j: int) -> jx.Jaxpr:
    a, b = jaxpr.eqns[i], jaxpr.eqns[j]
    body_a, body_b = a.params["jaxpr"], b.params["jaxpr"]
    graph = DataflowGraph(jaxpr)
    rename: dict = {}
    extra_outer, extra_inner, extra_specs = [], [], []
    for pos, (outer, inner) in enumerate(zip(b.invars, body_b.invars)):
        if isinstance(outer, jx.Var) and outer in a.outvars:
            rename[inner] = body_a.outvars[a.outvars.index(outer)]
        else:
            fresh = jx.Var(inner.aval)
            rename[inner] = fresh
            extra_outer.append(outer)
            extra_inner.append(fresh)
            extra_specs.append(b.params["in_specs"][pos])
    sub = lambda atom: rename.get(atom, atom) if isinstance(atom, jx.Var) else atom  # noqa: E731
    eqns_b = [eqn.replace(invars=[sub(v) for v in eqn.invars]) for eqn in body_b.eqns]
    # results of A still read outside B (or returned) stay results
    kept = [k for k, v in enumerate(a.outvars)
            if not isinstance(v, jx.DropVar) and (graph.is_output(v) or any(u != j for u in graph.uses(v)))]
    body = body_a.replace(
        invars=[*body_a.invars, *extra_inner], eqns=[*body_a.eqns, *eqns_b],
        outvars=[*(body_a.outvars[k] for k in kept), *(sub(v) for v in body_b.outvars)],
        effects=body_a.effects | body_b.effects,
        debug_info=body_a.debug_info.with_unknown_names() if hasattr(body_a.debug_info, "with_unknown_names")
        else body_a.debug_info)
    params = dict(a.params, jaxpr=body, in_specs=(*a.params["in_specs"], *extra_specs),
                  out_specs=(*(a.params["out_specs"][k] for k in kept), *b.params["out_specs"]))
    joined = a.replace(invars=[*a.invars, *extra_outer], outvars=[*(a.outvars[k] for k in kept), *b.outvars],
                       params=params)
    eqns = list(jaxpr.eqns)
    eqns[i] = joined
    del eqns[j]
    return jaxpr.replace(eqns=eqns)
