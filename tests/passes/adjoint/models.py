"""Linear recurrences written as ``lax.scan``, as state space models write them (small sizes)."""

import jax
import jax.numpy as jnp
from jax import lax


def diagonal(params, h0, xs):
    """Selective diagonal SSM: decay, input and readout all depend on the step's input."""
    w_a, w_b, w_c = params

    def body(h, x):                                   # h: (..., N, P), x: (..., P)
        a = jnp.exp(-jax.nn.softplus(x @ w_a))        # (..., N) input-dependent decay
        b = x @ w_b                                   # (..., N)
        c = x @ w_c                                   # (..., N)
        h = a[..., :, None] * h + b[..., :, None] * x[..., None, :]
        return h, jnp.einsum("...n,...np->...p", c, h)
    return lax.scan(body, h0, xs)


def dense_per_step(params, h0, xs):
    """h' = A_t h + B x with A_t from the input (per step)."""
    w_a, b = params

    def body(h, x):
        a = 0.3 * jnp.tanh(jnp.einsum("p,pij->ij", x, w_a))
        h = a @ h + b @ x
        return h, jnp.sin(h)
    return lax.scan(body, h0, xs)


def dense_shared(params, h0, xs):
    """h' = A h + B x with one A for all steps."""
    a, b = params

    def body(h, x):
        h = h @ a.T + x @ b.T
        return h, h * x[..., :1]
    return lax.scan(body, h0, xs)


def complex_diagonal(params, h0, xs):
    """S4D/S5: complex diagonal decay, real readout."""
    log_re, im, b, c = params

    def body(h, x):
        lam = jnp.exp(-jnp.exp(log_re) + 1j * im)
        h = lam * h + (x @ b).astype(h.dtype)
        return h, jnp.real(h * c)
    return lax.scan(body, h0, xs)


def nonlinear(params, h0, xs):
    """An RNN: not a linear recurrence."""
    w, = params

    def body(h, x):
        h = jnp.tanh(h @ w + x)
        return h, h
    return lax.scan(body, h0, xs)


def gated(params, h0, xs):
    """The state feeds a comparison."""
    w, = params

    def body(h, x):
        h = jnp.where(h > 0, 0.9 * h, 0.5 * h) + x @ w
        return h, h
    return lax.scan(body, h0, xs)


def loss_of(layer):
    def loss(params, h0, xs):
        h, ys = layer(params, h0, xs)
        return jnp.sum(jnp.real(ys) ** 2) + jnp.sum(jnp.real(h))
    return loss


def stacked_loss(params, h0s, xs):
    """Several diagonal layers: backpropagation across layers is the ordinary one."""
    ys = xs
    total = 0.0
    for p, h0 in zip(params, h0s):
        h, ys = diagonal(p, h0, ys)
        ys = jnp.tanh(ys) + xs
        total = total + jnp.sum(h)
    return jnp.mean(ys ** 2) + 0.1 * total
