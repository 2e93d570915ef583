"""Random programs built from the piece tables of :mod:`tests.fuzz.pieces`, their inputs, and a
hypothesis strategy.

All randomness of a program goes through a :class:`Draw`: :class:`RandomDraw` (a seeded
``random.Random``: the fuzzer's seeded batches, reproducible from ``(seed, index)``) or
:class:`HypothesisDraw` (``data.draw``: the :func:`programs` strategy, which hypothesis can shrink).
Both run the same :func:`draw_program`.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from tests.fuzz.pieces import PIECES, Piece

DTYPES = ["float32", "float32", "float32", "float16", "bfloat16", "int32", "float64"]
PRIMES = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97, 101,
          103, 107, 109, 113, 127, 131, 137, 139, 149, 151, 157, 163, 167, 173, 179, 181, 191, 193, 197, 199, 211,
          223, 227, 229, 233, 239, 241, 251, 257, 263, 269, 271, 277, 281, 283, 293, 307, 311, 313, 317, 331, 337,
          347, 349, 353, 359, 367, 373, 379, 383, 389, 397, 401, 409, 419, 421, 431, 433, 439, 443, 449, 457, 461,
          463, 467, 479, 487, 491, 499, 503, 509, 521, 523, 541, 547, 557, 563, 569, 571, 577, 587, 593, 599, 601,
          607, 613, 617, 619, 631, 641, 643, 647, 653, 659, 661, 673, 677, 683, 691, 701, 709, 719, 727, 733, 739,
          743, 751, 757, 761, 769, 773, 787, 797, 809, 811, 821, 823, 827, 829, 839, 853, 857, 859, 863, 877, 881,
          883, 887, 907, 911, 919, 929, 937, 941, 947, 953, 967, 971, 977, 983, 991, 997]
MAX_SIDE = 1500
#: How often a program of the frontier vocabulary draws a frontier piece (``pieces.py``, last table).
FRONTIER_P = 0.5


def vocabulary(seed) -> int:
    """The vocabulary a seed draws from: 1 for the seeds recorded before the frontier pieces existed
    (integers and ``r...``: their programs, and so the regression tests built on them, stay what they
    were), 2 for ``s...`` seeds (fresh seeds since, and the fixed ``s0``...), whose programs may draw a
    frontier piece and, in gradient modes, a memory limit."""
    return 2 if str(seed).startswith("s") else 1


# ----------------------------------------------------------------------------------------- draws
class Draw:
    """Where a program's choices come from."""

    def choice(self, seq):
        raise NotImplementedError

    def integer(self, lo: int, hi: int) -> int:
        raise NotImplementedError

    def boolean(self, p: float = 0.5) -> bool:
        raise NotImplementedError

    def weighted(self, items: list, weights: list[float]):
        """``items[k]`` with probability proportional to ``weights[k]`` (in steps of a quarter)."""
        pool = [item for item, w in zip(items, weights) for _ in range(max(1, round(4 * w)))]
        return self.choice(pool)


class RandomDraw(Draw):
    def __init__(self, seed):
        self.rng = random.Random(seed)

    def choice(self, seq):
        return seq[self.rng.randrange(len(seq))]

    def integer(self, lo, hi):
        return self.rng.randint(lo, hi)

    def boolean(self, p=0.5):
        return self.rng.random() < p


class HypothesisDraw(Draw):
    def __init__(self, draw):
        self.draw = draw

    def choice(self, seq):
        return self.draw(st.sampled_from(list(seq)))

    def integer(self, lo, hi):
        return self.draw(st.integers(lo, hi))

    def boolean(self, p=0.5):
        return self.draw(st.integers(0, 999)) < p * 1000


# ------------------------------------------------------------------------------------- programs
@dataclasses.dataclass(frozen=True)
class InputSpec:
    shape: tuple
    dtype: str
    kind: str = "data"     # data | index
    high: int = 0          # index inputs: values in [0, high)


class Ctx:
    """What a piece's maker sees: the program's dtype and inputs so far."""

    def __init__(self, dtype: str):
        self.dtype = dtype
        self.inputs: list[InputSpec] = []

    @property
    def is_float(self) -> bool:
        return self.dtype != "int32"

    def input(self, shape, dtype: str | None = None, kind: str = "data", high: int = 0) -> int:
        """Add an input; returns its position in ``args``."""
        dtype = "int32" if kind == "index" else (dtype or self.dtype)
        self.inputs.append(InputSpec(tuple(int(s) for s in shape), dtype, kind, high))
        return len(self.inputs) - 1

    def data_inputs(self) -> list[int]:
        return [k for k, s in enumerate(self.inputs) if s.kind == "data"]


def float_inputs(inputs) -> list[int]:
    """Positions of the float data inputs (the ones gradients are taken with respect to)."""
    return [k for k, s in enumerate(inputs) if s.kind == "data" and s.dtype != "int32"]


def linear_loss(outs) -> jax.Array:
    """A fixed linear functional of the float leaves of ``outs``, in float32 (a cosine pattern: never
    amplifies rounding the way a nonlinear loss would)."""
    total = jnp.zeros((), jnp.float32)
    for leaf in jax.tree_util.tree_leaves(outs):
        if jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.size:
            w = jnp.cos(jnp.arange(leaf.size, dtype=jnp.float32)).reshape(leaf.shape)
            total = total + jnp.sum(jnp.where(jnp.isfinite(leaf), leaf.astype(jnp.float32), 0) * w)
    return total


@dataclasses.dataclass
class Program:
    """A random program: ``fn(*args)`` returns a tuple of arrays."""

    label: str
    dtype: str
    pieces: tuple[str, ...]          # "role:name" of every piece used
    description: str
    inputs: list[InputSpec]
    fn: Callable
    input_seed: int
    grid: bool                       # inputs on a coarse integer grid: exact sums, many ties
    specials: str                    # "", "nan", "inf" or "nan+inf" in the data inputs
    indices: bool                    # has index outputs
    exact: bool = False              # grid inputs and only exact pieces: every value is exact
    batch_axis: int | None = None    # a wrap piece's leading axis on every input

    def __repr__(self) -> str:
        return f"<Program {self.label}: {self.description}>"

    def has(self, *names: str) -> bool:
        """Whether every ``role:name`` (or bare ``role:``) in ``names`` is among the pieces."""
        return all(any(p == n or (n.endswith(":") and p.startswith(n)) for p in self.pieces) for n in names)

    def make_inputs(self, lead: tuple = ()) -> list[np.ndarray]:
        """Deterministic inputs (``lead``: extra leading axes, e.g. for ``vmap`` outside)."""
        rng = np.random.default_rng(self.input_seed)
        out = []
        specials_left = self.specials
        for spec in self.inputs:
            shape = lead + ((self.batch_axis,) if self.batch_axis is not None else ()) + spec.shape
            if spec.kind == "index":
                out.append(rng.integers(0, max(spec.high, 1), size=shape).astype(np.int32))
                continue
            if spec.dtype == "int32":
                out.append(rng.integers(-3, 4, size=shape).astype(np.int32))
                continue
            if self.grid:
                values = rng.integers(-3, 4, size=shape).astype(np.float64)
            else:
                values = rng.normal(size=shape)
            if specials_left and values.size:
                flat = values.reshape(-1)
                for token in specials_left.split("+"):
                    for _ in range(rng.integers(1, 3)):
                        flat[rng.integers(0, flat.size)] = np.nan if token == "nan" else rng.choice([np.inf, -np.inf])
                specials_left = ""   # specials go into the first non-empty data input only
            out.append(values.astype(jnp.dtype(spec.dtype)))
        return out


def _aval(fn, inputs, *extra):
    args = [jax.ShapeDtypeStruct(s.shape, jnp.dtype(s.dtype)) for s in inputs]
    return jax.eval_shape(lambda *a: fn(*a), *args)


def _dtype_class(dtype) -> str:
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return dtype.name
    return "int32"


def _pick(r: Draw, role: str, dtype: str, rank: int | None = None, exclude=(), only_exact=False) -> Piece:
    table = [p for p in PIECES[role].values()
             if dtype in p.dtypes and (rank is None or rank in p.ranks) and p.name not in exclude
             and (p.exact or not only_exact)]
    return r.weighted(table, [p.weight for p in table])


def _size(r: Draw, approx: float) -> int:
    n = max(1, min(MAX_SIDE, int(round(approx))))
    if r.boolean(0.5):
        bigger = [p for p in PRIMES if p >= n]
        n = bigger[0] if bigger else n
    return n


def draw_program(r: Draw, threshold: int, label: str = "", x64: bool = False, allow_wrap: bool = True,
                 frontier: bool = False) -> Program:
    """Draw one program whose large intermediate is about ``threshold`` bytes or more; ``frontier``
    lets it draw, after every other choice, one piece of the frontier table."""
    dtype = r.choice([d for d in DTYPES if x64 or d != "float64"])
    ctx = Ctx(dtype)
    pieces: list[str] = []
    notes: list[str] = []
    itemsize = jnp.dtype(dtype).itemsize

    # The reducer comes first: index outputs need exact inputs (integer grid) for ties to be exact.
    reduce_probe = _pick(r, "reduce", dtype)
    indices = reduce_probe.indices
    grid = indices or r.boolean(0.2)
    only_exact = indices and dtype in ("float16", "bfloat16")
    expand = _pick(r, "expand", dtype, only_exact=only_exact)
    f_expand, expand_desc = expand.make(r, ctx, None, None)
    rank = len(jax.eval_shape(lambda x, y: f_expand(x, y, []), jax.ShapeDtypeStruct((2, 4), dtype),
                              jax.ShapeDtypeStruct((3, 4), dtype)).shape)
    d = r.choice([1, 2, 3, 3, 4, 5, 7])
    factor = r.choice([0.5, 1.5, 3, 6, 12])
    elements = factor * threshold / itemsize / (d if rank == 3 else 1)
    ratio = r.choice([0.25, 0.5, 1, 1, 2, 4])
    n = _size(r, math.sqrt(elements * ratio))
    m = _size(r, elements / n)
    if r.boolean(0.04):   # size-0 dimensions
        which = r.choice(["n", "m", "d"])
        n, m, d = (0 if which == "n" else n), (0 if which == "m" else m), (0 if which == "d" else d)

    x_id, y_id = ctx.input((n, d)), ctx.input((m, d))
    stages: list[Callable] = []   # each maps (value, args) -> value; the first takes args only

    def operand(k):
        fns = []
        for _ in range(r.choice([0, 0, 0, 1])):
            p = _pick(r, "input", dtype)
            current = _aval(lambda *a: _chain(fns, a[k], a), ctx.inputs)
            f, desc = p.make(r, ctx, current)
            fns.append(f)
            pieces.append(f"input:{p.name}")
            notes.append(f"{'xy'[k]}:{desc}")
        return fns

    x_fns, y_fns = operand(x_id), operand(y_id)
    pieces.append(f"expand:{expand.name}")
    notes.append(expand_desc)

    def large(args):
        return f_expand(_chain(x_fns, args[x_id], args), _chain(y_fns, args[y_id], args), args)

    maps = []
    for _ in range(r.choice([0, 1, 1, 2])):
        current = _aval(lambda *a: _chain(maps, large(a), a), ctx.inputs)
        p = _pick(r, "map", dtype, len(current.shape), only_exact=only_exact)
        f, desc = p.make(r, ctx, current)
        maps.append(f)
        pieces.append(f"map:{p.name}")
        notes.append(desc)

    current = _aval(lambda *a: _chain(maps, large(a), a), ctx.inputs)
    reducer = reduce_probe
    if len(current.shape) not in reducer.ranks:
        table = [p for p in PIECES["reduce"].values()
                 if dtype in p.dtypes and len(current.shape) in p.ranks and p.indices == indices]
        reducer = r.weighted(table, [p.weight for p in table])
    f_reduce, desc = reducer.make(r, ctx, current)
    pieces.append(f"reduce:{reducer.name}")
    notes.append(desc)

    def stage(value, args):
        return f_reduce(_chain(maps, value, args), args)

    def reduced(args):
        return stage(large(args), args)

    posts = []
    for _ in range(r.choice([0, 0, 0, 1, 1, 2])):
        main = _aval(lambda *a: _chain(posts, reduced(a)[0], a), ctx.inputs)
        if not main.shape:
            break
        p = _pick(r, "post", _dtype_class(main.dtype), len(main.shape))
        f, desc = p.make(r, ctx, main)
        posts.append(f)
        pieces.append(f"post:{p.name}")
        notes.append(desc)

    def program(*args):
        outs = reduced(args)
        return (_chain(posts, outs[0], args),) + tuple(outs[1:])

    batch_axis = None
    if allow_wrap and r.boolean(0.3):
        table = [p for p in PIECES["wrap"].values() if dtype in p.dtypes]
        wrap = r.weighted(table, [p.weight for p in table])
        wrap_fn, batch_axis, desc = wrap.make(r, ctx)
        program = wrap_fn(program)
        pieces.append(f"wrap:{wrap.name}")
        notes.append(desc)

    specials = ""
    if dtype != "int32" and r.boolean(0.2):
        specials = r.choice(["nan", "inf", "nan+inf"])
    input_seed = r.integer(0, 2**31 - 1)
    # drawn last, so that every earlier choice of a seed is what it was before this piece existed
    if not reducer.indices and r.boolean(0.15):
        table = [p for p in PIECES["custom"].values() if dtype in p.dtypes]
        if table:
            custom = r.choice(table)
            wrap_stage, desc = custom.make(r, ctx)
            stage = wrap_stage(stage)   # reads maps and f_reduce when called: a frontier piece below shows
            pieces.append(f"custom:{custom.name}")
            notes.append(desc)
    # drawn after everything else, so that a program that draws none is the one it was without them
    if frontier and r.boolean(FRONTIER_P):
        table = [p for p in PIECES["frontier"].values()
                 if dtype in p.dtypes and len(current.shape) in p.ranks and (p.accepts is None or p.accepts(current))
                 and (p.stage == "map" or (not posts and not reducer.indices))]
        if table:
            late = r.weighted(table, [p.weight for p in table])
            f, desc = late.make(r, ctx, current)
            if late.stage == "map":
                maps.append(f)
            else:
                f_reduce = f
            pieces.append(f"frontier:{late.name}")
            notes.append(desc)
    description = (f"{dtype} n={n} m={m} d={d}{' grid' if grid else ''}{' ' + specials if specials else ''} | "
                   + " | ".join(notes))
    return Program(label=label, dtype=dtype, pieces=tuple(pieces), description=description, inputs=ctx.inputs,
                   fn=program, input_seed=input_seed, grid=grid, specials=specials,
                   indices=reducer.indices, batch_axis=batch_axis,
                   exact=grid and all(PIECES[p.split(":")[0]][p.split(":")[1]].exact for p in pieces))


def _chain(fns, value, args):
    for f in fns:
        value = f(value, args)
    return value


# ------------------------------------------------------------------------------------- strategy
@st.composite
def programs(draw, threshold: int = 32_000, x64: bool = False):
    """A hypothesis strategy of random :class:`Program` s around ``threshold`` bytes."""
    return draw_program(HypothesisDraw(draw), threshold, label="hypothesis", x64=x64, frontier=True)
