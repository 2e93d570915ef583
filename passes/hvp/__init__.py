"""The HVP rewrite: reverse-over-reverse Hessian-vector products become forward-over-reverse (Mix Flow-MG).

Matches: a gradient (``jax.grad`` / ``jax.value_and_grad`` of an inner loss)
whose result is differentiated again in reverse mode, as in meta-learning
(``jax.grad`` of a loss after inner SGD steps), MAML, learned learning rates
or the explicit ``jax.grad(lambda x: jnp.vdot(jax.grad(f)(x), v))``.

Emits: the same gradient, wrapped so that its VJP is ``jax.jvp`` of the
gradient of the inner loss with respect to *all* its differentiable inputs
(parameters, meta-parameters, anything it closes over), in the direction of
the incoming cotangent. Only the inner loss's inputs are kept for the
backward pass instead of the inner backward pass's activations.

Two ways in, for the two ways of using hlopass:

- ``@hlopass.jit`` on a function that calls ``jax.grad(meta_loss)`` itself:
  the replacement is made while the function is traced
  (:mod:`.trace`, through :meth:`~hlopass.Pass.trace_context`), since afterwards the outer backward pass is
  already interleaved with the inner one;
- ``jax.grad(hlopass.jit(meta_loss))``: hlopass builds the VJP itself, and
  the :meth:`~hlopass.Pass.before_linearize` hook (:mod:`.regions`) finds each inner-gradient
  region in the primal jaxpr and replaces it before JAX linearises it.

This pass then finds the replaced regions in the jaxpr (by their named
scope) and reports each with the inner loss's source line; the jaxpr itself
is returned unchanged.

Leaves alone: programs without inner gradients, first-order gradients and
forward-mode derivatives.
"""

from __future__ import annotations

from jax._src import core

from hlopass.jaxpr_utils import iter_eqns
from hlopass.pass_base import Pass
from hlopass.report import PassReport, source_line

from .regions import linearize_hook
from .trace import RECORDS, intercept_gradients, scopes_in


class HvpPass(Pass):
    """Report the forward-over-reverse replacements of inner gradients (see the module docstring)."""

    name = "hvp"
    recursive = False

    def run_level(self, closed: core.ClosedJaxpr, config, report: PassReport) -> core.ClosedJaxpr:
        seen: dict[str, core.JaxprEqn] = {}
        for eqn in iter_eqns(closed):
            for scope in scopes_in(eqn.source_info.name_stack):
                seen.setdefault(scope, eqn)
        for scope, eqn in seen.items():
            record = RECORDS.get(scope)
            loss = record.loss if record else source_line(eqn)
            where = record.call_site if record else source_line(eqn)
            report.rewrite("fwdrev_hvp", where,
                           f"gradient of {loss} differentiated again: Hessian products taken "
                           f"forward-over-reverse (inner backward activations not kept)",
                           scope=scope, loss=loss, transform=record.transform if record else "region")
        return closed

    def trace_context(self, config, notes):
        """Inner gradients under an outer gradient become forward-over-reverse while tracing."""
        return intercept_gradients(config)

    def before_linearize(self, closed, config, notes):
        """Inner-gradient regions of a program JAX is about to differentiate become forward-over-reverse."""
        return linearize_hook(closed, config)

