"""Small deep networks for the remat tests: layers in Python loops and in ``lax.scan``, residual
blocks, a reversed scan, a scan whose per-layer outputs are used, and a one-block-per-layer
Transformer."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from hlopass.memory import measure


def mlp(ws, x):
    for w in ws:
        x = jnp.tanh(x @ w)
    return jnp.sum(x ** 2)


def resnet(params, x):
    for w1, w2 in params:
        x = x + jnp.tanh(x @ w1) @ w2
    return jnp.sum(jnp.sin(x))


def scan_mlp(ws, x):
    x, _ = lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, ws)
    return jnp.sum(x ** 2)


def scan_resnet(params, x):
    def block(x, p):
        w1, w2 = p
        return x + jax.nn.gelu(x @ w1) @ w2, None
    x, _ = lax.scan(block, x, params)
    return jnp.mean(jnp.cos(x))


def scan_reversed(ws, x):
    x, _ = lax.scan(lambda x, w: (jnp.sin(x @ w) + 0.5 * x, None), x, ws, reverse=True)
    return jnp.sum(x)


def scan_outputs(ws, x):
    def layer(x, w):
        y = jnp.tanh(x @ w)
        return y, jnp.mean(y * y, axis=1)
    x, per_layer = lax.scan(layer, x, ws)
    return jnp.sum(x) + jnp.sum(per_layer ** 2)


def layer_norm(x):
    x = x - jnp.mean(x, axis=-1, keepdims=True)
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5)


def transformer(params, tokens):
    """Pre-norm blocks: single-head attention and an MLP, residual stream ``[seq, d]``."""
    x = tokens
    for wq, wk, wv, wo, w1, w2 in params:
        h = layer_norm(x)
        q, k, v = h @ wq, h @ wk, h @ wv
        a = jax.nn.softmax(q @ k.T / np.sqrt(q.shape[-1]), axis=-1)
        x = x + (a @ v) @ wo
        h = layer_norm(x)
        x = x + jax.nn.gelu(h @ w1) @ w2
    return jnp.mean(layer_norm(x) * tokens)


def normal(key, shape, scale=1.0, dtype=jnp.float32):
    # numpy's generator: jax.random would compile a program per shape
    return jnp.asarray((scale * np.random.default_rng(key).standard_normal(shape)).astype(np.dtype(dtype)))


def make(name, layers=8, width=32, batch=256, dtype=jnp.float32):
    """``(loss, params, x)`` of model ``name`` at the given sizes."""
    s = 1 / np.sqrt(width)
    x = normal(1000, (batch, width), dtype=dtype)
    if name in ("mlp", "scan_mlp", "scan_reversed", "scan_outputs"):
        ws = normal(0, (layers, width, width), 1.5 * s, dtype)
        params = list(ws) if name == "mlp" else ws
    elif name in ("resnet", "scan_resnet"):
        w1 = normal(1, (layers, width, 2 * width), s, dtype)
        w2 = normal(2, (layers, 2 * width, width), 0.5 * s, dtype)
        params = list(zip(w1, w2)) if name == "resnet" else (w1, w2)
    elif name == "transformer":
        out = s / np.sqrt(2 * layers)
        params = [tuple(normal(10 * l + i, shape, scale, dtype) for i, (shape, scale) in enumerate(
            [((width, width), s)] * 3 + [((width, width), out), ((width, 2 * width), s), ((2 * width, width), out)]))
            for l in range(layers)]
    else:
        raise KeyError(name)
    return globals()[name], params, x


def plain(fn, *args):
    """XLA's memory figures of ``jax.jit(fn)`` for these arguments."""
    return measure(jax.jit(fn).lower(*args).compile())


def assert_tree_close(got, want, rtol):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        scale = max(float(np.max(np.abs(w))), 1e-30)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * scale)
