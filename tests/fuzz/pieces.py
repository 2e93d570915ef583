"""The fuzzer's vocabulary: program pieces by role, in tables new rules plug into.

A random program (see :mod:`tests.fuzz.programs`) is a pipeline of pieces:

    small inputs ─[input]*─▶ x, y ─[expand]─▶ A (large) ─[map]*─▶ A ─[reduce]─▶ out ─[post]*─▶ out

wrapped by at most one ``wrap`` piece; a ``custom`` piece may put ``[map]* ─▶ [reduce]`` inside a
function with custom derivatives (its rule the true derivative, so the numbers stay those of the program);
a ``frontier`` piece (seeds of the frontier vocabulary only, drawn last) adds a map before the reducer
or replaces the reducer (see the last table). ``expand`` builds a tensor larger than the threshold from small
inputs, ``map`` pieces keep it large, ``reduce`` makes it small again: the shape every pass looks for
(a split region, an expanded distance, a product chain). ``input`` pieces act on the small operands
before they meet, ``post`` pieces on the small result.

Adding a primitive is adding an entry: decorate a maker with ``@piece(role, name, ...)``. A maker is
called at build time with a :class:`~tests.fuzz.programs.Draw` ``r`` (all randomness goes through it),
the program's :class:`~tests.fuzz.programs.Ctx` ``c`` (``c.input(shape)`` adds an input, ``c.dtype``,
``c.is_float``) and the abstract value it acts on; it returns ``(fn, description)`` where ``fn`` is
called at trace time: ``fn(value, args)`` (``expand``: ``fn(x, y, args)``; ``reduce`` returns a tuple
whose first element is the main result, the others pass through unchanged).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})
WIDE_FLOATS = frozenset({"float32", "float64"})  # LAPACK-backed pieces
ALL = FLOATS | {"int32"}


@dataclasses.dataclass(frozen=True)
class Piece:
    """One entry of a role's table."""

    role: str                   # input | expand | map | reduce | post | wrap
    name: str
    make: Callable
    dtypes: frozenset = ALL
    ranks: tuple = (1, 2, 3)    # ranks of the value it accepts (expand: unused)
    exact: bool = True          # keeps grid inputs exact (no transcendentals): index outputs then tie exactly
    indices: bool = False       # produces index outputs (compared exactly)
    weight: float = 1.0         # relative frequency within its role
    #: frontier pieces: "map" (keeps the large value's shape and dtype, inserted before the reducer) or
    #: "reduce" (replaces the reducer; drawn only where no post piece reads the reducer's result)
    stage: str = ""
    differentiable: bool = True  # reverse-mode differentiable (a while_loop is not)
    accepts: Callable | None = None  # a predicate on the abstract value it acts on, beside ``ranks``


PIECES: dict[str, dict[str, Piece]] = {r: {} for r in ("input", "expand", "map", "reduce", "post", "wrap", "custom",
                                                         "frontier")}


def piece(role: str, name: str, **meta):
    """Register ``make`` as the piece ``role:name``."""
    def register(make):
        PIECES[role][name] = Piece(role, name, make, **meta)
        return make
    return register


def _axis(r, rank: int) -> int:
    return r.integer(0, rank - 1) if rank else 0


def _consts(c, value):
    return jnp.asarray(value, c.dtype)


# ---------------------------------------------------------------------------------------------- input
@piece("input", "strided_rows")
def _strided_rows(r, c, aval):
    start, step = r.integer(0, 2), r.choice([2, 3])
    return (lambda v, a: v[start::step]), f"v[{start}::{step}]"


@piece("input", "pad")
def _pad(r, c, aval):
    lo, hi = r.integer(0, 3), r.integer(0, 3)
    return (lambda v, a: jnp.pad(v, [(lo, hi)] + [(0, 0)] * (v.ndim - 1))), f"pad({lo},{hi})"


@piece("input", "concat")
def _concat(r, c, aval):
    k = r.integer(1, 5)
    return (lambda v, a: jnp.concatenate([v, v[:k] * 2], 0)), f"concat(v, 2*v[:{k}])"


@piece("input", "take")
def _take(r, c, aval):
    n = aval.shape[0]
    if n == 0:
        return (lambda v, a: v), "identity"
    rows = r.integer(1, max(1, 2 * n))
    idx = c.input((rows,), kind="index", high=n)
    return (lambda v, a: v[a[idx]]), f"v[idx({rows})]"


@piece("input", "scatter_add")
def _scatter_add(r, c, aval):
    n = aval.shape[0]
    if n == 0:
        return (lambda v, a: v), "identity"
    k = r.integer(1, 6)
    idx = c.input((k,), kind="index", high=n)
    upd = c.input((k,) + tuple(aval.shape[1:]))
    return (lambda v, a: v.at[a[idx]].add(a[upd])), f"v.at[idx({k})].add(u)"


@piece("input", "sort")
def _sort_rows(r, c, aval):
    return (lambda v, a: jnp.sort(v, axis=0)), "sort(v, 0)"


@piece("input", "cumsum")
def _cumsum_rows(r, c, aval):
    return (lambda v, a: jnp.cumsum(v, axis=0, dtype=v.dtype)), "cumsum(v, 0)"


@piece("input", "reverse_transpose")
def _reverse_transpose(r, c, aval):
    return (lambda v, a: v[::-1].T.T), "v[::-1].T.T"


# --------------------------------------------------------------------------------------------- expand
# x: (n, d), y: (m, d) -> A with axes (n, m) or (n, m, d)
@piece("expand", "diff", weight=2)
def _diff(r, c, xa, ya):
    return (lambda x, y, a: x[:, None, :] - y[None]), "x[:,None]-y[None]"


@piece("expand", "sum")
def _sum(r, c, xa, ya):
    return (lambda x, y, a: x[:, None, :] + y[None]), "x[:,None]+y[None]"


@piece("expand", "product")
def _product(r, c, xa, ya):
    return (lambda x, y, a: x[:, None, :] * y[None]), "x[:,None]*y[None]"


@piece("expand", "sqdist", weight=2)
def _sqdist(r, c, xa, ya):
    return (lambda x, y, a: jnp.sum((x[:, None, :] - y[None]) ** 2, -1)), "sum((x[:,None]-y[None])**2,-1)"


@piece("expand", "l1")
def _l1(r, c, xa, ya):
    return (lambda x, y, a: jnp.sum(jnp.abs(x[:, None, :] - y[None]), -1)), "sum(|x[:,None]-y[None]|,-1)"


@piece("expand", "dot", weight=2)
def _dot(r, c, xa, ya):
    return (lambda x, y, a: x @ y.T), "x@y.T"


@piece("expand", "einsum")
def _einsum(r, c, xa, ya):
    spec = r.choice(["nd,md->nm", "nd,md->mn", "nd,md->nmd"])
    return (lambda x, y, a: jnp.einsum(spec, x, y)), f"einsum('{spec}')"


@piece("expand", "kernel", dtypes=FLOATS, exact=False)
def _kernel(r, c, xa, ya):
    return (lambda x, y, a: jnp.exp(-0.5 * jnp.sum((x[:, None, :] - y[None]) ** 2, -1))), "exp(-sqdist/2)"


@piece("expand", "outer")
def _outer(r, c, xa, ya):
    return (lambda x, y, a: jnp.sum(x, 1)[:, None] * jnp.sum(y, 1)[None]), "sum(x,1)[:,None]*sum(y,1)[None]"


# ------------------------------------------------------------------------------------------------ map
@piece("map", "sin", dtypes=FLOATS, exact=False)
def _sin(r, c, aval):
    return (lambda v, a: jnp.sin(v)), "sin"


@piece("map", "tanh", dtypes=FLOATS, exact=False)
def _tanh(r, c, aval):
    return (lambda v, a: jnp.tanh(v)), "tanh"


@piece("map", "gauss", dtypes=FLOATS, exact=False)
def _gauss(r, c, aval):
    return (lambda v, a: jnp.exp(-0.5 * v * v)), "exp(-v*v/2)"


@piece("map", "softplus", dtypes=FLOATS, exact=False)
def _softplus(r, c, aval):
    return (lambda v, a: jax.nn.softplus(v)), "softplus"


@piece("map", "relu")
def _relu(r, c, aval):
    return (lambda v, a: jnp.maximum(v, 0)), "maximum(v,0)"


@piece("map", "leaky_where")
def _leaky(r, c, aval):
    return (lambda v, a: jnp.where(v > 0, v, -2 * v)), "where(v>0,v,-2v)"


@piece("map", "square", weight=1.5)
def _square(r, c, aval):
    return (lambda v, a: v * v), "v*v"


@piece("map", "abs")
def _abs(r, c, aval):
    return (lambda v, a: jnp.abs(v)), "abs"


@piece("map", "clip")
def _clip(r, c, aval):
    return (lambda v, a: jnp.clip(v, -1, 2)), "clip(-1,2)"


@piece("map", "affine")
def _affine(r, c, aval):
    s, t = r.choice([2, -1, 3]), r.choice([0, 1, -2])
    return (lambda v, a: v * s + t), f"{s}*v+{t}"


@piece("map", "cube", dtypes=FLOATS | {"int32"})
def _cube(r, c, aval):
    return (lambda v, a: lax.integer_pow(v, 3)), "v**3"


@piece("map", "diag_mask")
def _diag_mask(r, c, aval):
    def fn(v, a):
        eye = lax.broadcasted_iota(jnp.int32, v.shape, 0) == lax.broadcasted_iota(jnp.int32, v.shape, 1)
        return jnp.where(eye, jnp.zeros((), v.dtype), v)
    return fn, "where(i==j,0,v)"


@piece("map", "nan_guard", dtypes=FLOATS)
def _nan_guard(r, c, aval):
    return (lambda v, a: jnp.where(jnp.isnan(v), jnp.zeros((), v.dtype), v)), "where(isnan(v),0,v)"


@piece("map", "safe_sqrt", dtypes=FLOATS, exact=False)
def _safe_sqrt(r, c, aval):
    def fn(v, a):
        pos = v > 0
        return jnp.where(pos, jnp.sqrt(jnp.where(pos, v, 1)), 0)
    return fn, "where(v>0,sqrt(where(v>0,v,1)),0)"


@piece("map", "widen", dtypes=FLOATS - {"float64"})
def _widen(r, c, aval):
    return (lambda v, a: (v.astype(jnp.float32) * 2).astype(v.dtype)), "(f32(v)*2).astype"


@piece("map", "swap01", ranks=(2, 3))
def _swap01(r, c, aval):
    return (lambda v, a: jnp.swapaxes(v, 0, 1)), "swapaxes(0,1)"


@piece("map", "strided", ranks=(2, 3), weight=0.5)
def _strided_map(r, c, aval):
    axis, step = _axis(r, 2), r.choice([2, 3])
    return (lambda v, a: lax.slice_in_dim(v, 0, v.shape[axis], step, axis)), f"v[::{step}] on axis {axis}"


@piece("map", "gather_cols", ranks=(2, 3), weight=0.5)
def _gather_cols(r, c, aval):
    m = aval.shape[1]
    if m == 0:
        return (lambda v, a: v), "identity"
    k = r.integer(1, m)
    idx = c.input((k,), kind="index", high=m)
    return (lambda v, a: v[:, a[idx]]), f"v[:, idx({k})]"


@piece("map", "cumsum_last", ranks=(2, 3), weight=0.5)
def _cumsum_last(r, c, aval):
    return (lambda v, a: jnp.cumsum(v, axis=-1, dtype=v.dtype)), "cumsum(v,-1)"


@piece("map", "scale_cols", ranks=(2, 3))
def _scale_cols(r, c, aval):
    w = c.input(aval.shape[1:2])
    extra = (None,) * (len(aval.shape) - 2)
    return (lambda v, a: v * a[w][(None, slice(None)) + extra]), "v*w[None,:]"


# --------------------------------------------------------------------------------------------- reduce
@piece("reduce", "sum", weight=3)
def _rsum(r, c, aval):
    axis = r.choice([None] + list(range(len(aval.shape))))
    return (lambda v, a: (jnp.sum(v, axis=axis),)), f"sum(axis={axis})"


@piece("reduce", "mean", dtypes=FLOATS)
def _rmean(r, c, aval):
    axis = _axis(r, len(aval.shape))
    return (lambda v, a: (jnp.mean(v, axis=axis),)), f"mean(axis={axis})"


@piece("reduce", "max", weight=1.5)
def _rmax(r, c, aval):
    axis = _axis(r, len(aval.shape))
    return (lambda v, a: (jnp.max(v, axis=axis, initial=None) if v.shape[axis] else jnp.sum(v, axis=axis),)), \
        f"max(axis={axis})"


@piece("reduce", "min")
def _rmin(r, c, aval):
    axis = _axis(r, len(aval.shape))
    return (lambda v, a: (jnp.min(v, axis=axis) if v.shape[axis] else jnp.sum(v, axis=axis),)), f"min(axis={axis})"


@piece("reduce", "argmax", indices=True)
def _rargmax(r, c, aval):
    axis = _axis(r, len(aval.shape))
    op = r.choice(["argmax", "argmin"])
    f = getattr(jnp, op)
    return (lambda v, a: (f(v, axis=axis),) if v.shape[axis] else (jnp.sum(v, axis=axis),)), f"{op}(axis={axis})"


@piece("reduce", "top_k", indices=True)
def _rtop_k(r, c, aval):
    k = r.integer(1, 4)
    def fn(v, a):
        kk = min(k, v.shape[-1])
        return lax.top_k(v, kk) if kk else (jnp.sum(v, -1),)
    return fn, f"top_k({k})"


@piece("reduce", "logsumexp", dtypes=FLOATS, exact=False)
def _rlse(r, c, aval):
    axis = _axis(r, len(aval.shape))
    return (lambda v, a: (jax.nn.logsumexp(v, axis=axis),)), f"logsumexp(axis={axis})"


@piece("reduce", "softmax_matvec", dtypes=FLOATS, ranks=(2,), exact=False)
def _rsoftmax(r, c, aval):
    w = c.input(aval.shape[1:2])
    return (lambda v, a: (jax.nn.softmax(v, axis=-1) @ a[w],)), "softmax(v,-1)@w"


@piece("reduce", "matvec", ranks=(2, 3), weight=2)
def _rmatvec(r, c, aval):
    w = c.input(aval.shape[-1:])
    return (lambda v, a: (v @ a[w],)), "v@w"


@piece("reduce", "vecmat", ranks=(2, 3))
def _rvecmat(r, c, aval):
    w = c.input(aval.shape[:1])
    return (lambda v, a: (jnp.tensordot(a[w], v, axes=(0, 0)),)), "tensordot(w,v,0)"


@piece("reduce", "matmat", ranks=(2,))
def _rmatmat(r, c, aval):
    k = r.integer(1, 3)
    w = c.input((aval.shape[1], k))
    return (lambda v, a: (v @ a[w],)), f"v@W(.,{k})"


@piece("reduce", "count", weight=0.5)
def _rcount(r, c, aval):
    axis = _axis(r, len(aval.shape))
    op = r.choice(["any", "all", "count"])
    def fn(v, a):
        pos = v > 0
        if op == "count":
            return (jnp.sum(pos, axis=axis, dtype=jnp.int32),)
        return (getattr(jnp, op)(pos, axis=axis).astype(jnp.int32),)
    return fn, f"{op}(v>0, axis={axis})"


@piece("reduce", "cumsum_other", ranks=(2,), weight=0.5)
def _rcumsum_other(r, c, aval):
    return (lambda v, a: (jnp.sum(jnp.cumsum(v, axis=1, dtype=v.dtype), axis=1),)), "sum(cumsum(v,1),1)"


@piece("reduce", "var", dtypes=WIDE_FLOATS, exact=False, weight=0.5)
def _rvar(r, c, aval):
    axis = _axis(r, len(aval.shape))
    return (lambda v, a: (jnp.var(v, axis=axis),)), f"var(axis={axis})"


# ----------------------------------------------------------------------------------------------- post
@piece("post", "strided_slice")
def _pstrided(r, c, aval):
    step = r.choice([2, 3])
    return (lambda v, a: v[::step]), f"out[::{step}]"


@piece("post", "transpose", ranks=(2, 3))
def _ptranspose(r, c, aval):
    return (lambda v, a: v.T), "out.T"


@piece("post", "reshape")
def _preshape(r, c, aval):
    return (lambda v, a: v.reshape(-1)), "out.reshape(-1)"


@piece("post", "pad")
def _ppad(r, c, aval):
    return (lambda v, a: jnp.pad(v, [(1, 2)] + [(0, 0)] * (v.ndim - 1))), "pad(out,(1,2))"


@piece("post", "concat")
def _pconcat(r, c, aval):
    return (lambda v, a: jnp.concatenate([v, -v], 0)), "concat(out,-out)"


@piece("post", "sort")
def _psort(r, c, aval):
    return (lambda v, a: jnp.sort(v, axis=-1)), "sort(out,-1)"


@piece("post", "cumsum")
def _pcumsum(r, c, aval):
    return (lambda v, a: jnp.cumsum(v, axis=0, dtype=v.dtype)), "cumsum(out,0)"


@piece("post", "top_k")
def _ptop_k(r, c, aval):
    def fn(v, a):
        k = min(2, v.shape[-1])
        return lax.top_k(v, k)[0] if k else v
    return fn, "top_k(out,2)[0]"


@piece("post", "where")
def _pwhere(r, c, aval):
    return (lambda v, a: jnp.where(v > 0, v, 0)), "where(out>0,out,0)"


@piece("post", "take")
def _ptake(r, c, aval):
    n = aval.shape[0]
    if n == 0:
        return (lambda v, a: v), "identity"
    idx = c.input((3,), kind="index", high=n)
    return (lambda v, a: v[a[idx]]), "out[idx(3)]"


@piece("post", "scatter_set")
def _pscatter(r, c, aval):
    n = aval.shape[0]
    if n == 0:
        return (lambda v, a: v), "identity"
    idx = c.input((2,), kind="index", high=n)
    return (lambda v, a: v.at[a[idx]].set(v[0])), "out.at[idx(2)].set(out[0])"


@piece("post", "softmax", dtypes=FLOATS, exact=False)
def _psoftmax(r, c, aval):
    return (lambda v, a: jax.nn.softmax(v, axis=-1)), "softmax(out,-1)"


@piece("post", "dot_small", ranks=(1, 2))
def _pdot(r, c, aval):
    w = c.input((aval.shape[-1], 2))
    return (lambda v, a: v @ a[w]), "out@W(.,2)"


def _spd(v):
    """A well-conditioned SPD matrix from any small result."""
    flat = v.reshape(-1)[:48].astype(v.dtype)
    flat = jnp.where(jnp.isfinite(flat), flat, 0)
    n = flat.shape[0]
    g = flat[:, None] - flat[None, :]
    return jnp.exp(-g * g) + (1.0 + n) * jnp.eye(n, dtype=v.dtype), flat


@piece("post", "cholesky_solve", dtypes=WIDE_FLOATS, exact=False, weight=0.7)
def _pcholesky(r, c, aval):
    def fn(v, a):
        k, b = _spd(v)
        if b.shape[0] == 0:
            return v
        chol = jnp.linalg.cholesky(k)
        z = lax.linalg.triangular_solve(chol, b[:, None], left_side=True, lower=True)
        return lax.linalg.triangular_solve(chol, z, left_side=True, lower=True, transpose_a=True)[:, 0]
    return fn, "cholesky+triangular_solve"


@piece("post", "solve_triangular", dtypes=WIDE_FLOATS, exact=False, weight=0.5)
def _ptrsolve(r, c, aval):
    lower = r.boolean()
    def fn(v, a):
        k, b = _spd(v)
        if b.shape[0] == 0:
            return v
        t = jnp.tril(k) if lower else jnp.triu(k)
        return jax.scipy.linalg.solve_triangular(t, b, lower=lower)
    return fn, f"solve_triangular(lower={lower})"


@piece("post", "linalg_solve", dtypes=WIDE_FLOATS, exact=False, weight=0.5)
def _psolve(r, c, aval):
    def fn(v, a):
        k, b = _spd(v)
        return jnp.linalg.solve(k, b) if b.shape[0] else v
    return fn, "linalg.solve"


# ----------------------------------------------------------------------------------------------- wrap
# make(r, c) -> (wrap(fn) -> fn, leading batch axis added to every input or None, description)
@piece("wrap", "vmap", weight=1.5)
def _wvmap(r, c):
    b = r.integer(1, 3)
    return (lambda fn: jax.vmap(fn)), b, f"vmap(B={b})"


@piece("wrap", "scan")
def _wscan(r, c):
    length = r.integer(1, 3)
    def wrap(fn):
        return lambda *args: lax.scan(lambda carry, xs: (carry, fn(*xs)), None, args)[1]
    return wrap, length, f"scan(L={length})"


@piece("wrap", "fori")
def _wfori(r, c):
    data = c.data_inputs()
    def wrap(fn):
        def loop(*args):
            outs = jax.eval_shape(fn, *args)
            def body(i, carry):
                moved = list(args)
                for k in data:
                    moved[k] = args[k] + i.astype(args[k].dtype)
                return fn(*moved)
            zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), outs)
            return lax.fori_loop(0, 2, body, zeros)
        return loop
    return wrap, None, "fori(2, inputs+i)"


@piece("wrap", "cond")
def _wcond(r, c):
    data = c.data_inputs()
    def wrap(fn):
        def branch(*args):
            return lax.cond(jnp.sum(args[data[0]]) > 0, fn,
                            lambda *a: fn(*[-v if k in data else v for k, v in enumerate(a)]), *args)
        return branch
    return wrap, None, "cond(sum(x)>0, f, f(-inputs))"


@piece("wrap", "checkpoint")
def _wcheckpoint(r, c):
    return (lambda fn: jax.checkpoint(fn)), None, "checkpoint"


@piece("wrap", "jit")
def _wjit(r, c):
    return (lambda fn: jax.jit(fn)), None, "jax.jit"


@piece("wrap", "grad", dtypes=FLOATS)
def _wgrad(r, c):
    """The program becomes the gradient of a fixed linear functional of its float outputs."""
    from tests.fuzz.programs import float_inputs, linear_loss
    data = float_inputs(c.inputs)
    def wrap(fn):
        def grads(*args):
            def loss(*diff):
                full = list(args)
                for k, v in zip(data, diff):
                    full[k] = v
                return linear_loss(fn(*full))
            return jax.value_and_grad(loss, argnums=tuple(range(len(data))))(*[args[k] for k in data])
        return grads
    return wrap, None, "value_and_grad(linear functional)"


# --------------------------------------------------------------------------------------------- custom
# make(r, c) -> (wrap(stage) -> stage, description): ``stage(value, args)`` is the large value's maps and
# reducer; the wrapped stage computes the same inside a custom_jvp / custom_vjp function, whose rule is
# the stage's own derivative (written as optimal-transport libraries write theirs: a non-array
# ``nondiff_argnums`` argument, the rule taking it first). Drawn after everything else (programs.py),
# so a seed's program is otherwise the one it drew before these pieces existed.
@piece("custom", "custom_jvp", dtypes=FLOATS)
def _ccustom_jvp(r, c):
    def wrap(stage):
        import functools

        @functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
        def inner(value, scale, args):
            return stage(value * scale, list(args))

        @inner.defjvp
        def rule(scale, primals, tangents):
            (value, args), (dvalue, dargs) = primals, tangents
            return jax.jvp(lambda v, a: stage(v * scale, list(a)), (value, args), (dvalue, dargs))

        return lambda value, args: inner(value, 1, tuple(args))
    return wrap, "custom_jvp(maps+reduce, nondiff scale)"


@piece("custom", "custom_vjp", dtypes=FLOATS)
def _ccustom_vjp(r, c):
    def wrap(stage):
        import functools

        @functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
        def inner(value, scale, args):
            return stage(value * scale, list(args))

        def fwd(value, scale, args):
            return inner(value, scale, args), (value, args)

        def bwd(scale, res, ct):
            return jax.vjp(lambda v, a: stage(v * scale, list(a)), *res)[1](ct)

        inner.defvjp(fwd, bwd)
        return lambda value, args: inner(value, 1, tuple(args))
    return wrap, "custom_vjp(maps+reduce, nondiff scale)"


# ------------------------------------------------------------------------------------------- frontier
# What landed after the tables above were written (issue 28): carried state along a long axis (prefix
# sums, scans), online softmax/logsumexp whose logits are read elsewhere too (a positive column, a
# diagonal, a mask), gathers, scatters and segment sums, triangular solves inside a split region,
# sub-programs (scan, while, cond) and optimal-transport-style custom derivatives. Drawn last, and only
# for seeds of the frontier vocabulary (``programs.vocabulary``), so that every earlier seed draws the
# program it drew before. A ``map`` stage keeps the large value's shape and dtype and runs before the
# reducer; a ``reduce`` stage replaces the reducer where no post piece reads its result.
def _long_axis(r, shape) -> int:
    """Mostly the longest axis (where carried state along it matters), else any."""
    if r.boolean(0.75):
        return max(range(len(shape)), key=lambda k: shape[k])
    return _axis(r, len(shape))


def _nonempty(aval) -> bool:
    return all(s > 0 for s in aval.shape)


@piece("frontier", "cumsum_long", stage="map")
def _fcumsum(r, c, aval):
    axis, reverse = _long_axis(r, aval.shape), r.boolean(0.3)
    return (lambda v, a: lax.cumsum(v, axis=axis, reverse=reverse)), f"cumsum(axis={axis}, reverse={reverse})"


@piece("frontier", "cummax_long", stage="map")
def _fcummax(r, c, aval):
    axis, reverse, op = _long_axis(r, aval.shape), r.boolean(0.3), r.choice(["cummax", "cummin"])
    f = getattr(lax, op)
    return (lambda v, a: f(v, axis=axis, reverse=reverse)), f"{op}(axis={axis}, reverse={reverse})"


@piece("frontier", "cumprod_long", stage="map", dtypes=FLOATS, exact=False)
def _fcumprod(r, c, aval):
    axis = _long_axis(r, aval.shape)
    def fn(v, a):  # factors near one, so the running product neither vanishes nor overflows
        return lax.cumprod(1 + jnp.asarray(0.01, v.dtype) * jnp.tanh(v), axis=axis)
    return fn, f"cumprod(1+0.01*tanh(v), axis={axis})"


@piece("frontier", "cumlogsumexp_long", stage="map", dtypes=FLOATS, exact=False)
def _fcumlse(r, c, aval):
    axis = _long_axis(r, aval.shape)
    return (lambda v, a: lax.cumlogsumexp(v, axis=axis)), f"cumlogsumexp(axis={axis})"


@piece("frontier", "scan_carry", stage="map")
def _fscan(r, c, aval):
    """A running state carried through a ``lax.scan`` along the long axis (a linear recurrence)."""
    axis = _long_axis(r, aval.shape)
    decay = 1 if not c.is_float else r.choice([1, 0.5, 0.9])

    def fn(v, a):
        moved = jnp.moveaxis(v, axis, 0)
        def step(carry, row):
            new = (carry * jnp.asarray(decay, v.dtype) + row).astype(v.dtype)
            return new, new
        _, out = lax.scan(step, jnp.zeros(moved.shape[1:], v.dtype), moved)
        return jnp.moveaxis(out, 0, axis)
    return fn, f"scan(carry*{decay}+row, axis={axis})"


@piece("frontier", "while_map", stage="map", differentiable=False)
def _fwhile(r, c, aval):
    def fn(v, a):
        def body(carry):
            i, w = carry
            return i + 1, w * 2 + 1
        return lax.while_loop(lambda carry: carry[0] < 2, body, (jnp.int32(0), v))[1]
    return fn, "while(i<2: v*2+1)"


@piece("frontier", "cond_map", stage="map")
def _fcond(r, c, aval):
    def fn(v, a):  # the predicate reads one entry, so no reordered sum can flip it
        pred = jnp.sum(v.reshape(-1)[:1]) > 0
        return lax.cond(pred, lambda w: w * 2, lambda w: w - 1, v)
    return fn, "cond(v.flat[0]>0, 2v, v-1)"


@piece("frontier", "take_long", stage="map")
def _ftake(r, c, aval):
    """A gather along the long axis by indices as long as it (duplicates, every row's source random)."""
    axis = _long_axis(r, aval.shape)
    n = aval.shape[axis]
    if n == 0:
        return (lambda v, a: v), "identity"
    idx = c.input((n,), kind="index", high=n)
    return (lambda v, a: jnp.take(v, a[idx], axis=axis)), f"take(v, idx({n}), axis={axis})"


@piece("frontier", "scatter_rows", stage="map")
def _fscatter_rows(r, c, aval):
    n = aval.shape[0]
    if n == 0:
        return (lambda v, a: v), "identity"
    k = r.integer(1, 8)
    idx, src = c.input((k,), kind="index", high=n), c.input((k,), kind="index", high=n)
    return (lambda v, a: v.at[a[idx]].add(v[a[src]] * 2)), f"v.at[idx({k})].add(2*v[idx({k})])"


@piece("frontier", "solve_triangular", weight=3, stage="map", dtypes=WIDE_FLOATS, ranks=(2,), exact=False,
       accepts=lambda aval: 0 < min(aval.shape) <= 64)
def _fsolve(r, c, aval):
    """``solve_triangular(L, K)`` with the kernel's short axis against a small factor, its long axis
    along the right-hand sides (as ``solve_triangular(L, K(X, Z))`` in a sparse GP)."""
    lower = r.boolean()
    left = aval.shape[0] <= aval.shape[1]
    k = aval.shape[0] if left else aval.shape[1]
    p = c.input((k, k))

    def fn(v, a):
        part = (jnp.tril if lower else jnp.triu)(jnp.asarray(0.3, v.dtype) * jnp.tanh(a[p]))
        factor = part + 2 * jnp.eye(k, dtype=v.dtype)
        if left:
            return jax.scipy.linalg.solve_triangular(factor, v, lower=lower)
        return jax.scipy.linalg.solve_triangular(factor, v.T, lower=lower).T
    return fn, f"solve_triangular(L({k}), {'v' if left else 'v.T'}, lower={lower})"


def _lse_reader(head):
    """A reduce stage ``head(v, lse)``: the logits' logsumexp along axis 1 and another read of them."""
    def make(r, c, aval):
        fn, desc = head(r, c, aval)
        return (lambda v, a: (fn(v, a),)), desc
    return make


@piece("frontier", "contrastive_lse", weight=3, stage="reduce", dtypes=FLOATS, ranks=(2, 3), exact=False,
       accepts=lambda aval: aval.shape[1] > 0)
@_lse_reader
def _fcontrastive(r, c, aval):
    col = r.integer(0, min(2, aval.shape[1] - 1))
    return (lambda v, a: jax.nn.logsumexp(v, axis=1) - v[:, col]), f"logsumexp(v,1) - v[:,{col}]"


@piece("frontier", "lse_minus_diag", weight=3, stage="reduce", dtypes=FLOATS, ranks=(2,), exact=False,
       accepts=lambda aval: aval.shape[1] > 0)
@_lse_reader
def _fdiag(r, c, aval):
    k = min(aval.shape)
    return (lambda v, a: jax.nn.logsumexp(v, axis=1)[:k] - jnp.diagonal(v)), "logsumexp(v,1)[:k] - diag(v)"


@piece("frontier", "masked_lse", weight=3, stage="reduce", dtypes=FLOATS, ranks=(2, 3), exact=False)
@_lse_reader
def _fmasked(r, c, aval):
    offset = r.choice([0, aval.shape[1] // 2])
    def fn(v, a):
        i = lax.broadcasted_iota(jnp.int32, v.shape, 0)
        j = lax.broadcasted_iota(jnp.int32, v.shape, 1)
        return jax.nn.logsumexp(jnp.where(j <= i + offset, v, -jnp.inf), axis=1)
    return fn, f"logsumexp(where(j<=i+{offset}, v, -inf), 1)"


@piece("frontier", "softmax_minus_col", weight=3, stage="reduce", dtypes=FLOATS, ranks=(2,), exact=False,
       accepts=lambda aval: aval.shape[1] > 0)
def _fsoftmax_col(r, c, aval):
    w = c.input(aval.shape[1:2])
    return (lambda v, a: (jax.nn.softmax(v, axis=-1) @ a[w] - v[:, 0],)), "softmax(v,-1)@w - v[:,0]"


@piece("frontier", "segment_sum", weight=2, stage="reduce", ranks=(2, 3))
def _fsegment(r, c, aval):
    axis, k = r.choice([0, 1]), r.integer(1, 9)
    labels = c.input((aval.shape[axis],), kind="index", high=k + 2)   # -1 and k: out of range, dropped

    def fn(v, a):
        moved = jnp.moveaxis(v, axis, 0)
        return (jnp.moveaxis(jax.ops.segment_sum(moved, a[labels] - 1, num_segments=k), 0, axis),)
    return fn, f"segment_sum(axis={axis}, {k} segments)"


@piece("frontier", "scatter_reduce", weight=1.5, stage="reduce", ranks=(2, 3))
def _fscatter_reduce(r, c, aval):
    k, op = r.integer(1, 9), r.choice(["add", "max", "min"])
    idx = c.input(aval.shape[:1], kind="index", high=k)

    def fn(v, a):
        return (getattr(jnp.zeros((k,) + v.shape[1:], v.dtype).at[a[idx]], op)(v),)
    return fn, f"zeros({k},...).at[idx].{op}(v)"


@piece("frontier", "take_along_reduce", weight=1.5, stage="reduce", ranks=(2,), accepts=lambda aval: aval.shape[1] > 0)
def _ftake_along(r, c, aval):
    idx = c.input((aval.shape[0], 3), kind="index", high=aval.shape[1])
    return (lambda v, a: (jnp.take_along_axis(v, a[idx], axis=1),)), "take_along_axis(v, idx(n,3), 1)"


@piece("frontier", "ott_logsumexp", weight=2, stage="reduce", dtypes=FLOATS, exact=False)
def _fott(r, c, aval):
    """``logsumexp`` as optimal-transport libraries define it: ``custom_jvp`` with
    ``nondiff_argnums=(1, 2, 4)`` (axis, keepdims, return_sign) and a ``defjvp`` rule."""
    import functools
    axis = _axis(r, len(aval.shape))

    @functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 4))
    def logsumexp(mat, axis=None, keepdims=False, b=None, return_sign=False):
        return jax.nn.logsumexp(mat, axis=axis, keepdims=keepdims, b=b, return_sign=return_sign)

    @logsumexp.defjvp
    def rule(axis, keepdims, return_sign, primals, tangents):
        (mat, b), (dmat, _) = primals, tangents
        lse = logsumexp(mat, axis, True, b, return_sign)
        out = lse if keepdims else jnp.squeeze(lse, axis)
        return out, jnp.sum(jnp.exp(mat - lse) * dmat, axis=axis, keepdims=keepdims)

    return (lambda v, a: (logsumexp(v, axis, False, None, False),)), \
        f"custom_jvp logsumexp(axis={axis}, nondiff_argnums=(1,2,4))"


@piece("frontier", "custom_vjp_logsumexp", weight=2, stage="reduce", dtypes=FLOATS, exact=False)
def _fcvjp(r, c, aval):
    import functools
    axis = _axis(r, len(aval.shape))

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
    def logsumexp(mat, axis):
        return jax.nn.logsumexp(mat, axis=axis)

    def fwd(mat, axis):
        out = logsumexp(mat, axis)
        return out, (mat, out)

    def bwd(axis, res, ct):
        mat, out = res
        return (jnp.exp(mat - jnp.expand_dims(out, axis)) * jnp.expand_dims(ct, axis),)

    logsumexp.defvjp(fwd, bwd)
    return (lambda v, a: (logsumexp(v, axis),)), f"custom_vjp logsumexp(axis={axis}, nondiff_argnums=(1,))"


@piece("frontier", "deep_chain", weight=2, stage="map", dtypes=FLOATS, exact=False)
def _fdeep(r, c, aval):
    """Layers of ``v + tanh(s_k * v)``, each keeping a residual as large as ``v`` for its gradient: what
    the ``remat`` pass recomputes under a memory limit."""
    layers = r.integer(4, 8)
    scales = c.input((layers,))

    def fn(v, a):
        for k in range(layers):
            v = v + jnp.tanh(a[scales][k] * v)
        return v
    return fn, f"{layers} layers of v+tanh(s_k*v)"


@piece("frontier", "python_loop", weight=2, stage="map", dtypes=FLOATS, exact=False)
def _fpython_loop(r, c, aval):
    """A linear recurrence along the long axis written as a Python loop over its first rows (a chain of
    unrolled steps the adjoint pass rolls back into a scan), decay constant or selective (from the row)."""
    axis, selective = _long_axis(r, aval.shape), r.boolean()
    steps = r.integer(8, 13)

    def fn(v, a):
        moved = jnp.moveaxis(v, axis, 0)
        k = min(steps, moved.shape[0])
        h, rows = jnp.zeros(moved.shape[1:], v.dtype), []
        for t in range(k):
            decay = jax.nn.sigmoid(moved[t]) if selective else jnp.asarray(0.9, v.dtype)
            h = decay * h + moved[t]
            rows.append(h)
        out = jnp.concatenate([jnp.stack(rows), moved[k:]], 0) if k else moved
        return jnp.moveaxis(out, 0, axis)
    return fn, f"python loop over {steps} rows: h = {'sigmoid(row)' if selective else '0.9'}*h + row (axis={axis})"
