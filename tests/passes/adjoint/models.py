"""Linear recurrences written as ``lax.scan``, as state space models write them (small sizes),
and the same written as Python loops (:func:`as_python_loop`)."""

import threading

import jax
import jax.numpy as jnp
from jax import lax

_loop = threading.local()


def _scan(body, h0, xs):
    """``lax.scan``, or, inside :func:`as_python_loop`, a Python loop over the rows of ``xs``."""
    if not getattr(_loop, "on", False):
        return lax.scan(body, h0, xs)
    h, ys = h0, []
    for t in range(xs.shape[0]):
        h, y = body(h, xs[t])
        ys.append(y)
    return h, jnp.stack(ys)


def as_python_loop(layer):
    """``layer`` with its scan written as a Python loop (``ys.append(y)``, then ``jnp.stack``)."""
    def unrolled(*args):
        _loop.on = True
        try:
            return layer(*args)
        finally:
            _loop.on = False
    return unrolled


def diagonal(params, h0, xs):
    """Selective diagonal SSM: decay, input and readout all depend on the step's input."""
    w_a, w_b, w_c = params

    def body(h, x):                                   # h: (..., N, P), x: (..., P)
        a = jnp.exp(-jax.nn.softplus(x @ w_a))        # (..., N) input-dependent decay
        b = x @ w_b                                   # (..., N)
        c = x @ w_c                                   # (..., N)
        h = a[..., :, None] * h + b[..., :, None] * x[..., None, :]
        return h, jnp.einsum("...n,...np->...p", c, h)
    return _scan(body, h0, xs)


def dense_per_step(params, h0, xs):
    """h' = A_t h + B x with A_t from the input (per step)."""
    w_a, b = params

    def body(h, x):
        a = 0.3 * jnp.tanh(jnp.einsum("p,pij->ij", x, w_a))
        h = a @ h + b @ x
        return h, jnp.sin(h)
    return _scan(body, h0, xs)


def dense_shared(params, h0, xs):
    """h' = A h + B x with one A for all steps."""
    a, b = params

    def body(h, x):
        h = h @ a.T + x @ b.T
        return h, h * x[..., :1]
    return _scan(body, h0, xs)


def complex_diagonal(params, h0, xs):
    """S4D/S5: complex diagonal decay, real readout."""
    log_re, im, b, c = params

    def body(h, x):
        lam = jnp.exp(-jnp.exp(log_re) + 1j * im)
        h = lam * h + (x @ b).astype(h.dtype)
        return h, jnp.real(h * c)
    return _scan(body, h0, xs)


def nonlinear(params, h0, xs):
    """An RNN: not a linear recurrence."""
    w, = params

    def body(h, x):
        h = jnp.tanh(h @ w + x)
        return h, h
    return _scan(body, h0, xs)


def gated(params, h0, xs):
    """The state feeds a comparison."""
    w, = params

    def body(h, x):
        h = jnp.where(h > 0, 0.9 * h, 0.5 * h) + x @ w
        return h, h
    return _scan(body, h0, xs)


def free_running(T):
    """The loss of a recurrence that reads nothing per step (``lax.scan(f, h, None, length=T)``):
    ``(a, b, h0, w) -> scalar``, and arguments for it (float64 under ``jax.enable_x64``)."""
    def loss(a, b, h0, w):
        h, ys = lax.scan(lambda h, _: (a * h + b, h), h0, None, length=T)
        return jnp.sum((jnp.tanh(ys) * w) ** 2) + jnp.sum(h)
    return loss, (jnp.full(5, 0.9), jnp.linspace(0, 1, 5), jnp.ones(5), jnp.arange(5.0))


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


def lm_stack(params, emb, tokens):
    """A small language model: embedding, diagonal selective layers joined by residual ``tanh``,
    logits against the embedding, next-token cross-entropy (the benchmark's shape, small)."""
    x = emb[tokens[:-1]]
    for w_dt, a_log, w_b, w_c in params:
        def body(h, x_t, w_dt=w_dt, a_log=a_log, w_b=w_b, w_c=w_c):
            dt = jax.nn.softplus(x_t @ w_dt)
            h = jnp.exp(-dt[:, None] * jnp.exp(a_log)) * h + (dt * x_t)[:, None] * (x_t @ w_b)[None, :]
            return h, h @ (x_t @ w_c)
        _, y = lax.scan(body, jnp.zeros((x.shape[1], w_b.shape[1]), x.dtype), x)
        x = x + jnp.tanh(y)
    logits = x @ emb.T
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[1:, None], 1))


def lm_params(key, layers, width, state, vocab, dtype):
    ks = jax.random.split(key, 4 * layers + 1)
    params = [tuple((s * jax.random.normal(ks[4 * i + j], shape)).astype(dtype)
                    for j, (s, shape) in enumerate([(0.3, (width, width)), (0.5, (width, state)),
                                                    (0.3, (width, state)), (0.3, (width, state))]))
              for i in range(layers)]
    return params, (0.5 * jax.random.normal(ks[-1], (vocab, width))).astype(dtype)


def shifted_layers(params, h0, xs):
    """Two diagonal layers with a shift of the time axis between them (rows mixed: two regions)."""
    h, ys = diagonal(params, h0, xs)
    ys = jnp.concatenate([jnp.zeros_like(ys[:1]), ys[:-1]], 0) + xs
    h2, ys2 = diagonal(params, h, ys)
    return jnp.sum(ys2 ** 2) + jnp.sum(jnp.cumsum(ys, 0)[-1]) + jnp.sum(h2)


def affine_combine(x, y):
    """The combine of ``h_t = a_t * h_{t-1} + b_t`` for ``lax.associative_scan`` (``a`` over ``b``'s
    leading axes)."""
    a1, b1 = x
    a2, b2 = y
    return a1 * a2, a2.reshape(a2.shape + (1,) * (b1.ndim - a2.ndim)) * b1 + b2


def selective_parallel(params, x, axis=0, reverse=False):
    """A selective scan in parallel form: decay and input from ``x`` (time on ``axis``), readout."""
    w_a, w_c = params
    a = jax.nn.sigmoid(x @ w_a)                                   # (..., N)
    b = jnp.sin(x)[..., None, :] * (1.0 - a)[..., None]           # (..., N, P)
    t_axis = axis % x.ndim
    A, h = lax.associative_scan(affine_combine, (a, b), reverse=reverse, axis=t_axis)
    return jnp.sum(jnp.einsum("...np,pn->...", h, w_c) ** 2) + 0.1 * jnp.sum(A)


def maxplus(params, x):
    """A max-plus scan (not a linear recurrence): left alone."""
    w, = params
    v = x @ w
    return jnp.sum(lax.associative_scan(jnp.maximum, v) ** 2)
