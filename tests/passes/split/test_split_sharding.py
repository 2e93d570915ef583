"""The split pass on sharded programs, traced on one device with an abstract 4-device mesh: an axis
cut across devices is never split (explicit types, jit arguments' shardings, sharding constraints),
loop carries keep explicit shardings and shard_map's varying manual axes (the rewritten program
type-checks), and the module attributes the lowering reads. Numbers, gradients and per-device memory
on real devices: tests/core/test_sharding.py."""

import jax
import jax.numpy as jnp
import pytest
from hlopass import internals as jx
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

from hlopass import settings, sharding
from hlopass.passes.split import SplitPass, sharded_values

N, M = 400, 301
#: Rows sharded 4 ways: each device's share of the (4N, M, 3) difference is that of the unsharded (N, M, 3) one.
ROWS4 = ((4 * N, 3), (M, 3), (M,))
CONFIG = settings.resolve({"threshold": "400kB", "split_size": "200kB", "passes": "split"})


def kmv(x, y, v):
    return jnp.exp(-jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, -1)) @ v


def mesh(kind=AxisType.Explicit):
    return AbstractMesh((4,), ("x",), axis_types=(kind,))


def traced(fn, specs, kind=AxisType.Explicit, shapes=((N, 3), (M, 3), (M,))):
    m = mesh(kind)
    with jax.sharding.use_abstract_mesh(m):
        avals = [jx.ShapedArray(s, jnp.float32, sharding=NamedSharding(m, p)) for s, p in zip(shapes, specs)]
        return jax.make_jaxpr(fn)(*avals)


def split_axes(report) -> list:
    return [(r.details["axis"], r.details["size"]) for r in report.rewrites if r.kind == "split"]


def run_split(closed):
    new, report = SplitPass().run(closed, CONFIG)
    jx.check_jaxpr(new.jaxpr)
    assert [str(a) for a in new.out_avals] == [str(a) for a in closed.out_avals]  # types, shardings included
    return new, report


def test_explicit_rows_sharded_splits_the_other_axis():
    new, report = run_split(traced(kmv, [P("x"), P(), P()], shapes=ROWS4))
    assert split_axes(report) == [(1, M)]
    assert str(new.out_avals[0]) == f"float32[{4 * N}@x]"


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
def test_threshold_compares_each_devices_share(kind):
    """N rows sharded 4 ways: the (N, M, 3) difference is over the threshold as a whole array
    (1.4 MB) but each device holds a quarter (361 kB, under 400 kB): nothing to split. The same
    program unsharded is split (test_unsharded_program_splits_the_rows)."""
    if kind == AxisType.Explicit:
        closed = traced(kmv, [P("x"), P(), P()])
        _, report = run_split(closed)
    else:
        closed = jax.make_jaxpr(kmv)(jnp.zeros((N, 3)), jnp.zeros((M, 3)), jnp.zeros(M))
        with sharding.inputs_sharded(((4, 1), None, None)):
            _, report = run_split(closed)
    assert split_axes(report) == []


def test_split_size_bounds_each_devices_share():
    """Rows sharded 4 ways: a step holds as many columns as fit in the split size on one device, 4
    times what would fit if the whole (global) step had to (fewer iterations)."""
    closed = jax.make_jaxpr(kmv)(jnp.zeros((4 * N, 3)), jnp.zeros((M, 3)), jnp.zeros(M))
    with sharding.inputs_sharded(((4, 1), None, None)):
        _, report = run_split(closed)
    (entry,) = [r for r in report.rewrites if r.kind == "split"]
    column = N * 3 * 4  # bytes of one column of each device's (N, M, 3) difference
    assert entry.details["axis"] == 1 and entry.details["chunk_bytes"] == entry.details["chunk"] * column
    assert entry.details["chunk"] * column <= CONFIG.split_size < entry.details["chunk"] * 4 * column
    assert "per device" in entry.summary


def test_jit_argument_shardings_under_an_auto_mesh():
    closed = jax.make_jaxpr(kmv)(jnp.zeros((4 * N, 3)), jnp.zeros((M, 3)), jnp.zeros(M))
    with sharding.inputs_sharded(((4, 1), None, None)):
        _, report = run_split(closed)
    assert split_axes(report) == [(1, M)]
    _, report = run_split(closed)
    assert split_axes(report) == [(0, 4 * N)]


def test_with_sharding_constraint_marks_the_axis():
    auto = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,))

    def program(x, y, v):
        return kmv(jax.lax.with_sharding_constraint(x, NamedSharding(auto, P("x"))), y, v)
    closed = jax.make_jaxpr(program)(jnp.zeros((N, 3)), jnp.zeros((M, 3)), jnp.zeros(M))
    # a 1-device mesh cuts nothing: the rows may be split
    assert not sharded_values(closed.jaxpr)
    _, report = run_split(closed)
    assert split_axes(report) == [(0, N)]


def test_shardings_followed_through_the_program():
    closed = traced(kmv, [P("x"), P(), P()], kind=AxisType.Explicit)
    found = sharded_values(closed.jaxpr)
    assert found[closed.jaxpr.outvars[0]] == (4,)
    closed = jax.make_jaxpr(kmv)(jnp.zeros((N, 3)), jnp.zeros((M, 3)), jnp.zeros(M))
    with sharding.inputs_sharded(((4, 1), None, None)):
        found = sharded_values(closed.jaxpr)
    reduced = [e.outvars[0] for e in closed.jaxpr.eqns if e.primitive.name == "reduce_sum"][0]
    assert found[reduced] == (4, 1) and found[closed.jaxpr.outvars[0]] == (4,)


COLLECTIVES = {
    "psum": lambda local: local / jax.lax.psum(local.sum(), "x"),
    "all_gather": lambda local: local * jax.lax.all_gather(local, "x").sum(0),
    "ppermute": lambda local: local + jax.lax.ppermute(local, "x", [(k, (k + 1) % 4) for k in range(4)]),
}


@pytest.mark.parametrize("collective", sorted(COLLECTIVES))
def test_shard_map_body_split_with_varying_carries(collective):
    m = mesh(AxisType.Auto)

    def program(x, y, v):
        def body(a, b, c):
            return COLLECTIVES[collective](kmv(a, b, c))
        return jax.shard_map(body, mesh=m, in_specs=(P("x"), P(), P()), out_specs=P("x"))(x, y, v)
    with jax.sharding.use_abstract_mesh(m):
        closed = jax.make_jaxpr(program)(jnp.zeros((4 * N, 3)), jnp.zeros((M, 3)), jnp.zeros(M))
    new, report = run_split(closed)
    assert split_axes(report) == [(0, N)]   # the body's own rows: each device's block
    body = [e for e in new.jaxpr.eqns if e.primitive.name == "shard_map"][0].params["jaxpr"]
    loops = [e for e in body.eqns if e.primitive.name in ("scan", "while")]
    assert loops and all("{V:x}" in str(v.aval) for e in loops for v in e.outvars if v.aval.shape)
    names = [e.primitive.name for e in body.eqns]
    assert any(name.startswith(collective) for name in names), names  # left in place


def test_shard_map_body_does_not_take_the_jit_arguments_shardings():
    """A body with as many inputs of the same ranks as the program is not the program: its block's
    rows are each device's own (split along axis 0, at their full per-device size)."""
    m = mesh(AxisType.Auto)

    def program(x, y, v):
        return jax.shard_map(kmv, mesh=m, in_specs=(P("x"), P(), P()), out_specs=P("x"))(x, y, v)
    with jax.sharding.use_abstract_mesh(m):
        closed = jax.make_jaxpr(program)(jnp.zeros((4 * N, 3)), jnp.zeros((M, 3)), jnp.zeros(M))
    with sharding.inputs_sharded(((4, 1), None, None)):
        _, report = run_split(closed)
    assert split_axes(report) == [(0, N)]


def _shard_map_grad():
    m = mesh(AxisType.Auto)

    def program(x, y, v):
        def body(a, b, c):
            local = kmv(a, b, c)
            return local / jax.lax.psum(local.sum(), "x")
        return jax.shard_map(body, mesh=m, in_specs=(P("x"), P(), P()), out_specs=P("x"))(x, y, v)
    def pullback(x, y, v, ct):  # as hlopass's backward program: the cotangent is an input
        return jax.vjp(program, x, y, v)[1](ct)
    with jax.sharding.use_abstract_mesh(m):
        return jax.make_jaxpr(pullback)(jnp.zeros((4 * N, 3)), jnp.zeros((M, 3)), jnp.zeros(M), jnp.zeros(4 * N))


def test_gradient_shard_maps_joined_across_their_residuals():
    """The pullback of a shard_map: the forward body's per-device residuals (N x M on each device) go
    to the transposed body. The split pass joins the two shard_maps, so that one body computes and
    reads them, and splits across them: no value over the split size is left in the joined body."""
    closed = _shard_map_grad()
    maps = [e for e in closed.jaxpr.eqns if e.primitive.name == "shard_map"]
    assert len(maps) == 2
    residuals = [v for v in maps[1].params["jaxpr"].invars if v.aval.size * 4 > CONFIG.split_size]
    assert residuals  # the large per-device values cross from one shard_map to the other
    new, report = run_split(closed)
    assert [r.kind for r in report.rewrites][0] == "join" and split_axes(report)
    (joined,) = [e for e in new.jaxpr.eqns if e.primitive.name == "shard_map"]
    body = joined.params["jaxpr"]
    assert all(v.aval.size * 4 <= CONFIG.threshold for v in body.invars + body.outvars if hasattr(v, "aval"))
    top = [e for e in body.eqns if e.primitive.name not in ("scan", "while")]
    assert all(v.aval.size * 4 <= CONFIG.threshold for e in top for v in e.outvars)
    names = [e.primitive.name for e in body.eqns]
    assert any(name.startswith("psum") for name in names), names  # the collectives stay


def test_shard_maps_with_different_specs_are_not_joined():
    """A residual passed out with one spec and read back with another is not a device's own block."""
    from hlopass.passes.split.fuse import fuse_shard_maps
    closed = _shard_map_grad()
    maps = [i for i, e in enumerate(closed.jaxpr.eqns) if e.primitive.name == "shard_map"]
    second = closed.jaxpr.eqns[maps[1]]
    specs = tuple(P() if isinstance(s, P) and s == P("x") else s for s in second.params["in_specs"])
    eqns = list(closed.jaxpr.eqns)
    eqns[maps[1]] = second.replace(params=dict(second.params, in_specs=specs))
    changed = jx.ClosedJaxpr(closed.jaxpr.replace(eqns=eqns), closed.consts)
    assert fuse_shard_maps(changed, CONFIG.threshold)[1] == 0
    assert fuse_shard_maps(closed, CONFIG.threshold)[1] == 1


@pytest.mark.parametrize("text, meshes, rank, expected", [
    ('#sdy.sharding<mesh<["x"=4]>, [{"x"}, {}]>', {}, 2, (4, 1)),
    ('#sdy.sharding<@mesh, [{}, {"x", "y"}]>', {"mesh": {"x": 2, "y": 3}}, 2, (1, 6)),
    ('#sdy.sharding<@mesh, [{"x":(1)2}, {}]>', {"mesh": {"x": 4}}, 2, (2, 1)),
    ('#sdy.sharding<mesh<["x"=4]>, [{}, {}]>', {}, 2, None),
    ('#sdy.sharding<mesh<["x"=4]>, [{"x"}]>', {}, 2, None),      # rank mismatch: unknown
])
def test_sdy_sharding_attributes(text, meshes, rank, expected):
    assert sharding.parse_sdy_sharding(text, meshes, rank) == expected


@pytest.mark.parametrize("text, rank, spec", [
    ('#sdy.sharding<mesh<["x"=1]>, [{"x"}, {}]>', 2, P("x", None)),
    ('#sdy.sharding<@mesh, [{}, {"x", "y"}]>', 2, P(None, ("x", "y"))),
    ('#sdy.sharding<@mesh, [{"x":(1)1}, {}]>', 2, None),       # sub-axes: not rebuilt
    ('#sdy.sharding<mesh<["x"=1]>, [{"x"}]>', 2, None),        # rank mismatch
    ('#sdy.sharding<mesh<["x"=8]>, [{"x"}]>', 1, None),        # more devices than there are
])
def test_named_shardings_rebuilt_from_sdy_attributes(text, rank, spec):
    """The split pass's memory check compiles with these (one device's figures)."""
    found = sharding._named_sharding(text, {"mesh": {"x": 1, "y": 1}}, rank, jax.devices()[:1])
    assert (found is None) if spec is None else (found.spec == spec and dict(found.mesh.shape) in
                                                 ({"x": 1}, {"x": 1, "y": 1}))
