"""How a ``hlopass_call`` is split into primal and tangent parts when JAX linearises it.

By default this is JAX's own ``ad.linearize_jaxpr``. When that would save a
residual larger than the size threshold for the backward pass (the n x m x d
difference of a naive distance, say), the jaxpr is linearised under
``jax.checkpoint`` instead: only the inputs are saved and the backward
``hlopass_call`` recomputes the forward values it needs, so the pass
pipeline can split that recomputation like any other large region. Passes that must act
*before* the outer differentiation (the HVP rewrite, for
``jax.grad(hlopass.jit(f))``) register a hook that may transform the jaxpr
first; hooks run in registration order and only when their pass is enabled.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax._src import core
from jax._src.interpreters import ad

from hlopass.jaxpr_utils import aval_nbytes, trace_flat

#: pass name -> hook(jaxpr, config) -> jaxpr to linearise instead
LINEARIZE_HOOKS: dict[str, Callable] = {}


def register_linearize_hook(pass_name: str, hook: Callable) -> None:
    """Let pass ``pass_name`` transform a jaxpr before JAX linearises it."""
    LINEARIZE_HOOKS[pass_name] = hook


def primal_tangent_split(jaxpr, nzs, is_vjp, config):
    """``(jaxpr used, *ad.linearize_jaxpr(...))`` for ``jaxpr`` after the enabled hooks."""
    from hlopass.registry import get_pass
    for name in config.passes:
        if name not in LINEARIZE_HOOKS:
            get_pass(name)  # importing a pass module registers its hook
        hook = LINEARIZE_HOOKS.get(name)
        if hook is not None:
            jaxpr = hook(jaxpr, config)
    split = ad.linearize_jaxpr(jaxpr, nzs, is_vjp=is_vjp)
    primal_jaxpr, num_res_out = split[0], split[1]
    residual_avals = primal_jaxpr.out_avals[len(primal_jaxpr.out_avals) - num_res_out:]
    if config.threshold is not None and any(aval_nbytes(a) > config.threshold for a in residual_avals):
        jaxpr = rematerialized(jaxpr)
        split = ad.linearize_jaxpr(jaxpr, nzs, is_vjp=is_vjp)
    return (jaxpr, *split)


def rematerialized(jaxpr: core.ClosedJaxpr) -> core.ClosedJaxpr:
    """``jaxpr`` wrapped in ``jax.checkpoint`` with nothing saveable (same signature)."""
    body = jax.checkpoint(core.jaxpr_as_fun(jaxpr), policy=jax.checkpoint_policies.nothing_saveable,
                          prevent_cse=False)
    return trace_flat(lambda *args: body(*args), jaxpr.in_avals, "remat")
