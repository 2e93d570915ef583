"""A user script for the dump CLI tests (importing it must not run anything heavy)."""

import jax.numpy as jnp

import hlopass


@hlopass.jit
def kernel_matvec(x, y, v):
    """Squared-exponential kernel matrix times a vector, naive distance."""
    d = jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, -1)
    return jnp.exp(-0.5 * d) @ v


def plain_square(x):
    return x * x


def raises_value_error(x):
    if x.shape[0] > 2:
        raise ValueError("the user's own check failed")
    return x


def raises_key_error(x):
    return {"a": x}["b"]


if __name__ == "__main__":
    raise SystemExit("must not run on import")
