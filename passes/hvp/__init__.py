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
  (:mod:`.trace`, through :meth:`~hlopass.Pass.retrace_context`), since afterwards the outer backward pass is
  already interleaved with the inner one. The first trace only observes
  (:meth:`~hlopass.Pass.trace_context`); the replacing one is asked for when it saw a nested gradient
  or the program calls a function holding a backward pass (:meth:`HvpPass.wants_retrace`);
- ``jax.grad(hlopass.jit(meta_loss))``: hlopass builds the VJP itself, and
  the :meth:`~hlopass.Pass.before_linearize` hook (:mod:`.regions`) finds each inner-gradient
  region in the primal jaxpr and replaces it before JAX linearises it.

Both record what they replaced (``fwdrev_hvp``, with the inner loss's source
line) and what they left alone (``skip``, with the reason) as notes, which
travel with the program to this pass's report; at lowering time the pass
has nothing left to do and returns the jaxpr unchanged.

Leaves alone: programs without inner gradients, first-order gradients and
forward-mode derivatives; inner losses that call a ``custom_vjp`` (forward
mode cannot differentiate them) and, in form 2, regions whose parameter
cannot be told apart from a same-typed input (both reported as skips).
"""

from __future__ import annotations

from hlopass import internals as jx

from hlopass.pass_base import Pass
from hlopass.report import Note, PassReport

from .trace import inner_gradient_in_call, intercept_gradients, nested_gradient_seen, observe_gradients


class HvpPass(Pass):
    """Inner gradients differentiated again become forward-over-reverse (see the module docstring)."""

    name = "hvp"
    recursive = False

    def applies(self, closed: jx.ClosedJaxpr, config, facts) -> bool:
        """Never at lowering time: the pass acts while tracing and before linearising."""
        return False

    def run_level(self, closed: jx.ClosedJaxpr, config, report: PassReport) -> jx.ClosedJaxpr:
        """Nothing: the replacements were made while tracing or before linearising, and their notes
        are this pass's report."""
        return closed

    def trace_context(self, config, notes: list[Note]):
        """The first trace only observes (JAX's caches shared with plain calls, nothing replaced)."""
        return observe_gradients()

    def wants_retrace(self, closed, config) -> bool:
        """Traced again, replacing, when a gradient was taken inside reverse-mode differentiation or
        the program calls a jitted function holding a backward pass (JAX may have cached it)."""
        return nested_gradient_seen() or inner_gradient_in_call(closed.jaxpr) is not None

    def retrace_context(self, config, notes: list[Note]):
        """Inner gradients under an outer gradient become forward-over-reverse while tracing."""
        return intercept_gradients(notes)

    def before_linearize(self, closed, config, notes: list[Note]):
        """Inner-gradient regions of a program JAX is about to differentiate become forward-over-reverse.

        Its notes are added only once the whole rewrite has succeeded (if it raises, the pipeline
        keeps the program as it was and says so).
        """
        from .regions import linearize_hook
        found: list[Note] = []
        new = linearize_hook(closed, config, found)
        notes.extend(found)
        return new
