"""The rewriting interpreter: re-emit a jaxpr through JAX with some equations replaced.

Passes never mutate jaxprs. They describe :class:`Replacement` s (a set of
equations, the values they read, the values they define and a builder that
computes those values from the inputs with ordinary JAX code), and
:func:`rewrite` re-traces the jaxpr: untouched equations are bound as they
are, with their source information, and each replacement's builder is called
in their place. ``jax.make_jaxpr`` of that interpreter is the new jaxpr.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Collection, Sequence

import networkx as nx
from hlopass import internals as jx

from hlopass import progress
from hlopass.families import CALLS, REMAT
from hlopass.jaxpr_utils import call_body, dce, has_subjaxprs, iter_eqns, map_subjaxprs, trace_flat
from hlopass.report import source_line

#: What :func:`inline_calls` inlines: plain calls and ``checkpoint`` bodies (which only matter
#: across a forward/backward boundary, and hlopass programs have none once JAX split them into calls).
PLAIN_CALLS = CALLS | REMAT

EqnRule = Callable[[jx.JaxprEqn, list[Any]], "list[Any] | None"]


@dataclasses.dataclass
class Replacement:
    """Replace ``eqns`` (indices into the jaxpr's equations) by ``build``.

    ``build(*values of inputs)`` returns the values of ``outputs``, in order.
    ``anchor`` is the equation whose source line the new equations carry.
    The replaced equations must form a convex region (no path leaves the
    region and comes back), otherwise :func:`rewrite` raises ``ValueError``.
    """

    eqns: Sequence[int]
    inputs: Sequence[Any]
    outputs: Sequence[Any]
    build: Callable[..., Sequence[Any]]
    anchor: int | None = None


def bind_equation(eqn: jx.JaxprEqn, invals: Sequence[Any], params: dict | None = None) -> list[Any]:
    """Bind ``eqn``'s primitive on ``invals`` (with ``params`` if given), under its source info."""
    bind_params = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    name_stack = jx.current_name_stack() + eqn.source_info.name_stack
    with jx.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def at_source_of(eqn: jx.JaxprEqn):
    """Context manager: equations traced inside carry ``eqn``'s source line."""
    name_stack = jx.current_name_stack() + eqn.source_info.name_stack
    return jx.user_context(eqn.source_info.traceback, name_stack=name_stack)


def evaluate(jaxpr: jx.Jaxpr, consts: Sequence[Any], args: Sequence[Any],
             replacements: Sequence[Replacement] = (), eqn_rule: EqnRule | None = None) -> list[Any]:
    """Evaluate ``jaxpr`` like ``jx.eval_jaxpr`` but with ``replacements`` applied.

    ``eqn_rule(eqn, invals)`` may return output values for any untouched
    equation (``None`` to bind it as it is).
    """
    env: dict[jx.Var, Any] = {}

    def read(atom):
        return atom.val if isinstance(atom, jx.Literal) else env[atom]

    def write(var, value):
        if not isinstance(var, jx.DropVar):
            env[var] = value

    for var, value in zip(jaxpr.constvars, consts):
        write(var, value)
    for var, value in zip(jaxpr.invars, args):
        write(var, value)

    for kind, item in _schedule(jaxpr, replacements):
        if kind == "replacement":
            anchor = jaxpr.eqns[item.anchor if item.anchor is not None else max(item.eqns)]
            with at_source_of(anchor):
                outs = list(item.build(*map(read, item.inputs)))
            if len(outs) != len(item.outputs):
                raise ValueError(f"replacement built {len(outs)} values for {len(item.outputs)} outputs")
            for var, value in zip(item.outputs, outs):
                write(var, value)
            continue
        eqn = item
        invals = list(map(read, eqn.invars))
        outs = eqn_rule(eqn, invals) if eqn_rule is not None else None
        if outs is None:
            outs = bind_equation(eqn, invals)
        for var, value in zip(eqn.outvars, outs):
            write(var, value)
    return [read(v) for v in jaxpr.outvars]


def _schedule(jaxpr: jx.Jaxpr, replacements: Sequence[Replacement]):
    """Equations and replacements in an order that respects data dependencies."""
    if not replacements:
        return [("eqn", eqn) for eqn in jaxpr.eqns]
    owner: dict[int, int] = {}
    for k, rep in enumerate(replacements):
        for i in rep.eqns:
            if i in owner:
                raise ValueError(f"equation {i} is claimed by two replacements")
            owner[i] = k
    node_of = lambda i: ("r", owner[i]) if i in owner else ("e", i)  # noqa: E731
    producer: dict[jx.Var, tuple] = {}
    graph = nx.DiGraph()
    position: dict[tuple, int] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        node = node_of(i)
        graph.add_node(node)
        position[node] = min(position.get(node, i), i)
        for var in eqn.outvars:
            producer[var] = node
    for i, eqn in enumerate(jaxpr.eqns):
        node = node_of(i)
        reads = replacements[owner[i]].inputs if i in owner else eqn.invars
        for atom in reads:
            src = producer.get(atom) if isinstance(atom, jx.Var) else None
            if src is not None and src != node:
                graph.add_edge(src, node)
    try:
        order = list(nx.lexicographical_topological_sort(graph, key=position.__getitem__))
    except nx.NetworkXUnfeasible as err:
        raise ValueError("a replacement region is not convex (a path leaves it and re-enters)") from err
    return [("replacement", replacements[n[1]]) if n[0] == "r" else ("eqn", jaxpr.eqns[n[1]]) for n in order]


def rewrite(closed: jx.ClosedJaxpr, replacements: Sequence[Replacement] = (),
            eqn_rule: EqnRule | None = None, name: str = "hlopass") -> jx.ClosedJaxpr:
    """``closed`` with ``replacements`` (and ``eqn_rule``) applied; dead code removed.

    The result has the same input and output avals as ``closed``. Without ``eqn_rule``, only the
    replacements' builders are traced, and their equations spliced in among the untouched ones
    (:func:`_splice_replacements`); with it, or where splicing could differ from tracing, the whole
    program is traced again (:func:`evaluate`).
    """
    region = progress.at(functools.partial(_describe_replacements, closed.jaxpr, replacements)) \
        if replacements else contextlib.nullcontext()
    with region:
        new = None
        if eqn_rule is None:
            try:
                new = _splice_replacements(closed, replacements, name)
            except _Retrace:
                new = None
        if new is None:
            new = retrace(closed, replacements, eqn_rule, name)
    return dce(new)


def retrace(closed: jx.ClosedJaxpr, replacements: Sequence[Replacement] = (),
            eqn_rule: EqnRule | None = None, name: str = "hlopass") -> jx.ClosedJaxpr:
    """``closed`` traced again through :func:`evaluate`: every untouched equation bound again, each
    replacement built in its place (dead code kept)."""
    in_avals = [v.aval for v in closed.jaxpr.invars]

    def interpret(*args):
        return evaluate(closed.jaxpr, closed.consts, args, replacements, eqn_rule)

    return trace_flat(interpret, in_avals, name)


class _Retrace(Exception):
    """Splicing would give another program than tracing again: trace again."""


def _splice_replacements(closed: jx.ClosedJaxpr, replacements: Sequence[Replacement],
                         name: str) -> jx.ClosedJaxpr:
    """What :func:`retrace` gives, without binding the untouched equations again: each replacement's
    builder is traced alone (its literal and constant inputs given as values, as :func:`evaluate`
    reads them) and its equations put in its place with fresh variables, its constants made the
    program's; an equation given a literal operand is folded as tracing folds it.

    Raises :class:`_Retrace` where a built value's type differs from the one it replaces (tracing
    would carry the new type on through the equations that read it)."""
    jaxpr = closed.jaxpr
    constvars, consts = list(jaxpr.constvars), list(closed.consts)
    value_of = dict(zip(constvars, consts))
    env: dict = {}
    eqns: list[jx.JaxprEqn] = []

    def read(atom):
        return env.get(atom, atom) if isinstance(atom, jx.Var) else atom

    def concrete(atom) -> bool:
        return isinstance(atom, jx.Literal) or atom in value_of

    for kind, item in _schedule(jaxpr, replacements):
        if kind == "eqn":
            invars = [read(a) for a in item.invars]
            known = len(constvars)
            if _fold(item, invars, env, constvars, consts):
                value_of.update(zip(constvars[known:], consts[known:]))
                continue
            if any(a is not b for a, b in zip(invars, item.invars)):
                item = item.replace(invars=invars)
            eqns.append(item)
            continue
        inputs = [read(a) for a in item.inputs]
        traced = [k for k, a in enumerate(inputs) if not concrete(a)]
        given = {k: (a.val if isinstance(a, jx.Literal) else value_of[a]) for k, a in enumerate(inputs)
                 if concrete(a)}
        anchor = jaxpr.eqns[item.anchor if item.anchor is not None else max(item.eqns)]

        def build(*values, item=item, given=given, anchor=anchor):
            supplied = iter(values)
            args = [given[k] if k in given else next(supplied) for k in range(len(inputs))]
            with at_source_of(anchor):
                outs = list(item.build(*args))
            if len(outs) != len(item.outputs):
                raise ValueError(f"replacement built {len(outs)} values for {len(item.outputs)} outputs")
            return outs

        body = trace_flat(build, [inputs[k].aval for k in traced], name)
        inner = dict(zip(body.jaxpr.invars, (inputs[k] for k in traced)))
        value_of.update(_adopt_consts(body, inner, constvars, consts))
        for eqn in body.jaxpr.eqns:
            outvars = [jx.DropVar(v.aval) if isinstance(v, jx.DropVar) else jx.Var(v.aval) for v in eqn.outvars]
            inner.update((old, new) for old, new in zip(eqn.outvars, outvars) if not isinstance(old, jx.DropVar))
            eqns.append(eqn.replace(invars=[inner.get(a, a) if isinstance(a, jx.Var) else a for a in eqn.invars],
                                    outvars=outvars))
        for var, result in zip(item.outputs, body.jaxpr.outvars):
            value = inner.get(result, result) if isinstance(result, jx.Var) else result
            if not isinstance(var, jx.Var) or isinstance(var, jx.DropVar):
                continue
            if getattr(value, "aval", None) != var.aval:
                raise _Retrace(f"a built value of type {getattr(value, 'aval', value)} for {var.aval}")
            env[var] = value
    new = jaxpr.replace(constvars=constvars, eqns=eqns, outvars=[read(v) for v in jaxpr.outvars])
    return jx.ClosedJaxpr(new, consts)


def _describe_replacements(jaxpr: jx.Jaxpr, replacements: Sequence[Replacement]) -> str:
    """``3 regions (the first at model.py:12 (f))``: what a rewrite is building, for progress lines."""
    first = replacements[0]
    anchor = first.anchor if first.anchor is not None else max(first.eqns, default=None)
    where = source_line(jaxpr.eqns[anchor]) if anchor is not None else "<unknown>"
    count = len(replacements)
    return f"rewriting {count} region{'s' if count > 1 else ''} ({'the first ' if count > 1 else ''}at {where})"


def inline_calls(closed: jx.ClosedJaxpr, primitives: Collection[str] = PLAIN_CALLS,
                 keep: Callable[[jx.JaxprEqn], bool] | None = None, deep: bool = False) -> jx.ClosedJaxpr:
    """``closed`` with every call whose primitive is in ``primitives`` replaced by its body
    (:func:`~hlopass.jaxpr_utils.call_body`), recursively through the calls it inlines, under the
    call's name scope; ``closed`` itself when there is none to inline. Dead code is removed.

    The bodies' equations are spliced in, not traced again: the result is what re-tracing gives
    (JAX's folding of a literal operand included), at a tenth of the cost on a large program.

    ``keep(eqn)``: a call left as it is (its body not entered either, unless ``deep``). ``deep``: go
    into every sub-jaxpr too (loop and branch bodies, kept calls), each rewritten on its own. The
    default inlines plain calls and ``checkpoint`` s at this level, so passes see one flat program;
    with :data:`~hlopass.families.INLINABLE` custom-derivative calls are their primal computation
    (the passes run after JAX has differentiated the program).
    """
    def inlined(eqn) -> bool:
        return eqn.primitive.name in primitives and (keep is None or not keep(eqn))

    eqns = iter_eqns(closed) if deep else closed.jaxpr.eqns
    if not any(inlined(eqn) for eqn in eqns):
        return closed
    if deep:
        def nested(eqn):
            return map_subjaxprs(eqn, lambda sub: inline_calls(sub, primitives, keep, deep))
    else:
        nested = None
    return dce(_spliced(closed, inlined, nested))


def _spliced(closed: jx.ClosedJaxpr, inlined: Callable[[jx.JaxprEqn], bool],
             nested: Callable[[jx.JaxprEqn], dict | None] | None) -> jx.ClosedJaxpr:
    """``closed`` with the equations of each ``inlined`` call's body put in the call's place (fresh
    variables, the call's name stack before theirs, the body's constants made constants of
    ``closed``): what re-tracing through the bodies gives, without binding every equation again.
    ``nested(eqn)``: new parameters for an equation that stays (its sub-jaxprs rewritten), or ``None``."""
    jaxpr = closed.jaxpr
    constvars, consts = list(jaxpr.constvars), list(closed.consts)
    eqns: list[jx.JaxprEqn] = []

    def read(env, atom):
        return env.get(atom, atom) if isinstance(atom, jx.Var) else atom

    def splice(body_eqns, env: dict, outer_stack, fresh: bool) -> None:
        for eqn in body_eqns:
            invars = [read(env, a) for a in eqn.invars]
            body = call_body(eqn) if inlined(eqn) else None
            if body is not None:
                inner = dict(zip(body.jaxpr.invars, invars))
                _adopt_consts(body, inner, constvars, consts)
                stack = eqn.source_info.name_stack if outer_stack is None else outer_stack + eqn.source_info.name_stack
                splice(body.jaxpr.eqns, inner, stack, True)
                env.update((out, read(inner, result)) for out, result in zip(eqn.outvars, body.jaxpr.outvars)
                           if not isinstance(out, jx.DropVar))
                continue
            if _fold(eqn, invars, env, constvars, consts):
                continue
            params = nested(eqn) if nested is not None else None
            outvars = eqn.outvars
            if fresh:
                outvars = [jx.DropVar(v.aval) if isinstance(v, jx.DropVar) else jx.Var(v.aval) for v in outvars]
                env.update((old, new) for old, new in zip(eqn.outvars, outvars) if not isinstance(old, jx.DropVar))
            if fresh or params is not None or any(a is not b for a, b in zip(invars, eqn.invars)):
                changes = dict(invars=invars, outvars=outvars)
                if params is not None:
                    changes["params"] = params
                if fresh and len(outer_stack):  # what re-tracing under the call's name scope records
                    changes["source_info"] = eqn.source_info.replace(name_stack=outer_stack + eqn.source_info.name_stack)
                eqn = eqn.replace(**changes)
            eqns.append(eqn)

    top: dict = {}
    splice(jaxpr.eqns, top, None, False)
    new = jaxpr.replace(constvars=constvars, eqns=eqns, outvars=[read(top, v) for v in jaxpr.outvars])
    return jx.ClosedJaxpr(new, consts)


def _adopt_consts(body: jx.ClosedJaxpr, inner: dict, constvars: list, consts: list) -> dict:
    """Make ``body``'s constants constants of the program being built (fresh variables, mapped in
    ``inner``); returns the new variables' values."""
    adopted = {}
    for var, value in zip(body.jaxpr.constvars, body.consts):
        inner[var] = jx.Var(var.aval)
        constvars.append(inner[var])
        consts.append(value)
        adopted[inner[var]] = value
    return adopted


def _fold(eqn: jx.JaxprEqn, invars: list, env: dict, constvars: list, consts: list) -> bool:
    """Fold ``eqn`` as tracing would when an operand is a literal (as inlining makes a call's
    literal operand in its body, and a body's literal result in its callers): its results become
    literals, or constants. Whether it did."""
    rule = jx.const_fold_rules.get(eqn.primitive)
    if rule is None or not any(isinstance(a, jx.Literal) for a in invars):
        return False
    values = rule([a.val if isinstance(a, jx.Literal) else None for a in invars], eqn.params,
                  [v.aval for v in eqn.outvars])
    if values is None:
        return False
    for var, value in zip(eqn.outvars, values):
        if jx.is_literalable(value):
            env[var] = jx.Literal(value, var.aval)
        else:
            env[var] = jx.Var(var.aval)
            constvars.append(env[var])
            consts.append(value)
    return True


def rewrite_nested(closed: jx.ClosedJaxpr, level: Callable[[jx.ClosedJaxpr], jx.ClosedJaxpr]) -> jx.ClosedJaxpr:
    """Apply ``level`` to every sub-jaxpr (innermost first), then to ``closed`` itself.

    ``level`` returns its argument unchanged (the same object) when it has nothing to do. The
    sub-jaxprs are rewritten first, and ``closed`` is re-traced with them only when one changed:
    a program whose sub-jaxprs ``level`` leaves alone costs no re-trace.
    """
    new_params: dict[int, dict] = {}
    for eqn in closed.jaxpr.eqns:
        if has_subjaxprs(eqn):
            params = map_subjaxprs(eqn, lambda sub: rewrite_nested(sub, level))
            if params is not None:
                new_params[id(eqn)] = params
    inner = closed
    if new_params:
        def rule(eqn, invals):
            params = new_params.get(id(eqn))
            return None if params is None else bind_equation(eqn, invals, params)
        inner = rewrite(closed, eqn_rule=rule)
    return level(inner)


def written_between(closed: jx.ClosedJaxpr, inputs: Sequence[jx.Var],
                    outputs: Sequence[jx.Var]) -> Callable[..., list[Any]]:
    """A function ``(*values of inputs) -> values of outputs`` that re-runs, as written, the
    equations of ``closed`` that ``outputs`` depend on, starting from ``inputs``.

    Raises ``ValueError`` if ``outputs`` depend on a variable of ``closed`` that is neither in
    ``inputs`` nor computed from them (a constant of ``closed`` is read from its value).
    """
    jaxpr = closed.jaxpr
    consts = dict(zip(jaxpr.constvars, closed.consts))
    producer = {v: i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
    stop = {v for v in inputs if isinstance(v, jx.Var)}
    needed: set[int] = set()
    todo = [v for v in outputs if isinstance(v, jx.Var)]
    seen: set = set()
    while todo:
        var = todo.pop()
        if var in seen or var in stop or var in consts:
            continue
        seen.add(var)
        if var not in producer:
            raise ValueError(f"{var} is read but is not among the inputs")
        i = producer[var]
        if i not in needed:
            needed.add(i)
            todo += [a for a in jaxpr.eqns[i].invars if isinstance(a, jx.Var)]
    eqns = [jaxpr.eqns[i] for i in sorted(needed)]

    def run(*values):
        env: dict = dict(consts)
        env.update((v, value) for v, value in zip(inputs, values) if isinstance(v, jx.Var))
        read = lambda atom: atom.val if isinstance(atom, jx.Literal) else env[atom]  # noqa: E731
        for eqn in eqns:
            for var, value in zip(eqn.outvars, bind_equation(eqn, [read(a) for a in eqn.invars])):
                env[var] = value
        return [read(v) for v in outputs]
    return run
