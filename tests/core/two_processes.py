"""One of two processes on this machine (``jax.distributed``, CPU, coordinator on localhost), each with
two host devices: a kernel matvec and a kNN on query rows sharded across all four devices, run by
hlopass and by ``jax.jit``. Started by ``tests/core/test_sharding.py::test_two_processes``:

    python -m tests.core.two_processes PROCESS_ID PORT

prints one ``ROW`` JSON line: the largest relative differences (this process's shards and the
gathered whole), the output shardings, and this process's per-device XLA temporaries.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-30)


def main(process_id: int, port: int) -> None:
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=120)
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import hlopass
    from tests.core.sharded_programs import D, M, N, SPLIT, THRESHOLD, kernel_matvec, knn

    assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(0)  # the same global data in both processes
    host = [rng.standard_normal((N, D)).astype(np.float32), rng.standard_normal((M, D)).astype(np.float32),
            rng.standard_normal(M).astype(np.float32)]
    specs = [P("x"), P(), P()]
    x, y, v = [jax.make_array_from_callback(a.shape, NamedSharding(mesh, s), lambda idx, a=a: a[idx])
               for a, s in zip(host, specs)]
    assert not x.is_fully_addressable

    row = dict(process=process_id)
    for name, fn, args in [("matvec", kernel_matvec, (x, y, v)), ("knn", knn, (x, y))]:
        ours = hlopass.jit(fn, threshold=THRESHOLD, split_size=SPLIT)
        ref = jax.jit(fn)
        out, expected = jax.tree_util.tree_leaves(ours(*args)), jax.tree_util.tree_leaves(ref(*args))
        local = 0.0
        for a, b in zip(out[:1], expected[:1]):  # kNN: distances here, indices checked below
            for sa, sb in zip(a.addressable_shards, b.addressable_shards):
                assert sa.index == sb.index
                local = max(local, _rel(sa.data, sb.data))
        whole = [multihost_utils.process_allgather(a, tiled=True) for a in out]
        whole_ref = [multihost_utils.process_allgather(b, tiled=True) for b in expected]
        gathered = _rel(whole[0], whole_ref[0])
        if name == "knn":  # near-tied neighbours may come in either order: the distances must agree
            at_index = np.sum((host[0][:, None, :] - host[1][np.asarray(whole[1])]) ** 2, axis=-1)
            gathered = max(gathered, _rel(at_index, whole_ref[0]))
        memory = ours.lower(*args).compile().memory_analysis()
        memory_ref = ref.lower(*args).compile().memory_analysis()
        row[name] = dict(local_error=local, gathered_error=gathered,
                         shardings=[str(a.sharding.spec) for a in out],
                         same_shardings=all(a.sharding.is_equivalent_to(b.sharding, a.ndim)
                                            for a, b in zip(out, expected)),
                         shape=list(whole[0].shape), temp=int(memory.temp_size_in_bytes),
                         arguments=int(memory.argument_size_in_bytes), outputs=int(memory.output_size_in_bytes),
                         jit_temp=int(memory_ref.temp_size_in_bytes), split_size=SPLIT,
                         splits=sum(1 for r in ours.trace(*args).report.rewrites if r.kind == "split"))
    print("ROW " + json.dumps(row), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("HLOPASS_RAISE_PASS_ERRORS", "1")
    main(int(sys.argv[1]), int(sys.argv[2]))
