"""What keeps the split's planning cheap, checked on what it does rather than on its seconds
(timings are the benchmarks' job: ``tools/bench_compile.py``, ``tools/bench_remat.py``)."""

import jax
import jax.numpy as jnp
import numpy as np

import hlopass
from hlopass.graph import DataflowGraph
from hlopass.passes.split import region as region_module
from hlopass.passes.split.region import Infeasible, grow_region, seed_labels, seeds

N = 1024  # x is N x N float32: 4 MB


def transposed_then_long(a, b):
    """A row sum of ``x + x.T`` (one loop cannot read ``x`` along both axes), and a long chain read from ``x``."""
    x = jnp.exp(a @ b.T)
    s = jnp.sum(x + x.T, axis=0)
    z = x
    for _ in range(40):
        z = jnp.sin(z) + 0.5 * z
    return s, jnp.sum(z, axis=1)


def test_a_region_read_along_two_axes_fails_before_it_takes_in_the_rest(monkeypatch):
    """The grower raises as soon as a region value is read along another axis (or a reduced value along
    the axis), not after taking in every reader of every large value and checking at the end: a region
    that fails was most of a planning's time on the Transformer blocks under their memory limit."""
    a = jax.random.normal(jax.random.PRNGKey(0), (N, 8))
    b = jax.random.normal(jax.random.PRNGKey(1), (N, 8))
    jaxpr = jax.make_jaxpr(transposed_then_long)(a, b).jaxpr
    graph = DataflowGraph(jaxpr)
    threshold = 1 << 20
    added = []
    real_add = region_module._Grower._add
    monkeypatch.setattr(region_module._Grower, "_add", lambda self, *args: (added.append(args[1]), real_add(self, *args))[1])
    first = min(seeds(jaxpr, threshold))  # the row sum of x + x.T
    assert jaxpr.eqns[first].primitive.name == "reduce_sum"
    failures = []
    for label in seed_labels(jaxpr, first, threshold, graph):
        added.clear()
        try:
            grow_region(jaxpr, graph, first, label, threshold)
        except Infeasible as err:
            failures.append((err.reason, len(added)))
    assert failures, "each axis of x + x.T reads x along the other one"
    for reason, count in failures:
        assert reason == "reads a region value along another axis"
        assert count < 20 < len(jaxpr.eqns) // 4, (count, len(jaxpr.eqns))


def test_a_region_read_along_two_axes_is_reported_and_left_as_written():
    a = jax.random.normal(jax.random.PRNGKey(0), (N - 3, 8))
    b = jax.random.normal(jax.random.PRNGKey(1), (N - 3, 8))
    f = hlopass.jit(transposed_then_long, threshold="1MB", passes="split")
    report = f.trace(a, b).report
    assert not report.rewrites
    assert any("reads a region value along another axis" in s.reason for s in report.skipped), report.skipped
    for got, want in zip(f(a, b), jax.jit(transposed_then_long)(a, b)):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def _swept(jaxpr, graph, region, between, sources) -> list[int]:
    """The equations of ``between`` reading only ``sources``, others found, or outside values, by a sweep
    over all of ``between`` in program order (what ``online`` did before it searched forwards)."""
    found: set[int] = set()
    inside = set(between)
    for i in sorted(inside):
        if jaxpr.eqns[i].effects:
            continue
        if all(not hasattr(a, "aval") or type(a).__name__ == "Literal" or a in sources
               or (j := graph.producer.get(a)) is None or j in found or (j not in region.eqns and j not in inside)
               for a in jaxpr.eqns[i].invars):
            found.add(i)
    return sorted(found)


def test_shift_and_final_programs_are_what_a_sweep_over_the_whole_between_finds(monkeypatch):
    """The shift and final programs are found forwards from the readers of the running maxima and sums;
    on two stacked attention blocks' gradient and a masked softmax, every answer equals a sweep over all
    the equations between the region and itself."""
    from hlopass.passes.split import online
    from tools.bench_remat import transformer_loss
    asked = []

    def checked(name, sources_of):
        real = getattr(online, name)

        def check(jaxpr, graph, region, between, *rest):
            got = real(jaxpr, graph, region, between, *rest)
            want = _swept(jaxpr, graph, region, list(between), sources_of(jaxpr, region))
            limit = rest[0] if rest else None
            assert got == (want[:limit + 1] if limit is not None and len(want) > limit else want)
            asked.append((name, len(got)))
            return got
        monkeypatch.setattr(online, name, check)
        monkeypatch.setattr(region_module, name, check)

    checked("shift_equations", lambda jaxpr, region: {
        v for i in online.running_reducers(jaxpr, region) for v in jaxpr.eqns[i].outvars})
    checked("final_equations", lambda jaxpr, region: {
        v for i, m in region.reducing.items() if m in ("add", *online.RUNNING) for v in jaxpr.eqns[i].outvars}
        | {v for i in region.shift for v in jaxpr.eqns[i].outvars})
    rng = np.random.default_rng(0)
    shapes = [(16, 16)] * 4 + [(16, 32), (32, 16)]
    params = [tuple(jnp.asarray(rng.standard_normal(s) / 4, jnp.float32) for s in shapes) for _ in range(2)]
    x = jnp.asarray(rng.standard_normal((127, 16)), jnp.float32)
    grad = jax.grad(transformer_loss)
    f = hlopass.jit(grad, threshold=int(0.6 * 127 * 127 * 4), passes="split")
    assert f.trace(params, x).report.rewrites

    def masked(q, k, v):
        s = q @ k.T
        return jax.nn.softmax(s, axis=1, where=s > -1.0) @ v
    q, k, v = (jnp.asarray(rng.standard_normal((301, 8)), jnp.float32) for _ in range(3))
    g = hlopass.jit(masked, threshold=100_000, passes="split")
    assert g.trace(q, k, v).report.rewrites
    np.testing.assert_allclose(g(q, k, v), jax.jit(masked)(q, k, v), rtol=2e-5, atol=1e-5)
    assert {name for name, n in asked if n} == {"shift_equations", "final_equations"}, asked
